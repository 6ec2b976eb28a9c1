"""Family plugins: discovery through the C++ registry, their torch op namespaces, and the families
registered from Python (``_registered.register_family`` adds them to ``REGISTRY``).

The shared ops (``torch.ops.tree_recurrence.tree_conv``, ``.chunk_state_pass``: ``_shared_ops``) are loaded
before any plugin: when this module is imported and before every scan.

Folders searched, in order: the package's own ``plugins`` folder, every folder of
TREE_RECURRENCE_PLUGIN_PATH (os.pathsep-separated), then folders given to ``add_plugin_path``.
A refused plugin is listed with its reason (``doctor``) and never loaded into a crash.

Records' text fields (family, version, error, manifest values, ...) are ``str`` whatever bytes the files
hold: bytes that are not UTF-8 are shown as ``\\xNN`` escapes. Their paths (manifest_path, library_path)
are decoded as ``os.fsdecode`` does (such bytes as surrogates), so each still names its file.

TREE_RECURRENCE_DISABLE_FAMILIES (comma- or os.pathsep-separated family names) makes those families
absent: they are listed as refused ("disabled by ...") and ``install`` treats their models as it
would without the plugin. The package folder is always searched, so this is the way to run without
one of its families. A disabled plugin's library may still be loaded (the registry loads every
manifest of a folder); nothing of it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _core, _native_schema, _shared_ops, settings
from ._specs import Family, SeamSpec, SpecError, parse_seams

PACKAGE_PLUGIN_DIR = Path(_core.__file__).resolve().parent / "plugins"

# The last scan: the folders it covered, its records and the loaded ones' Family by name.
Scan = tuple[tuple[str, ...], list[dict[str, Any]], dict[str, Family]]


@dataclass
class Registry:
    """The process's plugin registry: everything the family registry keeps between calls, in one object
    (``REGISTRY``). The loaded libraries themselves are the C++ registry's (``_core``)."""

    # folders given to ``add_plugin_path``, searched after the package's and TREE_RECURRENCE_PLUGIN_PATH's
    extra_folders: list[str] = field(default_factory=list)
    # Families registered from Python (``_registered.register_family``): name -> its Family (python=True,
    # with ``detect``: module description dict -> (claimed, role, reason)).
    python_families: dict[str, Family] = field(default_factory=dict)
    # names of Python-registered families a loaded plugin of that name shadows
    shadowed: set[str] = field(default_factory=set)
    # The last scan. Every seam call asks for the families, so scanning folders and building families must
    # not happen per call.
    scan: Scan | None = None
    # family -> the package its Python folder was imported as (``family_python_module``)
    python_packages: dict[str, Any] = field(default_factory=dict)

    def add_python_family(self, record: Family) -> None:
        self.python_families[record.name] = record

    def remove_python_family(self, name: str) -> None:
        del self.python_families[name]
        self.shadowed.discard(name)


REGISTRY = Registry()


def plugin_folders() -> list[str]:
    folders = [str(PACKAGE_PLUGIN_DIR)]
    folders += settings.get("TREE_RECURRENCE_PLUGIN_PATH")
    return folders + REGISTRY.extra_folders


def add_plugin_path(folder: str | bytes | os.PathLike) -> list[dict[str, Any]]:
    """Registers a plugin folder and loads what is new there; returns the new records. A name that is not
    UTF-8 is kept as ``os.fsdecode`` makes it (the registry gets its bytes back, ``os.fsencode``)."""
    folder = os.fsdecode(folder)
    _load_shared_ops()
    if folder not in REGISTRY.extra_folders:
        REGISTRY.extra_folders.append(folder)
    added = [record for record, _ in _confined(_core.discover_plugins([folder]))]
    REGISTRY.scan = None
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


def _load_shared_ops() -> None:
    """The shared ops library, before any plugin (which links it); not under a torch this build is not for."""
    if runtime_mismatch() is None:
        _shared_ops.load()


DISABLE_ENV = "TREE_RECURRENCE_DISABLE_FAMILIES"


def disabled_families() -> set[str]:
    """Family names TREE_RECURRENCE_DISABLE_FAMILIES switches off (read at each call)."""
    return set(settings.get(DISABLE_ENV))


