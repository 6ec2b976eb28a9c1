"""Backends: what serves a family's seam calls (``install(model, backends={family: name})``).

``BACKENDS``: name -> availability check (``check(family) -> None`` or why not): ``"auto"`` (the
policy chooses native / fork / rescan), ``"native"`` (the family's own tree kernels only), ``"kernel"``
(fork / rescan over whatever transformers bound), ``"stand_ins"`` (fork / rescan over the families'
library stand-ins, bound as libraries; ``RENAMED``: ``"reference"`` is its deprecated name), and
those integrations register (``register_backend``: ``integrations.trl`` adds ``"trl"``, a hand-off
backend: the family's modeling modules go to TRL's own tree kernel). A backend whose check says no
is refused with its reason, or replaced by its fallback.

Re-routing an installed model (``route``, ``conflict``): installing it again with a hand-off backend
releases this package's hooks on a modeling module only it uses and hands the module over
(``hand_off`` records every attribute the library changed there); installing it again with one of
this package's backends takes such a module back (``take_back`` restores those attributes and removes
the module from the library's patched set), and so does uninstalling the last model that used it. A
module another installed model still uses is refused (``conflict`` names that model); one the library
patched on its own, not through install, stays the library's."""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from . import seams
from ._engine import ENGINE

# Backend name -> availability check: check(family) is None when the backend can serve the family,
# else the reason it cannot. register_backend() adds one (integrations register theirs on import:
# tree_recurrence.integrations.trl adds "trl").
BACKENDS: dict[str, Callable[[str], str | None]] = ENGINE.backends
BACKENDS.update({
    "auto": lambda family: None,
    "native": lambda family: None,  # checked per call: the family's native ops for the tensors' device
    "kernel": lambda family: None,
    # fork / rescan over the families' library stand-ins (library APIs: varlen, per-sequence states),
    # wrapped as transformers wraps a library; seams without a stand-in use the bound kernel
    "stand_ins": lambda family: None,
})
# Old backend name -> its new name (accepted with a DeprecationWarning for one release).
RENAMED: dict[str, str] = {"reference": "stand_ins"}
# Backends that hand the family's modeling modules to another library (install patches nothing there).
HANDOFF_BACKENDS: set[str] = ENGINE.handoff_backends
# Hand-off backend -> what install calls to give the library the model's modules of a family:
# action(model, family, module names).
HANDOFF_ACTIONS: dict[str, Callable[[Any, str, list[str]], None]] = ENGINE.handoff_actions
# Backend -> the backend used instead (with a warning) when its check says it is unavailable: a script
# written for a newer library keeps running on an older one, on this package's own hooks.
FALLBACKS: dict[str, str] = ENGINE.fallbacks
# Hand-off backend -> owns(module name, family): whether its library patched that module first (looking only
# at libraries already imported), and -> note(module name, family, patched): tell the library that this
# package hooks (or no longer hooks) the module, so it does not wrap it again.
_OWNS: dict[str, Callable[[str, str], bool]] = ENGINE.owns
_NOTES: dict[str, Callable[[str, str, bool], None]] = ENGINE.notes


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


# ------------------------------------------------------------------------------------------------
# modules handed to a library by install, and taken back
# ------------------------------------------------------------------------------------------------

_ABSENT = object()


@dataclass(eq=False)
class HandOff:
    """A modeling module install handed to a hand-off backend's library: what the library changed
    there (target, attribute, the object before or ``_ABSENT``, the object it put), and for which
    installed models (held weakly)."""

    backend: str
    family: str
    changes: list[tuple[Any, str, Any, Any]] = field(default_factory=list)
    models: dict[int, weakref.ref] = field(default_factory=dict)


handoffs: dict[str, HandOff] = ENGINE.handoffs  # module name -> its hand-off (guarded by seams.lock)


def _snapshot(module_name: str) -> dict:
    """(target, attribute) -> object, for the module and every class it defines: what a library's
    patcher may replace."""
    module = sys.modules.get(module_name)
    if module is None:
        return {}
    found = {(module, key): value for key, value in vars(module).items() if key != "__warningregistry__"}
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module_name:
            found.update({(value, key): item for key, item in vars(value).items()})
    return found


def _changes(before: dict, after: dict) -> list[tuple[Any, str, Any, Any]]:
    return [(target, key, before.get((target, key), _ABSENT), after.get((target, key), _ABSENT))
            for target, key in {**before, **after}
            if before.get((target, key), _ABSENT) is not after.get((target, key), _ABSENT)]


