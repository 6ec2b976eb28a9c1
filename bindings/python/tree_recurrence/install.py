"""install / uninstall: decide whether a model can take tree-packed rows, and hook it.

``install(model)`` describes every module of the model to the family plugins' detectors (C++),
patches the modeling modules of the mixers they claim, and returns a :class:`Support`:

* ``mode == "tree"``: every recurrent layer follows the trie;
* ``mode == "chains"``: every recurrent layer follows packed sample boundaries, but some layer's
  family declares ``follows: chains`` (a manifest model entry, or a Python-registered family's
  entry): it cannot start a segment from its parent's final state. Pack one chain per sample
  (``integrations.trl.ChainRow``); a forward whose row branches (plan levels > 1) raises a
  ``ValueError`` naming that layer (``reason`` names them all);
* ``mode == "none"``: some layer would mix packed samples (``reason`` names it); nothing is
  patched for such a model.

Backends per family (``BACKENDS``: name -> availability check): ``"auto"`` (policy chooses
native / fork / rescan), ``"native"`` (the family's own tree kernels only), ``"kernel"`` (fork /
rescan over whatever transformers bound: a kernel library or its PyTorch reference),
``"reference"`` (fork / rescan over this package's reference kernels, bound as libraries), ``"trl"``
(hand the family's modeling modules to TRL's own tree kernel, huggingface/trl#7686's
``patch_tree_gdn``; TRL 1.16 has none: then a warning names what is missing and ``"auto"`` serves
the family, ``FALLBACKS``). A backend whose check says it is unusable is refused with the check's
reason (or replaced by its fallback); a hand-off backend (``HANDOFF_BACKENDS``) leaves the modeling
module unpatched for the library that owns it. A module TRL patched first stays TRL's; one hooked
here is recorded in TRL's patched set.

Ownership (docs/architecture.md, "Who owns a seam"): install and uninstall are serialized by
``seams.locked()``; installed models are held weakly (a collected model releases its modules);
uninstall restores only attributes that still hold our wrappers. Also refused (``"none"``): a
modeling module lacking a seam its family needs, a mixer whose instance ``forward`` bypasses the
seams, an unmarked mixer of a Python-registered family without seams, and ``layer_types`` whose
family's mixer classes the model lacks. A tree row that does not say ``use_cache`` runs without one.
"""

from __future__ import annotations

import importlib
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import driver, plugins, seams
from ._plan import is_meta_tree, tree_plan
from .policy import Policy


# Backend name -> availability check: check(family) is None when the backend can serve the family,
# else the reason it cannot. register_backend() adds one (integrations register theirs on import:
# tree_recurrence.integrations.trl adds "trl").
BACKENDS: dict[str, Callable[[str], str | None]] = {
    "auto": lambda family: None,
    "native": lambda family: None,  # checked per call: the family's native ops for the tensors' device
    "kernel": lambda family: None,
    # fork / rescan over the families' reference kernels (library APIs: varlen, per-sequence states),
    # wrapped as transformers wraps a library; seams without a reference use the bound kernel
    "reference": lambda family: None,
}
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


def _owned_elsewhere(module_name: str, family: str) -> str | None:
    """The hand-off backend whose library patched ``module_name`` first, or None."""
    return next((name for name, owns in _OWNS.items() if owns(module_name, family)), None)


def _tell_libraries(module_name: str, family: str, patched: bool) -> None:
    """Records in every hand-off library that this package hooks (or no longer hooks) ``module_name``."""
    for note in _NOTES.values():
        note(module_name, family, patched)


seams.on_unpatch.append(lambda name, family: _tell_libraries(name, family, False))
FOLLOWS = ("tree", "chains")  # what a family's manifest model entry may declare as "follows" (default "tree")


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


ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "qwen_sparse_attention", "mlp", "moe"}

# Installed models by id(), held weakly (guarded by seams.lock): a model collected without uninstall
# releases its hooks (seams.sweep).
_installed: dict[int, "Support"] = {}
_installed_refs: dict[int, weakref.ref] = {}
_guards: dict[int, list] = {}  # id(model) -> forward pre-hook handles of its "chains" layers
_cache_hooks: dict[int, list] = {}  # id(model) -> the pre-hooks turning use_cache off for tree rows
logger = logging.getLogger("tree_recurrence")


@dataclass
class LayerSupport:
    path: str
    class_name: str
    family: str | None
    backend: str | None
    modeling_module: str | None
    follows: str = "tree"  # "tree", or "chains": only rows without branches


