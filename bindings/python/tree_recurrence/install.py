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

Backends per family (``backends.py``: ``BACKENDS``, name -> availability check): ``"auto"`` (policy chooses
native / fork / rescan), ``"native"`` (the family's own tree kernels only), ``"kernel"`` (fork /
rescan over whatever transformers bound: a kernel library or its PyTorch reference),
``"stand_ins"`` (fork / rescan over the families' library stand-ins, bound as libraries; the old
name ``"reference"`` is accepted with a DeprecationWarning), ``"trl"``
(hand the family's modeling modules to TRL's own tree kernel, huggingface/trl#7686's
``patch_tree_gdn``; TRL 1.16 has none: then a warning names what is missing and ``"auto"`` serves
the family, ``FALLBACKS``). A backend whose check says it is unusable is refused with the check's
reason (or replaced by its fallback); a hand-off backend (``HANDOFF_BACKENDS``) leaves the modeling
module unpatched for the library that owns it. A module TRL patched first stays TRL's; one hooked
here is recorded in TRL's patched set. Installing a model again with other backends re-routes its
modules (``backends.route``): our hooks released and the module handed over, or a module handed off
taken back, unless another installed model still uses it (a ``ValueError`` names it). What install
reads from the model (descriptions for the detectors, ``layer_types``, instance and class forwards)
is ``_detection.py``.

Ownership (docs/architecture.md, "Who owns a seam"): install and uninstall are serialized by
``seams.locked()``; installed models are held weakly (a collected model releases its modules);
uninstall restores only attributes that still hold our wrappers. Also refused (``"none"``): a
modeling module lacking a seam its family needs, a mixer whose instance ``forward`` bypasses the
seams or whose class ``forward`` does not call them (or is not Python code), an unmarked mixer of a
Python-registered family without seams that follows trees (one that follows chains needs no mark),
and ``layer_types`` whose family's mixer classes the model lacks. A tree row that does not say
``use_cache`` runs without one.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import driver, plugins, seams
from ._engine import ENGINE
from ._detection import claim, forward_seam_gap, instance_forward_bypass, text_config
from ._detection import layer_types as _layer_types  # noqa: F401  (tests read it here)
from ._tree_kwargs import is_meta_tree, tree_plan
from .backends import (BACKENDS, FALLBACKS, HANDOFF_ACTIONS, HANDOFF_BACKENDS, check_backends, conflict,  # noqa: F401
                       hand_off, owned_elsewhere, register_backend, release_handoffs, route, tell_libraries)
from .policy import Policy

FOLLOWS = ("tree", "chains")  # what a family's manifest model entry may declare as "follows" (default "tree")

# Installed models by id(), held weakly (guarded by seams.lock): a model collected without uninstall
# releases its hooks (seams.sweep).
_installed: dict[int, "Support"] = ENGINE.installed
_installed_refs: dict[int, weakref.ref] = ENGINE.installed_refs
_guards: dict[int, list] = ENGINE.guards  # id(model) -> forward pre-hook handles of its "chains" layers
_cache_hooks: dict[int, list] = ENGINE.cache_hooks  # id(model) -> the pre-hooks turning use_cache off for tree rows
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
        release_handoffs(model_id)


seams.on_release(_forget_collected)


def _support_of(model: torch.nn.Module) -> "Support | None":
    ref = _installed_refs.get(id(model))
    return _installed.get(id(model)) if ref is not None and ref() is model else None



def _no_cache_for_tree_rows(module, args, kwargs):
    """A forward pre-hook of an installed model: a tree-packed row that did not say
    ``use_cache`` runs with ``use_cache=False`` (a row of many samples has no one recurrent state to
    cache); says so once. An explicit ``use_cache=True`` is left to be refused with the reason."""
    if kwargs.get("use_cache") is not None or kwargs.get("past_key_values") is not None or \
            kwargs.get("cache_params") is not None or is_meta_tree(kwargs) or tree_plan(kwargs) is None:
        return None
    if not ENGINE.told_use_cache:
        ENGINE.told_use_cache = True
        logger.info("tree_recurrence: a tree-packed row runs with use_cache=False (it holds many samples, each "
                    "with its own recurrent state); pass use_cache=False to say so")
    return args, {**kwargs, "use_cache": False}