def _restore(changes: list[tuple[Any, str, Any, Any]]) -> None:
    """Puts back every changed attribute that still holds what the library put there."""
    for target, key, before, after in reversed(changes):
        if vars(target).get(key, _ABSENT) is not after:
            continue  # changed again since: that change stays
        if before is _ABSENT:
            delattr(target, key)
        else:
            setattr(target, key, before)


def _others(models: dict[int, weakref.ref], model: Any) -> list[str]:
    return [type(m).__name__ for key, ref in models.items() if key != id(model) and (m := ref()) is not None]


def conflict(module_name: str, family: str, requested: str | None, model: Any) -> str | None:
    """Why ``model`` cannot be (re-)installed with backend ``requested`` for ``module_name``, or None: the
    module must change hands (between this package's hooks and a hand-off library) while another
    installed model still uses it, or what the library put there was replaced since."""
    owner, handed = seams.owners.get(module_name), handoffs.get(module_name)
    if requested in HANDOFF_BACKENDS and owner is not None and _others(owner.models, model):
        return (f"backends: {module_name} is already hooked by tree_recurrence (family '{owner.family}', backend "
                f"'{owner.backend}') for another installed model ({', '.join(_others(owner.models, model))}); "
                f"uninstall that model before handing the module to backend '{requested}'")
    if handed is None or requested is None or requested == handed.backend:
        return None
    if _others(handed.models, model):
        return (f"backends: {module_name} is handed to backend '{handed.backend}' for another installed model "
                f"({', '.join(_others(handed.models, model))}); uninstall that model before installing with backend "
                f"'{requested}'")
    replaced = [key for target, key, _, after in handed.changes if vars(target).get(key, _ABSENT) is not after]
    if replaced:
        return (f"backends: {module_name} was handed to backend '{handed.backend}', and what it put there "
                f"({replaced}) was replaced since by something else, so it cannot be taken back for backend "
                f"'{requested}'; keep backend '{handed.backend}'")
    return None


def route(module_name: str, family: str, requested: str | None, model: Any) -> str:
    """The backend that serves ``model``'s layers in ``module_name`` (``requested``, else the module's
    current one), after moving the module to it: this package's hooks released before a hand-off, a
    module handed off taken back for one of this package's backends (``conflict`` said yes)."""
    if requested in HANDOFF_BACKENDS and module_name in seams.owners:
        seams.release_model(module_name, id(model))  # only this model used it: the module is restored
    owner, handed = seams.owners.get(module_name), handoffs.get(module_name)
    if owner is not None:
        return requested or owner.backend
    if handed is not None:
        if requested is None or requested == handed.backend:
            return handed.backend
        take_back(module_name)
    if requested in HANDOFF_BACKENDS:
        return requested
    return owned_elsewhere(module_name, family) or requested or "auto"  # a library patched it first: it stays its


def hand_off(backend: str, model: Any, family: str, module_names: list[str]) -> None:
    """Gives the library of hand-off ``backend`` the model's modules of ``family`` (its action), recording
    what it changed in each; what it changed is undone if it raises."""
    before = {name: _snapshot(name) for name in module_names}
    try:
        if backend in HANDOFF_ACTIONS:
            HANDOFF_ACTIONS[backend](model, family, module_names)
    except BaseException:
        for name in module_names:
            _restore(_changes(before[name], _snapshot(name)))
        raise
    for name in module_names:
        changes = _changes(before[name], _snapshot(name))
        record = handoffs.get(name)
        if record is None and changes:
            record = handoffs[name] = HandOff(backend, family)
        if record is not None:
            record.changes += changes
            record.models[id(model)] = weakref.ref(model)


def take_back(module_name: str) -> None:
    """Undoes a hand-off: every attribute the library changed that still holds its object gets the one it
    replaced, and the library forgets the module (its patched set)."""
    record = handoffs.pop(module_name, None)
    if record is None:
        return
    _restore(record.changes)
    note = _NOTES.get(record.backend)
    if note is not None:
        note(module_name, record.family, False)


def release_handoffs(model_id: int) -> None:
    """Removes a model's claim on the modules handed off for it; a module no installed model uses any
    more is taken back."""
    for name, record in list(handoffs.items()):
        record.models.pop(model_id, None)
        if not any(ref() is not None for ref in record.models.values()):
            take_back(name)
