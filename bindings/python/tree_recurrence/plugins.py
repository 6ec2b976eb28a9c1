"""Family plugins: discovery through the C++ registry, their torch op namespaces, and families
registered from Python (``register_family``).

Folders searched, in order: the package's own ``plugins`` folder, every folder of
TREE_RECURRENCE_PLUGIN_PATH (os.pathsep-separated), then folders given to ``add_plugin_path``.
A refused plugin is listed with its reason (``doctor``) and never loaded into a crash.

TREE_RECURRENCE_DISABLE_FAMILIES (comma- or os.pathsep-separated family names) makes those families
absent: they are listed as refused ("disabled by ...") and ``install`` treats their models as it
would without the plugin. The package folder is always searched, so this is the way to run without
one of its families. A disabled plugin's library may still be loaded (the registry loads every
manifest of a folder); nothing of it is used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from . import _core
from ._specs import SeamSpec, SpecError, parse_seam, parse_seams

PACKAGE_PLUGIN_DIR = Path(_core.__file__).resolve().parent / "plugins"
_extra_folders: list[str] = []
# Families registered from Python (register_family, at the end of this module): name -> a record shaped like a plugin's, plus
# "detect" (a callable: module description dict -> (claimed, role, reason)) and "op_namespace".
python_families: dict[str, dict[str, Any]] = {}


def plugin_folders() -> list[str]:
    folders = [str(PACKAGE_PLUGIN_DIR)]
    folders += [f for f in os.environ.get("TREE_RECURRENCE_PLUGIN_PATH", "").split(os.pathsep) if f]
    return folders + _extra_folders


def add_plugin_path(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Registers a plugin folder and loads what is new there; returns the new records."""
    global _scan
    folder = os.fspath(folder)
    if folder not in _extra_folders:
        _extra_folders.append(folder)
    added = _confined_records(_core.discover_plugins([folder]))
    _scan = None
    return added


def runtime_mismatch() -> str | None:
    """Why the running torch cannot host this build's plugins, or None.

    The core and every plugin record the torch version and C++ ABI they were built with; a
    plugin for another torch would fail with undefined symbols or worse, so none is loaded."""
    built = _core.core_fingerprint()  # "torch X, cxx11_abi N, cuda ..."
    built_torch = built.split(",")[0].removeprefix("torch ").strip()
    running = torch.__version__.split("+")[0]
    if built_torch != running:
        return f"this build of tree-recurrence is for torch {built_torch}, but torch {running} is running: reinstall it"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    if f"cxx11_abi {abi}" not in built:
        return f"this build uses another C++ ABI than the running torch (cxx11_abi {abi}): reinstall it"
    return None


# Records of the last scan and the folders it covered: every seam call asks for the families, so
# scanning folders and converting manifests must not happen per call.
_scan: tuple[tuple[str, ...], list[dict[str, Any]]] | None = None

DISABLE_ENV = "TREE_RECURRENCE_DISABLE_FAMILIES"


def disabled_families() -> set[str]:
    """Family names TREE_RECURRENCE_DISABLE_FAMILIES switches off (read at each call)."""
    value = os.environ.get(DISABLE_ENV, "")
    return {name.strip() for name in value.replace(os.pathsep, ",").split(",") if name.strip()}


def _disabled_record(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "loaded": False, "error": f"disabled by {DISABLE_ENV}"}


def discover(rescan: bool = False) -> list[dict[str, Any]]:
    """All plugin records, loaded or refused. Folders are scanned on first use, when the folder list
    changes (TREE_RECURRENCE_PLUGIN_PATH, add_plugin_path) and with ``rescan=True`` (new manifests
    in known folders; ``doctor`` does this)."""
    global _scan
    mismatch = runtime_mismatch()
    if mismatch:
        return [{"family": "*", "version": "", "manifest_path": "", "library_path": "", "loaded": False,
                 "error": mismatch, "fingerprint": "", "manifest": None, "kernels": []}]
    folders = tuple(plugin_folders())
    if rescan or _scan is None or _scan[0] != folders:
        _core.discover_plugins(list(folders))
        _scan = (folders, _confined_records(_core.plugin_records()))
    disabled = disabled_families()
    if disabled:
        return [_disabled_record(r) if r["family"] in disabled and r["loaded"] else r for r in _scan[1]]
    return _scan[1]