def install(model: torch.nn.Module, policy: Policy | None = None, backends: dict[str, str] | None = None) -> Support:
    """Hooks ``model``'s recurrent layers so they follow tree-packed rows. See the module doc.
    Thread-safe: installs and uninstalls of models sharing modeling modules are serialized."""
    with seams.locked():
        return _install(model, policy, backends)


def _install(model: torch.nn.Module, policy: Policy | None, backends: dict[str, str] | None) -> Support:
    families = plugins.families()
    backends = check_backends(backends, families)
    config = text_config(model)
    model_type = getattr(config, "model_type", "") or ""
    claimed, leftovers = claim(model, families, config, model_type)
    if leftovers:
        return Support(mode="none", reason="; ".join(dict.fromkeys(leftovers)))
    entries = _resolve(model, claimed, families, backends)  # before patching anything: a refusal patches nothing
    if isinstance(entries, str):
        return Support(mode="none", reason=entries)
    chains = [f"{path} ({type(mixer).__name__}, family '{family}')" for path, (family, mixer) in claimed.items()
              if entries[path][1] == "chains"]
    support = Support(mode="chains", reason=f"{', '.join(chains)} follow packed samples only as separate chains: "
                                            "they cannot start a segment from the state its parent ends in; pack one "
                                            "chain per sample") if chains else Support(mode="tree")
    if not claimed:
        support.reason = "no recurrent layers"
    _hook(model, claimed, entries, families, backends, policy or Policy(), support)
    if claimed:
        # on the model install was given (a head hands use_cache down to its backbone)
        _cache_hooks[id(model)] = [model.register_forward_pre_hook(_no_cache_for_tree_rows, with_kwargs=True)]
    _installed[id(model)] = support
    if _installed_refs.get(id(model)) is None or _installed_refs[id(model)]() is not model:
        _installed_refs[id(model)] = weakref.ref(model, seams.on_collected(id(model)))
    model._tree_recurrence_support = support
    return support


def _resolve(model: torch.nn.Module, claimed: dict, families: dict, backends: dict[str, str]) -> dict | str:
    """Every claimed mixer's (manifest entry, follows), path by path, or why install refuses the model
    (raises when the backends asked for would take a module from another installed model)."""
    for family in sorted({f for f, _ in claimed.values()}):
        missing = {seam: spec.adapter for seam, spec in families[family].seams.items()
                   if spec.adapter not in driver.ADAPTERS}
        if missing:
            layers = [p for p, (f, _) in claimed.items() if f == family]
            return (f"family '{family}' covers {layers} but its seams {missing} need adapters this version lacks "
                    f"(known: {sorted(driver.ADAPTERS)})")
    entries = {}
    for path, (family, mixer) in claimed.items():
        module_name, name = type(mixer).__module__, type(mixer).__name__
        entry = next((m for m in families[family].models if m["module"] == module_name), None)
        if entry is None:
            return f"{path} ({name}) lives in {module_name}, which the '{family}' manifest does not list"
        module = importlib.import_module(module_name)
        needed = [seam for seam, spec in families[family].seams.items()
                  if spec.adapter != "decline" and not hasattr(module, seam)]
        if needed:
            return f"{path} ({name}): its modeling module {module_name} lacks the seam(s) {needed} family '{family}' needs"
        bypass = instance_forward_bypass(mixer) or forward_seam_gap(mixer, module, family, families[family].seams)
        if bypass:
            return f"{path} ({name}): {bypass}"
        follows = entry.get("follows", "tree")
        if follows not in FOLLOWS:
            return (f"{path} ({name}): the '{family}' manifest says it follows {follows!r}, which this version does "
                    f"not know (known: {list(FOLLOWS)})")
        # a family that follows trees without seams does so in the mixer's own forward (marked); one that
        # follows chains reads the row's sample boundaries itself
        if follows == "tree" and families[family].python and not families[family].seams and \
                not hasattr(getattr(type(mixer), "forward", None), "__tree_recurrence_forward__"):
            return (f"{path} ({name}): family '{family}' (registered from Python, no seams) claims mixers whose "
                    f"forward follows trees, but {name}.forward is not marked with mark_tree_forward")
        refused = conflict(module_name, family, backends.get(family), model)
        if refused:
            raise ValueError(refused)
        entries[path] = (entry, follows)
    return entries


