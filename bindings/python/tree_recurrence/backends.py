"""Backends: what serves a family's seam calls (``install(model, backends={family: name})``).

``BACKENDS``: name -> availability check (``check(family) -> None`` or why not): ``"auto"`` (the
policy chooses native / fork / rescan), ``"native"`` (the family's own tree kernels only), ``"kernel"``
(fork / rescan over whatever transformers bound), ``"stand_ins"`` (fork / rescan over the families'
library stand-ins, bound as libraries; ``RENAMED``: ``"reference"`` is its deprecated name), and
those integrations register (``register_backend``: ``integrations.trl`` adds ``"trl"``, a hand-off
backend: the family's modeling modules go to TRL's own tree kernel). A backend whose check says no
is refused with its reason, or replaced by its fallback."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from . import seams

# Backend name -> availability check: check(family) is None when the backend can serve the family,
# else the reason it cannot. register_backend() adds one (integrations register theirs on import:
# tree_recurrence.integrations.trl adds "trl").
BACKENDS: dict[str, Callable[[str], str | None]] = {
    "auto": lambda family: None,
    "native": lambda family: None,  # checked per call: the family's native ops for the tensors' device
    "kernel": lambda family: None,
    # fork / rescan over the families' library stand-ins (library APIs: varlen, per-sequence states),
    # wrapped as transformers wraps a library; seams without a stand-in use the bound kernel
    "stand_ins": lambda family: None,
}
# Old backend name -> its new name (accepted with a DeprecationWarning for one release).
RENAMED: dict[str, str] = {"reference": "stand_ins"}
# Backends that hand the family's modeling modules to another library (install patches nothing there).
HANDOFF_BACKENDS: set[str] = set()
# Hand-off backend -> what install calls to give the library the model's modules of a family:
# action(model, family, module names).
HANDOFF_ACTIONS: dict[str, Callable[[Any, str, list[str]], None]] = {}
# Backend -> the backend used instead (with a warning) when its check says it is unavailable: a script
# written for a newer library keeps running on an older one, on this package's own hooks.
FALLBACKS: dict[str, str] = {}
# Hand-off backend -> owns(module name, family): whether its library patched that module first (looking only
# at libraries already imported), and -> note(module name, family, patched): tell the library that this
# package hooks (or no longer hooks) the module, so it does not wrap it again.
_OWNS: dict[str, Callable[[str, str], bool]] = {}
_NOTES: dict[str, Callable[[str, str, bool], None]] = {}


def owned_elsewhere(module_name: str, family: str) -> str | None:
    """The hand-off backend whose library patched ``module_name`` first, or None."""
    return next((name for name, owns in _OWNS.items() if owns(module_name, family)), None)


def tell_libraries(module_name: str, family: str, patched: bool) -> None:
    """Records in every hand-off library that this package hooks (or no longer hooks) ``module_name``."""
    for note in _NOTES.values():
        note(module_name, family, patched)


seams.on_unpatch.append(lambda name, family: tell_libraries(name, family, False))


def register_backend(name: str, check: Callable[[str], str | None], handoff: bool = False, *,
                     action: Callable[[Any, str, list[str]], None] | None = None, fallback: str | None = None,
                     owns: Callable[[str, str], bool] | None = None,
                     note_patched: Callable[[str, str, bool], None] | None = None) -> None:
    """Adds a backend name with its availability check (``check(family) -> None`` or why not).
    ``handoff``: install leaves the family's modules to another library, calling ``action(model, family,
    module names)``; ``fallback``: the backend used (with a warning) when the check says no; ``owns`` /
    ``note_patched``: how that library tells that it patched a module first / is told that this package did."""
    BACKENDS[name] = check
    if handoff:
        HANDOFF_BACKENDS.add(name)
    if action is not None:
        HANDOFF_ACTIONS[name] = action
    if fallback is not None:
        FALLBACKS[name] = fallback
    if owns is not None:
        _OWNS[name] = owns
    if note_patched is not None:
        _NOTES[name] = note_patched


def check_backends(backends: dict[str, str] | None, families: dict) -> dict[str, str]:
    backends = dict(backends or {})
    for family, backend in backends.items():
        if backend in RENAMED:
            warnings.warn(f"backends: backend '{backend}' is deprecated, use '{RENAMED[backend]}'", DeprecationWarning,
                          stacklevel=3)
            backend = backends[family] = RENAMED[backend]
        if family not in families:
            raise ValueError(f"backends: unknown family '{family}', loaded families: {sorted(families)}")
        if backend not in BACKENDS:
            raise ValueError(f"backends: unknown backend '{backend}' for family '{family}', choose one of {list(BACKENDS)}")
        why = BACKENDS[backend](family)
        if why and backend in FALLBACKS:
            warnings.warn(f"backends: backend '{backend}' is not available for family '{family}': {why}; using "
                          f"'{FALLBACKS[backend]}' (tree_recurrence's own hooks) instead", UserWarning, stacklevel=3)
            backends[family] = FALLBACKS[backend]
        elif why:
            usable = [name for name, check in BACKENDS.items() if name == "auto" or not check(family)]
            raise ValueError(f"backends: backend '{backend}' is not available for family '{family}': {why}. "
                             f"Available backends: {usable}")
    return backends
