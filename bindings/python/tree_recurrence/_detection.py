"""What install reads from a model: its text config and ``layer_types``, the plain module descriptions
the family plugins' detectors (C++, ``sdk/detectors.h``) judge, which mixers they claim and which
recurrent layers no family covers, whether a mixer's instance forward bypasses its seams, and whether
its class forward calls them."""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch

from . import _core, plugins
from ._engine import ENGINE

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "qwen_sparse_attention", "mlp", "moe"}


def text_config(model) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    for attr in ("layer_types", "layers_block_type"):
        try:
            value = getattr(config, attr, None)
        except Exception:  # some configs compute these properties and may fail
            value = None
        if value:
            return list(value)
    return []


def describe(path: str, module: torch.nn.Module, model_type: str) -> dict:
    desc = {
        "path": path,
        "class_name": type(module).__name__,
        "model_type": model_type,
        "params": [(n, list(p.shape)) for n, p in module.named_parameters(recurse=False)],
        "conv": None,
    }
    if isinstance(module, torch.nn.Conv1d):
        padding = module.padding[0] if isinstance(module.padding, tuple) else module.padding
        desc["conv"] = {"in_channels": module.in_channels, "out_channels": module.out_channels, "groups": module.groups,
                        "kernel_size": module.kernel_size[0], "padding": padding if isinstance(padding, int) else -1}
    return desc


def generic_leftover(desc: dict) -> str | None:
    """The fallback for modules no plugin's detector recognises: why an unclaimed module mixes tokens
    like a recurrent layer, or None, from the very detectors the families ship (sdk/detectors.h,
    through the native module). It keeps a model with such a layer from answering "tree" when no
    family is loaded at all."""
    return _core.generic_leftover(desc)


def instance_forward_bypass(mixer: torch.nn.Module) -> str | None:
    """Why ``mixer``'s instance-level ``forward`` (set by kernelize, say) would bypass the modeling
    module's seams, or None (no instance forward, or one that still calls the class's forward or a
    forward marked with mark_tree_forward: accelerate's hooks, profilers)."""
    forward = mixer.__dict__.get("forward")
    if forward is None:
        return None
    class_forward = getattr(type(mixer), "forward", None)
    item = forward
    for _ in range(16):
        func = getattr(item, "__func__", item)
        if func is class_forward or hasattr(func, "__tree_recurrence_forward__"):
            return None
        inner = getattr(item, "__wrapped__", None) or getattr(item, "_old_forward", None) or getattr(item, "func", None)
        if inner is None:
            break
        item = inner
    what = getattr(forward, "__qualname__", None) or getattr(getattr(forward, "__func__", None), "__qualname__", None) \
        or type(forward).__name__
    return f"its forward was replaced on the instance (by {what}), which bypasses the module's seams"


# ------------------------------------------------------------------------------------------------
# whether a mixer's forward calls its modeling module's seams
# ------------------------------------------------------------------------------------------------

# Adapters of the seams that carry a mixer's token mixing (a conv, a scan): its forward must reach every
# one its modeling module defines. A fused seam ("family", "decline") stands beside a split path the
# forward reaches too (a fused conv + scan beside the split conv and scan), so it is not required; a
# family without conv or scan seams needs one of its other seams reached.
MIXING_ADAPTERS = ("conv", "scan")
_MAX_FUNCTIONS = 256  # Python functions followed from one forward
_MODULE_BASES = frozenset(torch.nn.Module.__mro__)  # nn.Module's own methods are never followed
# class -> (modeling module, seams, [(class or module, name, what it resolved to)], names of the module reached)
_reach_cache: "weakref.WeakKeyDictionary[type, tuple]" = ENGINE.reach_cache


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it (closures, comprehensions) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _class_attrs(cls: type, name: str) -> tuple:
    """``name`` on ``cls`` and on each base below nn.Module (``super().name(...)`` reaches those too)."""
    return tuple(k.__dict__[name] for k in cls.__mro__ if k not in _MODULE_BASES and name in k.__dict__)


def _is_python(obj: Any) -> bool:
    """Whether ``obj`` (a forward) leads to Python code: through bound methods, partials, ``__wrapped__``
    and a Python ``__call__``."""
    for _ in range(16):
        if isinstance(obj, types.FunctionType):
            return True
        call = getattr(type(obj), "__call__", None)
        obj = getattr(obj, "__func__", None) or getattr(obj, "func", None) or getattr(obj, "__wrapped__", None) or \
            (call if isinstance(call, types.FunctionType) else None)
        if obj is None:
            return False
    return False


def _lookup(holder: Any, name: str) -> tuple:
    """What ``_reach`` follows for ``name``: the class's attributes of that name (``_class_attrs``), or
    for the modeling module a function of its own (a module-level helper)."""
    if isinstance(holder, type):
        return _class_attrs(holder, name)
    value = vars(holder).get(name)
    return (value,) if isinstance(value, types.FunctionType) and value.__globals__ is vars(holder) else ()