@dataclass
class Support:
    mode: str
    reason: str = ""
    layers: list[LayerSupport] = field(default_factory=list)
    families: dict[str, str] = field(default_factory=dict)  # family -> backend
    modules: list[str] = field(default_factory=list)  # modeling modules this model's hooks live in

    def __bool__(self) -> bool:
        return self.mode != "none"


def _text_config(model) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_types(config) -> list[str]:
    for attr in ("layer_types", "layers_block_type"):
        try:
            value = getattr(config, attr, None)
        except Exception:  # some configs compute these properties and may fail
            value = None
        if value:
            return list(value)
    return []


def _describe(path: str, module: torch.nn.Module, model_type: str) -> dict:
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


def _is_recurrent_leftover(desc: dict) -> str | None:
    """The fallback for modules no plugin's detector recognises (families ship the real detectors,
    sdk/detectors.h): why an unclaimed module mixes tokens like a recurrent layer, or None. It keeps a
    model with such a layer from answering "tree" when no family is loaded at all."""
    if any(name == "A_log" for name, _ in desc["params"]):
        return "has a state-space decay (A_log) [generic fallback detector: no loaded family recognises it]"
    conv = desc["conv"]
    if conv and conv["groups"] == conv["in_channels"] == conv["out_channels"] and conv["kernel_size"] > 1 and \
            conv["padding"] == conv["kernel_size"] - 1:
        return (f"is a causal depthwise conv (width {conv['kernel_size']}) [generic fallback detector: no loaded "
                "family recognises it]")
    return None


def _check_backends(backends: dict[str, str] | None, families: dict) -> dict[str, str]:
    backends = dict(backends or {})
    for family, backend in backends.items():
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


def _chains_guard(path: str, family: str) -> Callable:
    """A forward pre-hook refusing rows that branch, for a layer whose family follows chains only."""

    def guard(module, args, kwargs):
        if is_meta_tree(kwargs):
            return None
        plan = tree_plan(kwargs)
        if plan is None:
            plan = seams.current_plan()
        if plan is not None and not plan.is_chains:
            raise ValueError(
                f"{path} ({type(module).__name__}, family '{family}') follows packed samples only as separate chains, "
                f"but this row is a tree ({plan.num_levels} levels, {plan.num_segments} segments, {plan.num_leaves} "
                "samples): pack every sample as its own chain (tree_recurrence.integrations.trl.ChainRow, "
                "ChainTokenBudgetBatcher, ChainFixedCountBatcher)")
        return None

    return guard


def _remove_guards(model_id: int) -> None:
    for handle in _guards.pop(model_id, []) + _cache_hooks.pop(model_id, []):
        handle.remove()


def _forget_collected(model_id: int) -> None:
    """seams' sweep: drops the records of an installed model that was garbage-collected."""
    ref = _installed_refs.get(model_id)
    if ref is not None and ref() is None:
        del _installed_refs[model_id]
        _installed.pop(model_id, None)
        _guards.pop(model_id, None)  # the hooks died with the model's modules
        _cache_hooks.pop(model_id, None)


seams._release_hooks.append(_forget_collected)


def _support_of(model: torch.nn.Module) -> "Support | None":
    ref = _installed_refs.get(id(model))
    return _installed.get(id(model)) if ref is not None and ref() is model else None


_told_use_cache = False


def _no_cache_for_tree_rows(module, args, kwargs):
    """A forward pre-hook of an installed model: a tree-packed row that did not say
    ``use_cache`` runs with ``use_cache=False`` (a row of many samples has no one recurrent state to
    cache); says so once. An explicit ``use_cache=True`` is left to be refused with the reason."""
    global _told_use_cache
    if kwargs.get("use_cache") is not None or kwargs.get("past_key_values") is not None or \
            kwargs.get("cache_params") is not None or is_meta_tree(kwargs) or tree_plan(kwargs) is None:
        return None
    if not _told_use_cache:
        _told_use_cache = True
        logger.info("tree_recurrence: a tree-packed row runs with use_cache=False (it holds many samples, each "
                    "with its own recurrent state); pass use_cache=False to say so")
    return args, {**kwargs, "use_cache": False}


def _instance_forward_bypass(mixer: torch.nn.Module) -> str | None:
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


def install(model: torch.nn.Module, policy: Policy | None = None, backends: dict[str, str] | None = None) -> Support:
    """Hooks ``model``'s recurrent layers so they follow tree-packed rows. See the module doc.
    Thread-safe: installs and uninstalls of models sharing modeling modules are serialized."""
    with seams.locked():
        return _install(model, policy, backends)


