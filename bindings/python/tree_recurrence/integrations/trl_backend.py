"""Backend ``"trl"``: TRL's own tree kernels (huggingface/trl#7686), registered by ``integrations.trl``.

A family names TRL's own tree kernel for it in its manifest (``integrations: {trl: {kernel: <patch
function>, modules: [where a TRL release may define it, searched in order]}}``; huggingface/trl#7686
adds one; trl 1.16 has none). TRL keeps the modeling modules it patched in a module-level set (any set
whose name says "patched"): a module in it is TRL's, and one this package patches is recorded there so
TRL does not wrap it again. Nothing here imports TRL unless asked to load its kernel."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable

import torch

from .. import plugins


def _trl_entry(family: str) -> dict | None:
    record = plugins.families().get(family)
    entry = ((record.manifest.get("integrations") or {}) if record is not None else {}).get("trl")
    return entry if isinstance(entry, dict) and entry.get("kernel") else None


def _trl_families() -> list[str]:
    return sorted(name for name in plugins.families() if _trl_entry(name) is not None)


def _trl_version() -> str:
    trl = sys.modules.get("trl")
    return getattr(trl, "__version__", "?") if trl is not None else "?"


def _trl_kernel(family: str, load: bool = True) -> tuple[Any, Callable, set | None] | str:
    """(module, patch function, patched set) of TRL's tree kernel for ``family``, or why there is none.
    ``load=False`` looks only at modules already imported (never imports TRL)."""
    entry = _trl_entry(family)
    if entry is None:
        return f"TRL has no tree kernel for family '{family}' (families whose manifest names one: {_trl_families()})"
    name, modules = entry["kernel"], tuple(entry.get("modules") or ())
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None and load:
            try:
                found = importlib.util.find_spec(module_name) is not None
            except (ImportError, ValueError):
                found = False
            module = importlib.import_module(module_name) if found else None
        function = getattr(module, name, None) if module is not None else None
        if callable(function):
            patched = next((value for key, value in vars(module).items()
                            if isinstance(value, set) and "patched" in key.lower()), None)
            return module, function, patched
    return (f"trl {_trl_version()} has no {name} (TRL's own tree kernel, huggingface/trl#7686; looked in "
            f"{', '.join(modules)})")


def trl_backend_unavailable(family: str) -> str | None:
    """Why backend ``"trl"`` cannot serve ``family`` (None when it can): the installed TRL must have
    its own tree kernel for it (the one the family's manifest names, huggingface/trl#7686)."""
    found = _trl_kernel(family)
    return found if isinstance(found, str) else None


def _in_patched_set(patched: set, module_name: str) -> bool:
    module = sys.modules.get(module_name)
    return module_name in patched or (module is not None and module in patched)


def trl_owns(module_name: str, family: str) -> bool:
    """Whether TRL patched ``module_name`` with its own tree kernel (without importing TRL)."""
    found = _trl_kernel(family, load=False)
    return not isinstance(found, str) and found[2] is not None and _in_patched_set(found[2], module_name)


def note_patched_here(module_name: str, family: str, patched: bool) -> None:
    """Records (``patched``) or forgets a module this package hooks in TRL's patched set, so that TRL's
    patcher leaves it alone (without importing TRL: a TRL imported later cannot know)."""
    found = _trl_kernel(family, load=False)
    if isinstance(found, str) or found[2] is None:
        return
    entries = found[2]
    module = sys.modules.get(module_name)
    # TRL's set holds module names or module objects: record ours the same way
    key = module if module is not None and any(not isinstance(e, str) for e in entries) else module_name
    if patched:
        entries.add(key)
    else:
        entries.discard(key)


def hand_off(model: torch.nn.Module, family: str, module_names: list[str]) -> None:
    """Backend ``"trl"``: TRL's patcher takes the model's modeling modules of ``family`` (those it has not
    patched already)."""
    found = _trl_kernel(family)
    if isinstance(found, str):
        raise ValueError(f"backends: backend 'trl' cannot take family '{family}': {found}")
    _, patch, patched = found
    if patched is not None and module_names and all(_in_patched_set(patched, name) for name in module_names):
        return
    patch(model)


# install.register_backend's owns / note_patched for "trl": only a TRL already imported can have patched a
# module (or need telling); these never import it.
def owns_if_imported(module_name: str, family: str) -> bool:
    return "trl" in sys.modules and trl_owns(module_name, family)


def note_if_imported(module_name: str, family: str, patched: bool) -> None:
    if "trl" in sys.modules:
        note_patched_here(module_name, family, patched)