def _reach(cls: type, module: Any, seams: frozenset[str]) -> tuple[list, frozenset[str]]:
    """The names of ``module``'s globals that ``cls.forward`` reaches (with the lookups made): its
    wrappers (``__wrapped__``, closure cells, partials, bound methods), the code nested in each
    function, the class's methods it names (``self.torch_forward(...)``, ``super().forward``) and the
    module's own functions it calls (helpers; not ``seams``, whose bodies the hooks replace). A function
    counts when its globals are the module's (or it names the module): a copy of a seam imported into
    another module is not the seam."""
    namespace, reached, lookups, seen = vars(module), set(), [], set()
    frontier = list(_class_attrs(cls, "forward")[:1])
    lookups.append((cls, "forward", _class_attrs(cls, "forward")))
    while frontier and len(seen) < _MAX_FUNCTIONS:
        item = frontier.pop()
        if item is None or isinstance(item, type) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (staticmethod, classmethod, types.MethodType)):
            frontier.append(item.__func__)
        elif isinstance(item, functools.partial):
            frontier.append(item.func)
        elif isinstance(item, types.FunctionType):
            names = _code_names(item.__code__)
            own = item.__globals__ is namespace
            if own or any(item.__globals__.get(n) is module for n in names):
                reached |= names
            frontier.append(getattr(item, "__wrapped__", None))
            for cell in item.__closure__ or ():
                try:
                    frontier.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            for name in names:
                for holder in (cls, module) if own and name not in seams else (cls,):
                    found = _lookup(holder, name)
                    if found:
                        lookups.append((holder, name, found))
                        frontier.extend(found)
        elif getattr(item, "__wrapped__", None) is not None:
            frontier.append(item.__wrapped__)
    return lookups, frozenset(reached)


def _reached(cls: type, module: Any, seams: frozenset[str]) -> frozenset[str]:
    """``_reach``, cached per class while every attribute it looked up is the same object."""
    cached = _reach_cache.get(cls)
    if cached is not None and cached[0] is module and cached[1] == seams and \
            all(len(now := _lookup(holder, name)) == len(was) and all(a is b for a, b in zip(now, was))
                for holder, name, was in cached[2]):
        return cached[3]
    lookups, reached = _reach(cls, module, seams)
    _reach_cache[cls] = (module, seams, lookups, reached)
    return reached


def forward_seam_gap(mixer: torch.nn.Module, module: Any, family: str, seams: dict) -> str | None:
    """Why ``mixer``'s class ``forward`` would bypass the seams of ``module`` (its modeling module) that
    ``family`` hooks, or None: it must reach every conv / scan seam the module defines (see
    ``MIXING_ADAPTERS``), as Python code this function can read. A forward marked with
    ``mark_tree_forward`` follows trees in its own code and needs no seam."""
    cls = type(mixer)
    forward = getattr(cls, "forward", None)
    if hasattr(forward, "__tree_recurrence_forward__"):
        return None
    present = {seam: spec.adapter for seam, spec in seams.items()
               if hasattr(module, seam) and spec.adapter != "decline"}
    required = [seam for seam, adapter in present.items() if adapter in MIXING_ADAPTERS]
    if not present:
        return None
    what = f"{cls.__name__}.forward"
    if not _is_python(forward):
        return (f"its forward ({what} = {forward!r:.100}) is not Python code, so install cannot tell whether it calls "
                f"the seam(s) {required or sorted(present)} of {module.__name__} that family '{family}' hooks; "
                "it may mix the packed samples")
    reached = _reached(cls, module, frozenset(seams))
    missing = [seam for seam in required if seam not in reached]
    if missing or not reached & set(present):
        qualname = getattr(getattr(forward, "__wrapped__", forward), "__qualname__", what)
        return (f"its forward ({qualname}) does not call the seam(s) {missing or sorted(present)} of {module.__name__} "
                f"that family '{family}' hooks: it would mix the packed samples")
    return None


def claim(model: torch.nn.Module, families: dict, config: Any, model_type: str) -> tuple[dict, list[str]]:
    """Every module of ``model`` described to every family's detector: (claimed mixers, path -> (family,
    mixer); leftovers, why each recurrent layer no family covers, and ``layer_types`` no family's mixers
    found in the model implement). One that covers a module wins over those that only recognise it."""
    claimed: dict[str, tuple[str, torch.nn.Module]] = {}  # path -> (family, mixer)
    leftovers: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in claimed):
            continue  # inside a covered mixer
        desc = describe(path, module, model_type)
        owner, recognised = None, None
        for family in families:  # every family's detector: one that covers it wins over those that recognise it
            covered, role, why = plugins.detect(family, desc)
            if covered and role == "mixer":
                owner = family
                break
            if not covered and role == "recurrent" and recognised is None:
                recognised = why
        if owner:
            claimed[path] = (owner, module)
            continue
        if recognised is None:  # no plugin recognises it: the generic fallback
            recognised = generic_leftover(desc)
        if recognised:
            leftovers.append(f"{path or type(model).__name__} ({type(module).__name__}) {recognised} and no family "
                             "plugin covers it")

    # layer_types this model's recurrent layers may carry: those of the manifest entries for its
    # model type and of the mixers found in it. Pooling every family's values would let another
    # family's "linear_attention" vouch for a model whose own family is missing.
    mixers = {type(m).__name__ for _, m in claimed.values()}
    implemented = {lt for f in families.values() for m in f.models
                   if m["model_type"] == model_type or mixers & set(m["mixers"]) for lt in m["layer_types"]}
    recurrent = {lt for lt in layer_types(config) if lt not in ATTENTION_LAYER_TYPES}
    unknown = sorted(recurrent - implemented)
    if unknown:
        leftovers.insert(0, f"layer_types {unknown} of {model_type or type(model).__name__} are implemented by no family "
                            f"plugin found (found: {sorted(families) or 'none'})")
    for name, record in families.items():
        for entry in record.models:
            if entry["model_type"] == model_type and recurrent & set(entry["layer_types"]) and not mixers & set(entry["mixers"]):
                leftovers.append(f"layer_types {sorted(recurrent & set(entry['layer_types']))} of {model_type} are "
                                 f"family '{name}' mixers {entry['mixers']}, but the model has none of them")
    return claimed, leftovers
