"""Families registered from Python (``register_family``): built as a ``Family`` like a manifest's, kept
in the registry (``plugins.REGISTRY``; ``plugins.families()`` lists them after the loaded plugins)."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from . import _native_schema, plugins
from ._specs import KNOWN_ADAPTERS, Family, parse_seam


def _names(value: str | Iterable[str], what: str) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"register_family: {what} must be a non-empty string or list of strings, got {value!r}")
    return items


def register_family(name: str, model_types: str | Iterable[str], mixer_classes: Iterable[type | str],
                    layer_types: str | Iterable[str], seams: dict[str, dict] | None = None, *,
                    modules: Iterable[str] | None = None, plan_carriers: Iterable[str] = (),
                    detect: Callable[[dict], tuple[bool, str, str]] | None = None, ops: str | None = None,
                    version: str = "0.1.0") -> Family:
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
    the seams' adapters use. Returns the family's ``Family`` (as ``families()`` lists it).
    A loaded plugin's name, or one already registered, is refused: unregister_family first."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"register_family: name {name!r} must be lower-case letters, digits and '_'")
    if name in plugins.REGISTRY.python_families:
        raise ValueError(f"register_family: family '{name}' is already registered from Python; unregister_family first")
    if name in plugins.families():
        raise ValueError(f"register_family: a family plugin named '{name}' is loaded "
                         f"({plugins.families()[name].library_path}); choose another name")
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
        if not isinstance(spec, dict) or spec.get("adapter") not in KNOWN_ADAPTERS:
            raise ValueError(f"register_family: seam '{seam}' needs an 'adapter' among {sorted(KNOWN_ADAPTERS)}, "
                             f"got {spec!r}")
        missing = [key for key in ("args",) + (("sequence",) if spec["adapter"] == "scan" else ()) if key not in spec]
        if missing:
            raise ValueError(f"register_family: seam '{seam}' ({spec['adapter']}) lacks {missing}")
        parsed[seam] = parse_seam(f"register_family('{name}')", seam, spec)  # every key checked as a manifest's
        seam_specs[seam] = dict(spec)
    kernels, namespace = [], f"tree_recurrence_{name}"
    if ops is not None:
        provider = plugins.families().get(ops)
        if provider is None:
            raise ValueError(f"register_family: ops='{ops}' names no loaded family (loaded: {sorted(plugins.families())})")
        kernels = list(provider.kernels)
        namespace = provider.op_namespace
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
    record = Family.from_record({
        "family": name, "version": version, "manifest_path": "<registered from Python>", "library_path": "",
        "loaded": True, "error": "", "fingerprint": "python", "python": True,
        "manifest": {"schema": 1, "family": name, "version": version, "library": "", "models": entries,
                     "seams": seam_specs},
        "kernels": kernels, "detect": detect, "op_namespace": namespace,
    }, seams=parsed)
    plugins.REGISTRY.add_python_family(record)
    return record


def unregister_family(name: str) -> None:
    """Removes a family registered from Python (models already installed keep their hooks until
    ``uninstall``)."""
    if name not in plugins.REGISTRY.python_families:
        raise KeyError(f"unregister_family: no family '{name}' registered from Python")
    plugins.REGISTRY.remove_python_family(name)