def _hook(model: torch.nn.Module, claimed: dict, entries: dict, families: dict, backends: dict[str, str],
          policy: Policy, support: Support) -> None:
    """Patches the claimed mixers' modeling modules (or hands them to their hand-off backend's library)
    and guards the "chains" layers, recording every layer in ``support``; undone if a hand-off fails."""
    _remove_guards(id(model))  # install twice: the new guards replace the old ones
    handoffs: dict[tuple[str, str], list[str]] = {}
    for path, (family, mixer) in claimed.items():
        module_name = type(mixer).__module__
        entry, follows = entries[path]
        backend = route(module_name, family, backends.get(family), model)
        if backend in HANDOFF_BACKENDS:
            names = handoffs.setdefault((backend, family), [])
            if module_name not in names:
                names.append(module_name)
        else:
            modeling = importlib.import_module(module_name)
            carriers = [getattr(modeling, c) for c in entry.get("plan_carriers", []) if hasattr(modeling, c)]
            new = module_name not in seams.owners
            seams.add_model(seams.patch_module(modeling, family, families[family].seams, carriers, policy,
                                               backend), model)
            if new:
                tell_libraries(module_name, family, True)
            if module_name not in support.modules:
                support.modules.append(module_name)
        if follows == "chains":
            _guards.setdefault(id(model), []).append(
                mixer.register_forward_pre_hook(_chains_guard(path, family), with_kwargs=True))
        support.layers.append(LayerSupport(path, type(mixer).__name__, family, backend, module_name, follows))
        support.families[family] = backend
    try:
        for (backend, family), names in handoffs.items():
            hand_off(backend, model, family, names)
    except BaseException:
        _release(model, support)  # a re-install that fails leaves the model uninstalled
        raise


def uninstall(model: torch.nn.Module) -> None:
    """Removes this model's claim on its modeling modules; a module no installed model uses is
    restored attribute by attribute to the very objects it had before install (an attribute something
    else wrapped since keeps that wrapper; ours under it steps aside). Thread-safe."""
    with seams.locked():
        support = _support_of(model)
        if support is None:
            return
        _release(model, support)


def _release(model: torch.nn.Module, support: Support) -> None:
    """Drops every claim of ``model`` (``support``'s and an earlier install's): guards, hooked modules,
    modules handed off for it (taken back when no installed model uses them)."""
    earlier = _support_of(model)
    _installed.pop(id(model), None)
    _installed_refs.pop(id(model), None)
    _remove_guards(id(model))
    for name in dict.fromkeys(support.modules + (earlier.modules if earlier is not None else [])):
        seams.release_model(name, id(model))
    release_handoffs(id(model))
    for done in (support, earlier):
        if done is not None and getattr(model, "_tree_recurrence_support", None) is done:
            del model._tree_recurrence_support


def set_backend(model: torch.nn.Module, family: str, backend: str) -> None:
    """Swaps a family's backend at run time for the modeling modules this model uses."""
    support = _support_of(model)
    if support is None:
        raise ValueError("set_backend: this model has no tree_recurrence hooks; call install(model) first")
    backend = check_backends({family: backend}, plugins.families())[family]  # a fallback may replace it
    if family not in support.families:
        raise ValueError(f"set_backend: the model has no layer of family '{family}' (has {sorted(support.families)})")
    if backend in HANDOFF_BACKENDS or support.families[family] in HANDOFF_BACKENDS:
        raise ValueError(f"set_backend: backend '{backend if backend in HANDOFF_BACKENDS else support.families[family]}' "
                         f"hands the modeling modules to another library; choose it at install "
                         f"(install(model, backends={{'{family}': ...}}) again re-routes the model's modules)")
    for name in support.modules:
        owner = seams.owners[name]
        if owner.family == family:
            owner.backend = backend
    support.families[family] = backend
    for layer in support.layers:
        if layer.family == family:
            layer.backend = backend