def _disabled_record(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "loaded": False, "error": f"disabled by {DISABLE_ENV}"}


def discover(rescan: bool = False) -> list[dict[str, Any]]:
    """All plugin records, loaded or refused. Folders are scanned on first use, when the folder list
    changes (TREE_RECURRENCE_PLUGIN_PATH, add_plugin_path) and with ``rescan=True`` (new manifests
    in known folders; ``doctor`` does this)."""
    mismatch = runtime_mismatch()
    if mismatch:
        return [{"family": "*", "version": "", "manifest_path": "", "library_path": "", "loaded": False,
                 "error": mismatch, "fingerprint": "", "manifest": None, "kernels": []}]
    scan = _scanned(rescan)
    disabled = disabled_families()
    if disabled:
        return [_disabled_record(r) if r["family"] in disabled and r["loaded"] else r for r in scan[1]]
    return scan[1]


def _scanned(rescan: bool = False) -> Scan:
    folders = tuple(plugin_folders())
    scan = REGISTRY.scan
    if rescan or scan is None or scan[0] != folders:
        _load_shared_ops()
        _core.discover_plugins(list(folders))
        pairs = _confined(_core.plugin_records())
        scan = REGISTRY.scan = (folders, [record for record, _ in pairs], {f.name: f for _, f in pairs if f is not None})
    return scan


def _confined(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Family | None]]:
    """Each record with its Family, built once here (seams parsed, keys checked), or the record turned into
    a refusal naming why: an invalid seam spec or record, Python escaping its folder, a failed load check."""
    out = []
    for record in records:
        family, reason = None, None
        if record.get("loaded"):
            family, reason = _built(record)
            reason = reason or python_escape(family) or _load_check_error(family)
        out.append(({**record, "loaded": False, "error": reason}, None) if reason else (record, family))
    return out


def _built(record: dict[str, Any]) -> tuple[Family | None, str | None]:
    source = record.get("manifest_path") or record.get("family")
    try:
        seams = parse_seams(source, (record.get("manifest") or {}).get("seams"))
    except SpecError as error:
        return None, f"invalid seam spec: {error}"
    try:
        return Family.from_record(record, seams), None
    except SpecError as error:
        return None, f"invalid family record: {error}"


def _family(record: Family | dict[str, Any]) -> Family:
    """``record`` as a Family (a registry record is built, its problems raised as SpecError)."""
    return record if isinstance(record, Family) else Family.from_record(record)


def loaded_family(record: dict[str, Any]) -> Family:
    """The Family built at load for a loaded record of ``discover`` (``doctor``)."""
    found = _scanned()[2].get(record["family"])
    return found if found is not None and found.manifest_path == record.get("manifest_path") else _family(record)


def seam_specs(record: Family | dict[str, Any]) -> dict[str, SeamSpec]:
    """A family's seams as the ``SeamSpec`` s parsed at load (``Family.seams``; a mapping made elsewhere has
    its manifest's seams parsed now)."""
    return _family(record).seams


def _load_check_error(record: Family) -> str | None:
    """A loaded plugin's native ops against the schema the driver calls them by (``_native_schema``), and
    its manifest's keys (``manifest_error``): the error naming the manifest, seam / key and op, or None."""
    problem = _native_schema.check_record(record)
    if problem:
        return f"native op schema: {problem}"
    return manifest_error(record)


def manifest_error(record: Family) -> str | None:
    """Why a loaded family's manifest is refused (a ``routes:`` key: timings are never hand-typed), or None."""
    manifest = getattr(record, "manifest", None) or {}
    if "routes" in manifest:
        where = getattr(record, "manifest_path", "") or getattr(record, "name", "?")
        return (f"{where}: 'routes:' is not a manifest key: route timings are measured on the user's machine by "
                "`python -m tree_recurrence tune` (a record in the user's cache folder), never written into a manifest")
    return None


def families() -> dict[str, Family]:
    """Loaded families by name (their ``Family``, built at load), then those registered from Python
    (``REGISTRY.python_families``). Plugins found later in the search order never replace one, and a
    Python-registered family never replaces a plugin."""
    disabled = disabled_families()
    found = {} if runtime_mismatch() else {n: f for n, f in _scanned()[2].items() if n not in disabled}
    shadowed = REGISTRY.shadowed
    for name, record in REGISTRY.python_families.items():
        if name in found:
            shadowed.add(name)
        else:
            shadowed.discard(name)
            if name not in disabled:
                found[name] = record
    return found


