"""The generic seam patcher: replaces module-level seam functions of transformers modeling modules
with wrappers that follow the trie, and restores them exactly.

A wrapper with no ``tree_*`` kwargs (and no plan in context) calls the original unchanged, so
outputs are bit-identical. With a tree it hands the call to the driver adapter the family manifest
names. Each modeling module has one owner (``owners``); models of one architecture share its
wrappers, and the latest policy and backends of the owner apply.

Seams that get no kwargs (LFM2's short conv) read the plan from a context set by the manifest's
``plan_carriers`` classes (the decoder layer, whose forward receives the kwargs, also under
gradient-checkpoint replay). The context is a ContextVar set and reset in try/finally, so it is
exact under nesting, re-entry, exceptions and threads. A carrier that is a model head over a base
model that drops the kwargs (``Mamba2ForCausalLM``) also hands its ``tree_*`` kwargs to the base
model for the duration of its forward, so the layers get them (and checkpoint replays keep them).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from . import driver
from ._plan import TreePlan, tree_plan
from .policy import Policy

_context_plan: contextvars.ContextVar[TreePlan | None] = contextvars.ContextVar("tree_recurrence_plan", default=None)

WRAPPER_MARK = "__tree_recurrence_seam__"


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


@dataclass
class ModuleOwner:
    """What this package changed in one modeling module, and for whom."""

    module: Any
    family: str
    policy: Policy
    backend: str = "auto"
    originals: dict[str, Any] = field(default_factory=dict)  # seam name -> the very object replaced
    carriers: dict[type, Callable] = field(default_factory=dict)  # class -> its original forward
    models: set[int] = field(default_factory=set)  # id() of installed models using it


owners: dict[str, ModuleOwner] = {}


def _make_seam_wrapper(owner: ModuleOwner, seam: str, spec: dict, original: Callable) -> Callable:
    adapter = driver.ADAPTERS[spec["adapter"]]

    def seam_wrapper(*args, **kwargs):
        plan = tree_plan(kwargs) or _context_plan.get()
        if plan is None:
            return original(*args, **kwargs)
        kernel = original
        if owner.backend == "reference":  # this package's references in place of the bound library
            from .reference import reference_seam

            kernel = reference_seam(seam, original) or original
        call = driver.SeamCall.bind(owner.family, seam, spec, kernel, plan, args, kwargs)
        return adapter(call, owner.backend, owner.policy)

    functools.update_wrapper(seam_wrapper, original, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    setattr(seam_wrapper, WRAPPER_MARK, (owner.family, seam))
    seam_wrapper.__tree_recurrence_original__ = original
    return seam_wrapper


def _hand_tree_kwargs_to_base_model(carrier: Any, kwargs: dict):
    """For a carrier that wraps a base model (a ``PreTrainedModel`` head such as
    ``Mamba2ForCausalLM``, whose forward calls its backbone without ``**kwargs``): makes every call
    of the base model during this forward receive the carrier's ``tree_*`` kwargs (those it was not
    given itself). A plan context alone would not do there: gradient checkpointing replays the
    layers in backward, outside the context, and the layers only keep the kwargs they received.
    Returns the hook handle to remove, or None."""
    import torch

    base = getattr(carrier, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is carrier:
        return None
    tree = {k: v for k, v in kwargs.items() if k.startswith("tree_")}

    def add_tree_kwargs(module, args, base_kwargs):
        return args, {**tree, **base_kwargs}

    return base.register_forward_pre_hook(add_tree_kwargs, with_kwargs=True)


def _make_carrier_forward(original_forward: Callable) -> Callable:
    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        plan = tree_plan(kwargs)
        if plan is None:
            return original_forward(self, *args, **kwargs)
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
    return forward


def patch_module(module: Any, family: str, seams: dict[str, dict], carrier_classes: list[type], policy: Policy,
                 backend: str) -> ModuleOwner:
    """Installs the family's wrappers into ``module`` (idempotent; updates policy and backend)."""
    name = module.__name__
    owner = owners.get(name)
    if owner is not None:
        if owner.family != family:
            raise ValueError(f"{name} is already patched by family '{owner.family}', not '{family}'")
        owner.policy, owner.backend = policy, backend
        return owner
    owner = ModuleOwner(module=module, family=family, policy=policy, backend=backend)
    for seam, spec in seams.items():
        if not hasattr(module, seam):
            continue
        if spec["adapter"] not in driver.ADAPTERS:
            raise ValueError(f"family '{family}': seam '{seam}' uses adapter '{spec['adapter']}', "
                             f"which this version does not have (known: {sorted(driver.ADAPTERS)})")
        original = getattr(module, seam)
        owner.originals[seam] = original
        setattr(module, seam, _make_seam_wrapper(owner, seam, spec, original))
    for cls in carrier_classes:
        owner.carriers[cls] = cls.__dict__["forward"]
        cls.forward = _make_carrier_forward(cls.__dict__["forward"])
    owners[name] = owner
    return owner


def unpatch_module(name: str) -> None:
    """Restores every attribute of the module to the very object it was."""
    owner = owners.pop(name)
    for seam, original in owner.originals.items():
        setattr(owner.module, seam, original)
    for cls, forward in owner.carriers.items():
        cls.forward = forward