def _install(model: torch.nn.Module, policy: Policy | None, backends: dict[str, str] | None) -> Support:
    families = plugins.families()
    backends = _check_backends(backends, families)
    policy = policy or Policy()
    config = _text_config(model)
    model_type = getattr(config, "model_type", "") or ""
    claimed: dict[str, tuple[str, torch.nn.Module]] = {}  # path -> (family, mixer)
    leftovers: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in claimed):
            continue  # inside a covered mixer
        desc = _describe(path, module, model_type)
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
            recognised = _is_recurrent_leftover(desc)
        if recognised:
            leftovers.append(f"{path or type(model).__name__} ({type(module).__name__}) {recognised} and no family "
                             "plugin covers it")

    # layer_types this model's recurrent layers may carry: those of the manifest entries for its
    # model type and of the mixers found in it. Pooling every family's values would let another
    # family's "linear_attention" vouch for a model whose own family is missing.
    mixers = {type(m).__name__ for _, m in claimed.values()}
    implemented = {lt for f in families.values() for m in f["manifest"]["models"]
                   if m["model_type"] == model_type or mixers & set(m["mixers"]) for lt in m["layer_types"]}
    unknown = sorted({lt for lt in _layer_types(config) if lt not in ATTENTION_LAYER_TYPES and lt not in implemented})
    if unknown:
        leftovers.insert(0, f"layer_types {unknown} of {model_type or type(model).__name__} are implemented by no family "
                            f"plugin found (found: {sorted(families) or 'none'})")
    recurrent = {lt for lt in _layer_types(config) if lt not in ATTENTION_LAYER_TYPES}
    for name, record in families.items():
        for entry in record["manifest"]["models"]:
            if entry["model_type"] == model_type and recurrent & set(entry["layer_types"]) and not mixers & set(entry["mixers"]):
                leftovers.append(f"layer_types {sorted(recurrent & set(entry['layer_types']))} of {model_type} are "
                                 f"family '{name}' mixers {entry['mixers']}, but the model has none of them")
    if leftovers:
        return Support(mode="none", reason="; ".join(dict.fromkeys(leftovers)))

    for family in sorted({f for f, _ in claimed.values()}):
        missing = {seam: spec["adapter"] for seam, spec in families[family]["manifest"]["seams"].items()
                   if spec["adapter"] not in driver.ADAPTERS}
        if missing:
            layers = [p for p, (f, _) in claimed.items() if f == family]
            return Support(mode="none", reason=f"family '{family}' covers {layers} but its seams {missing} need adapters "
                                                f"this version lacks (known: {sorted(driver.ADAPTERS)})")

    # Resolve every claimed mixer's manifest entry before patching anything, so a refusal patches nothing.
    entries = {}
    for path, (family, mixer) in claimed.items():
        module_name = type(mixer).__module__
        entry = next((m for m in families[family]["manifest"]["models"] if m["module"] == module_name), None)
        if entry is None:
            return Support(mode="none", reason=f"{path} ({type(mixer).__name__}) lives in {module_name}, which the "
                                                f"'{family}' manifest does not list")
        module = importlib.import_module(module_name)
        needed = [seam for seam, spec in families[family]["manifest"]["seams"].items()
                  if spec["adapter"] != "decline" and not hasattr(module, seam)]
        if needed:
            return Support(mode="none", reason=f"{path} ({type(mixer).__name__}): its modeling module {module_name} "
                                                f"lacks the seam(s) {needed} family '{family}' needs")
        bypass = _instance_forward_bypass(mixer)
        if bypass:
            return Support(mode="none", reason=f"{path} ({type(mixer).__name__}): {bypass}")
        if families[family].get("python") and not families[family]["manifest"]["seams"] and \
                not hasattr(getattr(type(mixer), "forward", None), "__tree_recurrence_forward__"):
            return Support(mode="none", reason=f"{path} ({type(mixer).__name__}): family '{family}' (registered from "
                                                f"Python, no seams) claims mixers whose forward follows trees, but "
                                                f"{type(mixer).__name__}.forward is not marked with mark_tree_forward")
        follows = entry.get("follows", "tree")
        if follows not in FOLLOWS:
            return Support(mode="none", reason=f"{path} ({type(mixer).__name__}): the '{family}' manifest says it follows "
                                                f"{follows!r}, which this version does not know (known: {list(FOLLOWS)})")
        handoff = backends.get(family) in HANDOFF_BACKENDS
        owner = seams.owners.get(module_name)
        if handoff and owner is not None:
            raise ValueError(f"backends: {module_name} is already hooked by tree_recurrence (family '{owner.family}', "
                             f"backend '{owner.backend}') for another model; uninstall that model before handing the "
                             f"module to backend '{backends[family]}'")
        entries[path] = (entry, follows)

    chains = [f"{path} ({type(mixer).__name__}, family '{family}')" for path, (family, mixer) in claimed.items()
              if entries[path][1] == "chains"]
    support = Support(mode="chains", reason=f"{', '.join(chains)} follow packed samples only as separate chains: "
                                            "they cannot start a segment from the state its parent ends in; pack one "
                                            "chain per sample") if chains else Support(mode="tree")
    if not claimed:
        support.reason = "no recurrent layers"
    _remove_guards(id(model))  # install twice: the new guards replace the old ones
    handoffs: dict[tuple[str, str], list[str]] = {}
    for path, (family, mixer) in claimed.items():
        manifest = families[family]["manifest"]
        module_name = type(mixer).__module__
        entry, follows = entries[path]
        backend = backends.get(family, seams.owners[module_name].backend if module_name in seams.owners else "auto")
        if backend not in HANDOFF_BACKENDS and module_name not in seams.owners:
            backend = _owned_elsewhere(module_name, family) or backend  # a library patched it first: it stays its
        if backend in HANDOFF_BACKENDS:
            handoffs.setdefault((backend, family), [])
            if module_name not in handoffs[(backend, family)]:
                handoffs[(backend, family)].append(module_name)
        else:
            modeling = importlib.import_module(module_name)
            carriers = [getattr(modeling, c) for c in entry.get("plan_carriers", []) if hasattr(modeling, c)]
            new = module_name not in seams.owners
            seams.add_model(seams.patch_module(modeling, family, manifest["seams"], carriers, policy, backend), model)
            if new:
                _tell_libraries(module_name, family, True)
            if module_name not in support.modules:
                support.modules.append(module_name)
        if follows == "chains":
            _guards.setdefault(id(model), []).append(
                mixer.register_forward_pre_hook(_chains_guard(path, family), with_kwargs=True))
        support.layers.append(LayerSupport(path, type(mixer).__name__, family, backend, module_name, follows))
        support.families[family] = backend
    try:
        for (backend, family), names in handoffs.items():
            if backend in HANDOFF_ACTIONS:
                HANDOFF_ACTIONS[backend](model, family, names)
    except BaseException:
        _remove_guards(id(model))
        for name in support.modules:
            seams.release_model(name, id(model))
        raise
    if claimed:
        # on the model install was given (a head hands use_cache down to its backbone)
        _cache_hooks[id(model)] = [model.register_forward_pre_hook(_no_cache_for_tree_rows, with_kwargs=True)]
    _installed[id(model)] = support
    if _installed_refs.get(id(model)) is None or _installed_refs[id(model)]() is not model:
        _installed_refs[id(model)] = weakref.ref(model, lambda _, model_id=id(model): seams._on_collected(model_id))
    model._tree_recurrence_support = support
    return support