def detect(family: str, description: dict) -> tuple[bool, str, str]:
    """(claimed, role, reason) of a loaded family's detector for one module description."""
    record = REGISTRY.python_families.get(family)
    if record is not None and family not in REGISTRY.shadowed:
        return record.detect(description)
    return _core.detect(family, description)


def refused() -> list[dict[str, Any]]:
    return [r for r in discover() if not r["loaded"]]


def ops(family: str):
    """The torch op namespace of a loaded family (``torch.ops.tree_recurrence_<family>``): its own ops. The ops
    families share (tree_conv, chunk_state_pass) are ``shared_ops()``'s."""
    record = families().get(family)
    if record is None:
        raise KeyError(f"no loaded family plugin named '{family}'")
    return getattr(torch.ops, record.op_namespace)


def shared_ops():
    """``torch.ops.tree_recurrence``: the ops every family shares (``_shared_ops``), registered once."""
    return _shared_ops.ops()


# --------------------------------------------------------------------------------------------
# a family's Python (its manifest's ``python:`` modules, installed next to the manifest as <family>/)
# --------------------------------------------------------------------------------------------

def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def python_escape(record: Family | dict[str, Any]) -> str | None:
    """Why a plugin's Python would be imported from outside the folder that holds its manifest, or None.

    Like its library (core/src/registry.cpp), a plugin's Python folder ``<family>/`` and each module its
    manifest's ``python:`` names must resolve, after symlinks, inside the manifest's folder: a symlinked
    folder or module, or a ``python:`` entry with ``..``, a path or an absolute name, is refused."""
    record = _family(record)
    if not record.manifest_path or record.python:
        return None
    family = record.name
    modules = record.manifest.get("python") or {}
    if not isinstance(modules, dict):
        return f"plugin '{family}': its manifest's python: must map roles to module names"
    try:
        root = Path(record.manifest_path).parent.resolve(strict=True)
        folder = Path(record.manifest_path).parent / family
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


def family_python_folder(record: Family | dict[str, Any]) -> Path | None:
    """Where a loaded plugin's Python lies: the folder ``<family>/`` next to its manifest (refused with
    PermissionError when it, or a module the manifest names, resolves outside the manifest's folder)."""
    record = _family(record)
    if not record.manifest_path or record.python:
        return None
    reason = python_escape(record)
    if reason:
        raise PermissionError(reason)
    folder = Path(record.manifest_path).parent / record.name
    return folder if folder.is_dir() else None


def family_python_module(family: str, module: str):
    """Imports ``module`` from a loaded family's Python folder (once; the folder is a package of its own,
    ``tree_recurrence_family_<family>``, so its modules import each other relatively)."""
    package = REGISTRY.python_packages.get(family)
    if package is None:
        record = families().get(family)
        if record is None:
            raise KeyError(f"no loaded family plugin named '{family}'")
        folder = family_python_folder(record)
        if folder is None:
            raise FileNotFoundError(f"family '{family}': its manifest names Python modules, but there is no folder "
                                    f"{Path(record.manifest_path).parent / family} (install the plugin with its "
                                    "PYTHON folder: tree_recurrence_add_family(... PYTHON python)")
        name = f"tree_recurrence_family_{family}"
        spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
        REGISTRY.python_packages[family] = package
    return importlib.import_module(f"{package.__name__}.{module}")


def family_python(family: str, role: str):
    """The module a loaded family's manifest names for ``role`` (``python: {stand_ins: ..., components:
    ...}``), or None when it names none."""
    record = families().get(family)
    module = record.python_modules.get(role) if record is not None else None
    return family_python_module(family, module) if module else None


def has_kernel(record: Family, name: str, device: torch.device) -> bool:
    """Whether the family ``record`` registered its kernel ``name`` (a torch op or ``tree_conv``) for
    ``device``'s type in this build."""
    return record.has_kernel(name, device.type)


_load_shared_ops()