def _confined_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with each loaded plugin whose Python escapes its folder turned into a refusal."""
    out = []
    for record in records:
        reason = (python_escape(record) or _seam_spec_error(record) or _load_check_error(record)) \
            if record.get("loaded") else None
        out.append({**record, "loaded": False, "error": reason} if reason else record)
    return out


def seam_specs(record: dict[str, Any]) -> dict[str, SeamSpec]:
    """A family record's seams as the ``SeamSpec`` s parsed at load (``record["seam_specs"]``; a record
    made elsewhere, without them, has its manifest's seams parsed now and kept there)."""
    specs = record.get("seam_specs")
    if specs is None:
        specs = record["seam_specs"] = parse_seams(record.get("manifest_path") or record.get("family", "<record>"),
                                                   (record.get("manifest") or {}).get("seams"))
    return specs


def _seam_spec_error(record: dict[str, Any]) -> str | None:
    """Parses a loaded plugin's seam specs once (``_specs``: every key checked) into
    ``record["seam_specs"]``; returns the error naming manifest, seam and key, or None."""
    try:
        record["seam_specs"] = parse_seams(record.get("manifest_path") or record["family"],
                                           (record.get("manifest") or {}).get("seams"))
    except SpecError as error:
        return f"invalid seam spec: {error}"
    return None


def _load_check_error(record: dict[str, Any]) -> str | None:
    """A loaded plugin's native ops against the schema the driver calls them by (``_native_schema``), and
    its measured routes table (``_routes``): the error naming the manifest, seam / key and op, or None."""
    from . import _native_schema, _routes

    problem = _native_schema.check_record(record)
    if problem:
        return f"native op schema: {problem}"
    try:
        _routes.family_table(record)
    except _routes.RoutesError as error:
        return f"invalid routes table: {error}"
    return None


def families() -> dict[str, dict[str, Any]]:
    """Loaded families by name, then those registered from Python (``python_families``). Plugins found later
    in the search order never replace one, and a Python-registered family never replaces a plugin."""
    found = {r["family"]: r for r in discover() if r["loaded"]}
    disabled = disabled_families()
    for name, record in python_families.items():
        record["shadowed"] = name in found
        if name not in disabled:
            found.setdefault(name, record)
    return found


def detect(family: str, description: dict) -> tuple[bool, str, str]:
    """(claimed, role, reason) of a loaded family's detector for one module description."""
    record = python_families.get(family)
    if record is not None and not record.get("shadowed"):
        return record["detect"](description)
    return _core.detect(family, description)


def refused() -> list[dict[str, Any]]:
    return [r for r in discover() if not r["loaded"]]


def ops(family: str):
    """The torch op namespace of a loaded family (``torch.ops.tree_recurrence_<family>``)."""
    record = families().get(family)
    if record is None:
        raise KeyError(f"no loaded family plugin named '{family}'")
    return getattr(torch.ops, record.get("op_namespace") or f"tree_recurrence_{family}")


# --------------------------------------------------------------------------------------------
# a family's Python (its manifest's ``python:`` modules, installed next to the manifest as <family>/)
# --------------------------------------------------------------------------------------------

