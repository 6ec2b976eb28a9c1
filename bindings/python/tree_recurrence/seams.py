"""The generic seam patcher: replaces module-level seam functions of transformers modeling modules
with wrappers that follow the trie, and restores them exactly.

A wrapper with no ``tree_*`` kwargs (and no plan in context) calls the original unchanged, so
outputs are bit-identical. With a tree it hands the call to the driver adapter the family manifest
names. Models of one architecture share its wrappers, and the latest policy and backends of the
owner apply.

Ownership (docs/architecture.md, "Who owns a seam"):

* Each modeling module has one owner (``owners``, guarded by ``lock`` with the installed models):
  the record of what this package changed there (seam -> the very object replaced; carrier class
  -> its own forward) and for which installed models (held weakly).
* **Restore only what is still ours.** On uninstall an attribute that still holds our wrapper gets
  the very object it replaced; one that something else wrapped since (a profiler, a test spy,
  ``kernels``' kernelize, another library) keeps that foreign wrapper, and our wrapper underneath
  *steps aside*: it calls what it replaced, unchanged. A later install finds that stepped-aside
  wrapper inside the foreign one (``__wrapped__`` / closures) and takes it back into service
  instead of wrapping the foreign wrapper.
* **Never wrap our own wrapper.** A module that still holds a wrapper of ours no owner knows (a
  reloaded ``tree_recurrence``, a copy of the module, a state left by an interrupted process) is
  unwrapped to the real original first.
* **Models that die without uninstall** release their claim when garbage-collected; the module is
  restored when the last one is gone.

Seams that get no kwargs (a short conv called by a mixer that drops them) read the plan from a context set by the manifest's
``plan_carriers`` classes (the decoder layer, whose forward receives the kwargs, also under
gradient-checkpoint replay). The context is a ContextVar set and reset in try/finally, so it is
exact under nesting, re-entry, exceptions and threads. A carrier that is a model head over a base
model that drops the kwargs (a ``...ForCausalLM`` calling its backbone without them) also hands its ``tree_*`` kwargs to the base
model for the duration of its forward, so the layers get them (and checkpoint replays keep them).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import driver
from ._engine import ENGINE
from ._plan import TreePlan
from ._tree_kwargs import row_length, tree_plan
from ._tree_kwargs import is_meta_tree
from ._specs import SeamSpec, parse_seam
from .policy import Policy

_context_plan: contextvars.ContextVar[TreePlan | None] = contextvars.ContextVar("tree_recurrence_plan", default=None)

WRAPPER_MARK = "__tree_recurrence_seam__"
ORIGINAL_ATTR = "__tree_recurrence_original__"

# Guards ``owners``, every owner's ``models`` and install.py's installed-model tables: hold it with
# ``locked()``. Reentrant (install nests patch_module); a garbage-collection callback that fires while
# it is held (by this thread or another) leaves its work to the holder, who sweeps on leaving.
lock = threading.RLock()  # ENGINE.lock_depth: how deep its holder is in locked() blocks


@contextlib.contextmanager
def locked():
    with lock:
        ENGINE.lock_depth += 1
        try:
            yield
        finally:
            ENGINE.lock_depth -= 1
            if ENGINE.lock_depth == 0:
                _sweep()


@contextlib.contextmanager
def plan_context(plan: TreePlan | None):
    """Makes ``plan`` the plan of seams that get no kwargs, for the duration of the block."""
    token = _context_plan.set(plan)
    try:
        yield plan
    finally:
        _context_plan.reset(token)


def current_plan() -> TreePlan | None:
    return _context_plan.get()


@dataclass(eq=False)
class _Slot:
    """One attribute this package replaced: a module's seam or a carrier class's ``forward``.
    ``owner`` is None once the wrapper has stepped aside (it then calls ``original`` unchanged)."""

    target: Any  # the module or the class
    name: str
    original: Any
    owner: "ModuleOwner | None" = None
    wrapper: Any = None


@dataclass(eq=False)
class ModuleOwner:
    """What this package changed in one modeling module, and for whom."""

    module: Any
    family: str
    policy: Policy
    backend: str = "auto"
    originals: dict[str, Any] = field(default_factory=dict)  # seam name -> the very object replaced
    carriers: dict[type, Callable] = field(default_factory=dict)  # class -> its original forward
    models: dict[int, weakref.ref] = field(default_factory=dict)  # id() -> weak ref of installed models using it
    slots: list[_Slot] = field(default_factory=list)


owners: dict[str, ModuleOwner] = ENGINE.owners
# Wrappers of ours that stepped aside under a foreign wrapper, by (module or class name, attribute):
# a later install takes them back into service.
_stepped_aside: dict[tuple[str, str], _Slot] = ENGINE.stepped_aside


def _target_name(target: Any) -> str:
    return getattr(target, "__module__", "") + ":" + getattr(target, "__qualname__", "") if isinstance(target, type) \
        else target.__name__


def is_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper made here (also by an earlier import of this module). The mark
    alone does not tell: ``functools.wraps`` copies it onto whatever wraps our wrapper."""
    code = getattr(obj, "__code__", None)
    return (getattr(obj, WRAPPER_MARK, None) is not None and code is not None and code.co_filename == __file__
            and code.co_name in ("seam_wrapper", "forward"))