def uninstall(model: torch.nn.Module) -> None:
    """Removes this model's claim on its modeling modules; a module no installed model uses is
    restored attribute by attribute to the very objects it had before install (an attribute something
    else wrapped since keeps that wrapper; ours under it steps aside). Thread-safe."""
    with seams.locked():
        support = _support_of(model)
        if support is None:
            return
        del _installed[id(model)], _installed_refs[id(model)]
        _remove_guards(id(model))
        for name in support.modules:
            seams.release_model(name, id(model))
    if getattr(model, "_tree_recurrence_support", None) is support:
        del model._tree_recurrence_support


def set_backend(model: torch.nn.Module, family: str, backend: str) -> None:
    """Swaps a family's backend at run time for the modeling modules this model uses."""
    support = _support_of(model)
    if support is None:
        raise ValueError("set_backend: this model has no tree_recurrence hooks; call install(model) first")
    backend = _check_backends({family: backend}, plugins.families())[family]  # a fallback may replace it
    if family not in support.families:
        raise ValueError(f"set_backend: the model has no layer of family '{family}' (has {sorted(support.families)})")
    if backend in HANDOFF_BACKENDS or support.families[family] in HANDOFF_BACKENDS:
        raise ValueError(f"set_backend: backend '{backend if backend in HANDOFF_BACKENDS else support.families[family]}' "
                         f"hands the modeling modules to another library; choose it at install "
                         f"(uninstall, then install(model, backends={{'{family}': ...}}))")
    for name in support.modules:
        owner = seams.owners[name]
        if owner.family == family:
            owner.backend = backend
    support.families[family] = backend
    for layer in support.layers:
        if layer.family == family:
            layer.backend = backend