_python_packages: dict[str, Any] = {}  # family -> the package its Python folder was imported as


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def python_escape(record: dict[str, Any]) -> str | None:
    """Why a plugin's Python would be imported from outside the folder that holds its manifest, or None.

    Like its library (core/src/registry.cpp), a plugin's Python folder ``<family>/`` and each module its
    manifest's ``python:`` names must resolve, after symlinks, inside the manifest's folder: a symlinked
    folder or module, or a ``python:`` entry with ``..``, a path or an absolute name, is refused."""
    if not record.get("manifest_path") or record.get("python"):
        return None
    family = record.get("family", "?")
    modules = ((record.get("manifest") or {}).get("python") or {})
    if not isinstance(modules, dict):
        return f"plugin '{family}': its manifest's python: must map roles to module names"
    try:
        root = Path(record["manifest_path"]).parent.resolve(strict=True)
        folder = Path(record["manifest_path"]).parent / family
        if not folder.exists() and not folder.is_symlink():
            return None  # no Python installed: family_python_module says so when one is needed
        resolved = folder.resolve(strict=True)
        if not _inside(resolved, root):
            return f"plugin '{family}': its Python folder {folder} resolves to {resolved}, outside the plugin folder {root}"
        for role, module in modules.items():
            parts = str(module).split(".")
            if not all(part.isidentifier() for part in parts):
                return (f"plugin '{family}': python: {role}: '{str(module)[:200]}' is not a dotted module name "
                        f"inside the plugin folder {root}")
            base = folder.joinpath(*parts)
            for candidate in (base.with_name(base.name + ".py"), base):
                if candidate.exists() or candidate.is_symlink():
                    target = candidate.resolve(strict=True)
                    if not _inside(target, root):
                        return (f"plugin '{family}': python: {role}: {candidate} resolves to {target}, "
                                f"outside the plugin folder {root}")
    except (OSError, RuntimeError) as error:
        return f"plugin '{family}': its Python folder cannot be resolved: {error}"[:2000]
    return None


def family_python_folder(record: dict[str, Any]) -> Path | None:
    """Where a loaded plugin's Python lies: the folder ``<family>/`` next to its manifest (refused with
    PermissionError when it, or a module the manifest names, resolves outside the manifest's folder)."""
    if not record.get("manifest_path") or record.get("python"):
        return None
    reason = python_escape(record)
    if reason:
        raise PermissionError(reason)
    folder = Path(record["manifest_path"]).parent / record["family"]
    return folder if folder.is_dir() else None


def family_python_module(family: str, module: str):
    """Imports ``module`` from a loaded family's Python folder (once; the folder is a package of its own,
    ``tree_recurrence_family_<family>``, so its modules import each other relatively)."""
    import importlib
    import importlib.util
    import sys

    package = _python_packages.get(family)
    if package is None:
        record = families().get(family)
        if record is None:
            raise KeyError(f"no loaded family plugin named '{family}'")
        folder = family_python_folder(record)
        if folder is None:
            raise FileNotFoundError(f"family '{family}': its manifest names Python modules, but there is no folder "
                                    f"{Path(record['manifest_path']).parent / family} (install the plugin with its "
                                    "PYTHON folder: tree_recurrence_add_family(... PYTHON python)")
        name = f"tree_recurrence_family_{family}"
        spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
        _python_packages[family] = package
    return importlib.import_module(f"{package.__name__}.{module}")


def family_python(family: str, role: str):
    """The module a loaded family's manifest names for ``role`` (``python: {stand_ins: ..., components:
    ...}``), or None when it names none."""
    record = families().get(family)
    module = ((record or {}).get("manifest") or {}).get("python", {}).get(role) if record else None
    return family_python_module(family, module) if module else None


def has_kernel(record: dict[str, Any], name: str, device: torch.device) -> bool:
    return any(k == name and d == device.type and ok for k, d, ok in record["kernels"])


# ------------------------------------------------------------------------------------------------
# families registered from Python
# ------------------------------------------------------------------------------------------------


def _names(value: str | Iterable[str], what: str) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"register_family: {what} must be a non-empty string or list of strings, got {value!r}")
    return items