def unwrap_ours(obj: Any) -> Any:
    """The object under our wrappers (however many are stacked), or ``obj`` if it is not ours."""
    for _ in range(64):
        if not is_wrapper(obj) or not hasattr(obj, ORIGINAL_ATTR):
            return obj
        obj = getattr(obj, ORIGINAL_ATTR)
    return obj


def _reaches(obj: Any, wanted: Any, depth: int = 6) -> bool:
    """Whether ``wanted`` is ``obj`` or lies inside it: ``__wrapped__`` chains, bound methods,
    ``functools.partial`` and closure cells (how wrappers hold what they wrap)."""
    seen: set[int] = set()
    frontier = [obj]
    for _ in range(depth):
        following = []
        for item in frontier:
            if item is wanted:
                return True
            if id(item) in seen or item is None:
                continue
            seen.add(id(item))
            for attr in ("__wrapped__", "__func__", "func", "_old_forward"):
                inner = getattr(item, attr, None) if not isinstance(item, type) else None
                if inner is not None:
                    following.append(inner)
            for cell in getattr(item, "__closure__", None) or ():
                try:
                    following.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        frontier = following
    return False


def _make_seam_wrapper(slot: _Slot, seam: str, spec: SeamSpec, original: Callable) -> Callable:
    run = driver.run

    def seam_wrapper(*args, **kwargs):
        owner = slot.owner
        if owner is None or owners.get(owner.module.__name__) is not owner:
            # stepped aside (a foreign wrapper over this one outlived our hooks), or stale
            return original(*args, **kwargs)
        if is_meta_tree(kwargs):  # traced on the meta device: no plan exists; shapes are all it computes
            return original(*args, **{k: v for k, v in kwargs.items() if not k.startswith("tree_")})
        plan = tree_plan(kwargs) or _context_plan.get()
        if plan is None:
            return original(*args, **kwargs)
        return run(owner.family, seam, spec, original, plan, args, kwargs, owner.backend, owner.policy)

    functools.update_wrapper(seam_wrapper, original, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    setattr(seam_wrapper, WRAPPER_MARK, (slot.owner.family, seam))
    setattr(seam_wrapper, ORIGINAL_ATTR, original)
    return seam_wrapper


def _hand_tree_kwargs_to_base_model(carrier: Any, kwargs: dict):
    """For a carrier that wraps a base model (a ``PreTrainedModel`` head such as
    a ``...ForCausalLM`` whose forward calls its backbone without ``**kwargs``): makes every call
    of the base model during this forward receive the carrier's ``tree_*`` kwargs (those it was not
    given itself). A plan context alone would not do there: gradient checkpointing replays the
    layers in backward, outside the context, and the layers only keep the kwargs they received.
    Returns the hook handle to remove, or None."""
    base = getattr(carrier, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is carrier:
        return None
    tree = {k: v for k, v in kwargs.items() if k.startswith("tree_")}

    def add_tree_kwargs(module, args, base_kwargs):
        return args, {**tree, **base_kwargs}

    return base.register_forward_pre_hook(add_tree_kwargs, with_kwargs=True)


def _make_carrier_forward(slot: _Slot, original_forward: Callable) -> Callable:
    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        owner = slot.owner
        active = owner is not None and owners.get(owner.module.__name__) is owner and not is_meta_tree(kwargs)
        plan = tree_plan(kwargs) if active else None
        if plan is None:
            return original_forward(self, *args, **kwargs)
        row = row_length(kwargs)
        if row is not None and plan.num_tokens > row:  # longer rows are fine: padding after the tree's tokens
            raise ValueError(f"tree_cu_seqlens_q: ends at {plan.num_tokens} but the row ({type(self).__name__}'s "
                             f"input_ids / inputs_embeds) has only {row} tokens: the tree kwargs belong to another row")
        for key in ("past_key_values", "cache_params"):
            # Seams without kwargs cannot see a cache: refuse here what a scan seam refuses itself.
            if kwargs.get(key) is not None:
                raise ValueError(f"{type(self).__name__}: got a tree-packed row and a cache ({key}); a tree-packed "
                                 "row has one recurrent state per sample, not one per row: call the model with "
                                 "use_cache=False")
        handle = _hand_tree_kwargs_to_base_model(self, kwargs)
        try:
            with plan_context(plan):
                return original_forward(self, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()

    setattr(forward, WRAPPER_MARK, "carrier")
    setattr(forward, ORIGINAL_ATTR, original_forward)
    return forward


def _take(owner: ModuleOwner, target: Any, name: str, current: Any, make: Callable[[_Slot, Any], Any]) -> _Slot:
    """Puts ``owner``'s wrapper on ``target.name``: takes a stepped-aside wrapper of ours back into
    service when the current (foreign) object still calls it; otherwise wraps the real original
    (our own stale wrappers unwrapped, never wrapped again)."""
    key = (_target_name(target), name)
    aside = _stepped_aside.get(key)
    if aside is not None and not is_wrapper(current) and _reaches(current, aside.wrapper):
        del _stepped_aside[key]
        aside.owner = owner
        return aside
    original = unwrap_ours(current)
    slot = _Slot(target, name, original, owner)
    slot.wrapper = make(slot, original)
    setattr(target, name, slot.wrapper)
    return slot


def patch_module(module: Any, family: str, seams: Mapping[str, SeamSpec | Mapping], carrier_classes: list[type],
                 policy: Policy, backend: str) -> ModuleOwner:
    """Installs the family's wrappers into ``module`` (idempotent; updates policy and backend). ``seams``:
    the family's ``SeamSpec`` s (``plugins.seam_specs``); a manifest-style mapping is parsed here."""
    with locked():
        name = module.__name__
        owner = owners.get(name)
        if owner is not None:
            if owner.family != family:
                raise ValueError(f"{name} is already patched by family '{owner.family}', not '{family}'")
            owner.policy, owner.backend = policy, backend
            return owner
        seams = {seam: spec if isinstance(spec, SeamSpec) else parse_seam(f"family '{family}'", seam, spec)
                 for seam, spec in seams.items()}
        for seam, spec in seams.items():
            if hasattr(module, seam) and spec.adapter not in driver.ADAPTERS:
                raise ValueError(f"family '{family}': seam '{seam}' uses adapter '{spec.adapter}', "
                                 f"which this version does not have (known: {sorted(driver.ADAPTERS)})")
        owner = ModuleOwner(module=module, family=family, policy=policy, backend=backend)
        for seam, spec in seams.items():
            if not hasattr(module, seam):
                continue
            slot = _take(owner, module, seam, getattr(module, seam),
                         lambda s, original, seam=seam, spec=spec: _make_seam_wrapper(s, seam, spec, original))
            owner.slots.append(slot)
            owner.originals[seam] = slot.original
        for cls in carrier_classes:
            slot = _take(owner, cls, "forward", cls.__dict__["forward"], _make_carrier_forward)
            owner.slots.append(slot)
            owner.carriers[cls] = slot.original
        owners[name] = owner
        return owner


def unpatch_module(name: str) -> None:
    """Takes this package's hooks out of a module: every attribute that still holds our wrapper gets
    the very object it replaced; a wrapper something else wrapped since steps aside (passes calls
    through) under that foreign wrapper, which stays."""
    with locked():
        _unpatch(name)


# Called as hook(module name, family) after a module's hooks are taken out (install.py tells TRL).
on_unpatch: list[Callable[[str, str], None]] = ENGINE.on_unpatch


def _unpatch(name: str) -> None:
    owner = owners.pop(name, None)
    if owner is None:
        return
    for hook in on_unpatch:
        hook(name, owner.family)
    for slot in owner.slots:
        slot.owner = None
        if slot.target.__dict__.get(slot.name) is slot.wrapper:
            setattr(slot.target, slot.name, slot.original)
        else:
            _stepped_aside[(_target_name(slot.target), slot.name)] = slot


# ------------------------------------------------------------------------------------------------
# installed models, held weakly
# ------------------------------------------------------------------------------------------------

_collected: list[int] = ENGINE.collected  # ids of installed models garbage-collected since the last sweep
_release_hooks: list[Callable[[int], None]] = ENGINE.release_hooks  # install.py's: forget a collected model's records


def on_release(hook: Callable[[int], None]) -> None:
    """Calls ``hook(model_id)`` for every installed model garbage-collected without uninstall (under the
    lock, at the sweep), before its module claims are released."""
    _release_hooks.append(hook)


def add_model(owner: ModuleOwner, model: Any) -> None:
    """Records that ``model`` uses ``owner``'s hooks (weakly: a collected model releases its claim)."""
    with locked():
        ref = owner.models.get(id(model))
        if ref is None or ref() is not model:
            owner.models[id(model)] = weakref.ref(model, on_collected(id(model)))


def release_model(name: str, model_id: int) -> None:
    """Removes a model's claim on a module; the module is restored once no model claims it."""
    with locked():
        owner = owners.get(name)
        if owner is None:
            return
        owner.models.pop(model_id, None)
        if not owner.models:
            _unpatch(name)


def on_collected(model_id: int) -> Callable[[Any], None]:
    """The weak-reference callback of an installed model: releases its claims once it is collected.
    At interpreter exit it does nothing: the modules it would reach may already be torn down, and
    the process is ending anyway (a script that never calls uninstall exits without tracebacks)."""

    def callback(_ref, _finalizing=sys.is_finalizing):
        if not _finalizing():
            _on_collected(model_id)

    return callback


def _on_collected(model_id: int) -> None:
    _collected.append(model_id)
    if lock.acquire(blocking=False):
        try:
            if ENGINE.lock_depth == 0:  # else the holder (this thread, mid-install) sweeps when it leaves
                _sweep()
        finally:
            lock.release()


def sweep() -> None:
    """Releases the claims of installed models that were garbage-collected (the collector's callback
    does it when it can; install and uninstall do it too)."""
    with locked():
        pass


def _sweep() -> None:
    while _collected:
        model_id = _collected.pop()
        for hook in _release_hooks:
            hook(model_id)
        for name, owner in list(owners.items()):
            ref = owner.models.get(model_id)
            if ref is not None and ref() is None:
                owner.models.pop(model_id)
                if not owner.models:
                    _unpatch(name)