def register_family(name: str, model_types: str | Iterable[str], mixer_classes: Iterable[type | str],
                    layer_types: str | Iterable[str], seams: dict[str, dict] | None = None, *,
                    modules: Iterable[str] | None = None, plan_carriers: Iterable[str] = (),
                    detect: Callable[[dict], tuple[bool, str, str]] | None = None, ops: str | None = None,
                    version: str = "0.1.0") -> dict:
    """Registers a family from Python; ``install`` then treats it like a manifest family.

    ``model_types``: the config ``model_type`` values it covers (informational, as in a manifest).
    ``mixer_classes``: the mixer classes (or class names, with ``modules``) that follow the tree;
    ``install`` claims modules of these classes (``detect(description) -> (claimed, role, reason)``
    replaces that test; ``(False, "recurrent", why)`` recognises a module as recurrent without covering
    it, and install answers "none" with ``why``) and patches nothing inside them. ``layer_types``: the ``layer_types`` values
    those mixers implement. ``seams``: module-level functions of the mixers' modeling modules to
    replace, spec by spec as in a manifest (docs/plugins.md; default none: a model that follows trees
    in its own code needs no seam). ``plan_carriers``: class names in those modules whose forward
    sets the plan context. ``ops``: a loaded family whose torch ops (``tree_conv``, native scans)
    the seams' adapters use. Returns the family's record (as ``families()`` lists it).
    A loaded plugin's name, or one already registered, is refused: unregister_family first."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"register_family: name {name!r} must be lower-case letters, digits and '_'")
    if name in python_families:
        raise ValueError(f"register_family: family '{name}' is already registered from Python; unregister_family first")
    if name in families():
        raise ValueError(f"register_family: a family plugin named '{name}' is loaded "
                         f"({families()[name]['library_path']}); choose another name")
    from .driver import ADAPTERS as adapters  # the driver imports this module

    model_types = _names(model_types, "model_types")
    layer_types = _names(layer_types, "layer_types")
    mixers, mixer_modules = [], []
    for cls in mixer_classes:
        if isinstance(cls, type):
            mixers.append(cls.__name__)
            mixer_modules.append(cls.__module__)
        elif isinstance(cls, str) and cls:
            mixers.append(cls)
        else:
            raise ValueError(f"register_family: mixer_classes must hold classes or class names, got {cls!r}")
    if not mixers:
        raise ValueError("register_family: mixer_classes is empty")
    module_names = list(dict.fromkeys([*(modules or []), *mixer_modules]))
    if not module_names:
        raise ValueError("register_family: mixer classes given by name need modules= (the modules defining them)")
    seam_specs, parsed = {}, {}
    for seam, spec in (seams or {}).items():
        if not isinstance(spec, dict) or spec.get("adapter") not in adapters:
            raise ValueError(f"register_family: seam '{seam}' needs an 'adapter' among {sorted(adapters)}, got {spec!r}")
        missing = [key for key in ("args",) + (("sequence",) if spec["adapter"] == "scan" else ()) if key not in spec]
        if missing:
            raise ValueError(f"register_family: seam '{seam}' ({spec['adapter']}) lacks {missing}")
        parsed[seam] = parse_seam(f"register_family('{name}')", seam, spec)  # every key checked as a manifest's
        seam_specs[seam] = dict(spec)
    kernels, namespace = [], f"tree_recurrence_{name}"
    if ops is not None:
        provider = families().get(ops)
        if provider is None:
            raise ValueError(f"register_family: ops='{ops}' names no loaded family (loaded: {sorted(families())})")
        kernels = list(provider["kernels"])
        namespace = provider.get("op_namespace") or f"tree_recurrence_{ops}"
        from . import _native_schema

        for seam, spec in parsed.items():  # the native ops it names: registered, with the driver's schema
            problem = _native_schema.check(f"register_family('{name}')", seam, spec, namespace)
            if problem:
                raise ValueError(problem)
    if detect is None:
        claimed = set(mixers)

        def detect(description: dict) -> tuple[bool, str, str]:
            if description["class_name"] in claimed:
                return True, "mixer", f"{name} mixer {description['class_name']} (registered from Python)"
            return False, "", ""

    entries = [{"model_type": mt, "module": module, "mixers": mixers, "layer_types": layer_types,
                "plan_carriers": list(plan_carriers)} for module in module_names for mt in model_types]
    record = {
        "family": name, "version": version, "manifest_path": "<registered from Python>", "library_path": "",
        "loaded": True, "error": "", "fingerprint": "python", "python": True,
        "manifest": {"schema": 1, "family": name, "version": version, "library": "", "models": entries,
                     "seams": seam_specs},
        "kernels": kernels, "detect": detect, "op_namespace": namespace, "seam_specs": parsed,
    }
    python_families[name] = record
    return record


def unregister_family(name: str) -> None:
    """Removes a family registered from Python (models already installed keep their hooks until
    ``uninstall``)."""
    if name not in python_families:
        raise KeyError(f"unregister_family: no family '{name}' registered from Python")
    del python_families[name]
