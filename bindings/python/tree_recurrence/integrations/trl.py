"""TRL integration: AsyncGRPOTrainer (trl 1.16) on hybrid models with recurrent layers.

TRL's ``AsyncGRPOTrainer`` packs the rollouts of one rank into a prefix trie (``TreeRow``) and
forwards it as one row with ``tree_*`` kwargs. In trl 1.16 it loads the model in its constructor
(``create_model_from_path``) and refuses any model whose text config has ``layer_types`` other than
``full_attention`` / ``sliding_attention``: a recurrent layer would scan across samples. With the
hooks of :func:`tree_recurrence.install` those layers follow the trie, so::

    from tree_recurrence.integrations.trl import tree_recurrent_models

    with tree_recurrent_models() as supports:        # supports receives each loaded model's Support
        trainer = AsyncGRPOTrainer(model="Qwen/Qwen3.5-...", args=args, ...)
        trainer.train()

What the context manager patches in ``trl.experimental.async_grpo.async_grpo_trainer`` (all restored
on exit, also on exceptions):

* ``create_model_from_path``: loads as before (``attn_implementation=`` overrides TRL's ``tree_fa3``
  when given, e.g. ``"tree_sdpa"`` without flash-attention 3), then ``install(model, policy,
  backends)``. A model answering ``"none"`` is refused with the reason. The text config's
  ``layer_types`` is then hidden (TRL's refusal reads None) ...
* ``add_fused_lm_head`` (the trainer's next step after the refusal): ... and restored before it,
  the very same object: the trainer is built with the model's config intact.
* ``compute_flops_per_token``: :func:`guarded_flops` (trl 1.16's estimate raises on most MoE
  configs and charges linear-attention layers as softmax attention). It is called every optimizer
  step, so call ``trainer.train()`` inside the block.
* ``TokenBudgetBatcher`` / ``FixedCountBatcher``: the chain batchers, when a loaded model's support
  is ``"chains"`` (``packing="auto"``) or when ``packing="chains"``.

The hooks installed on the model stay after the block (``tree_recurrence.uninstall(model)`` removes
them); if the block raises (the trainer's constructor failing, say), every model it installed is
uninstalled too. See docs/trl.md.

Importing this module imports neither transformers nor trl: the chain classes (subclasses of TRL's,
``trl_chains.py``) are imported on first use, and everything else imports TRL when called. The other
parts: ``trl_backend.py`` (backend ``"trl"``, TRL's own tree kernels), ``trl_rows.py``
(``tree_kwargs_from_batch``), ``flops.py`` (``guarded_flops``).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from .. import plugins
from ..attention import register_tree_attention
from ..backends import check_backends
from ..install import Support, install, register_backend, uninstall
from ..policy import Policy
from .flops import guarded_flops, remember_model
from .trl_backend import hand_off, note_if_imported, owns_if_imported, trl_backend_unavailable
from .trl_rows import tree_kwargs_from_batch

__all__ = ["ChainFixedCountBatcher", "ChainRow", "ChainTokenBudgetBatcher", "guarded_flops", "tree_kwargs_from_batch",
           "tree_recurrent_models", "trl_backend_unavailable"]

TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
# What trl 1.16's refusal lets through (async_grpo_trainer.py: `layer_types - {...}`).
_TRL_ATTENTION_TYPES = {"full_attention", "sliding_attention"}


def _trainer_module():
    return importlib.import_module(TRAINER_MODULE)


# ------------------------------------------------------------------------------------------------
# chains: every sample its own chain (trl_chains.py; its classes subclass TRL's, so it is imported on
# first use)
# ------------------------------------------------------------------------------------------------


_CHAIN_CLASSES = ("ChainRow", "ChainTokenBudgetBatcher", "ChainFixedCountBatcher")


def __getattr__(name: str):
    # The chain classes subclass TRL's: built (importing TRL) when first asked for.
    if name in _CHAIN_CLASSES:
        from . import trl_chains

        return getattr(trl_chains, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# FLOPs (integrations/flops.py)
# ------------------------------------------------------------------------------------------------


def _trainer_flops(config: Any, seq_len: int) -> int:
    """What the trainer module's ``compute_flops_per_token`` becomes under tree_recurrent_models()."""
    return guarded_flops(config, seq_len)


# ------------------------------------------------------------------------------------------------
# the context manager
# ------------------------------------------------------------------------------------------------


class _Patches:
    """setattr with exact restore (reverse order, the very objects)."""

    _MISSING = object()

    def __init__(self):
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((target, name, target.__dict__.get(name, self._MISSING)))
        setattr(target, name, value)

    def restore(self) -> None:
        while self._saved:
            target, name, old = self._saved.pop()
            if old is self._MISSING:
                delattr(target, name)
            else:
                setattr(target, name, old)


def _recurrent_layer_types(config: Any) -> set[str]:
    try:
        return set(getattr(config, "layer_types", None) or []) - _TRL_ATTENTION_TYPES
    except Exception:
        return set()


class _LayerTypesHider:
    """Makes ``config.layer_types`` read None by giving the config object a subclass whose class-level
    property shadows the attribute (a plain attribute, a property, or the attribute ``attribute_map``
    aliases it to, e.g. ``layers_block_type``); restoring gives it back its class, so ``layer_types`` is
    again the very object it was."""

    def __init__(self):
        self._hidden: dict[int, tuple[Any, type]] = {}

    def hide(self, config: Any) -> None:
        if id(config) in self._hidden:
            return
        cls = type(config)
        # configs may alias the name (attribute_map: layer_types -> layers_block_type): shadow both
        names = {"layer_types", (getattr(config, "attribute_map", None) or {}).get("layer_types", "layer_types")}

        def shadowed(name):
            return property(lambda self: None, lambda self, value: self.__dict__.__setitem__(name, value))

        shadow = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                             **{name: shadowed(name) for name in names}})
        config.__class__ = shadow
        self._hidden[id(config)] = (config, cls)

    def restore(self, config: Any) -> None:
        entry = self._hidden.pop(id(config), None)
        if entry is not None:
            entry[0].__class__ = entry[1]

    def restore_all(self) -> None:
        for config, cls in list(self._hidden.values()):
            config.__class__ = cls
        self._hidden.clear()


@contextlib.contextmanager
def tree_recurrent_models(policy: Policy | None = None, backends: dict[str, str] | None = None, *,
                          attn_implementation: str | None = None, packing: str = "auto",
                          flops: bool = True) -> Iterator[list[Support]]:
    """Within this block, trl 1.16's AsyncGRPOTrainer takes models with recurrent layers.

    Every model the trainer loads gets ``tree_recurrence.install(model, policy, backends)`` (its
    :class:`~tree_recurrence.Support` is appended to the yielded list; a model answering ``"none"`` is
    refused with the reason), and the trainer does not see its recurrent ``layer_types`` until it has
    passed its refusal; the config is intact when the constructor returns.

    ``attn_implementation``: replaces TRL's ``"tree_fa3"`` (flash-attention 3 from the kernels hub, CUDA
    only), e.g. ``"tree_flex"`` or ``"tree_sdpa"`` (``tree_recurrence.attention``, registered here). ``packing``: ``"auto"``
    switches the trainer to :class:`ChainTokenBudgetBatcher` / :class:`ChainFixedCountBatcher` when a
    loaded model's support is ``"chains"``; ``"chains"`` always; ``"tree"`` never. ``flops``: replace
    the trainer's FLOPs estimate with :func:`guarded_flops` (used for MFU every optimizer step: keep
    ``trainer.train()`` inside the block). Everything patched is restored on exit, also on exceptions.
    """
    if packing not in ("auto", "tree", "chains"):
        raise ValueError(f"tree_recurrent_models: packing must be 'auto', 'tree' or 'chains', got {packing!r}")
    check_backends(backends, plugins.families())  # unknown or unavailable backends fail here, not in the trainer
    if attn_implementation in ("tree_sdpa", "tree_flex"):
        register_tree_attention(attn_implementation)
    _agt = _trainer_module()
    from . import trl_chains  # subclasses TRL's batchers: imports TRL (optional), so only here
    supports: list[Support] = []
    installed: list[torch.nn.Module] = []  # uninstalled again if the block raises
    patches = _Patches()
    hider = _LayerTypesHider()
    load_model = _agt.create_model_from_path
    add_head = _agt.add_fused_lm_head
    chains_patched = False

    def use_chain_batchers():
        nonlocal chains_patched
        if not chains_patched:
            patches.set(_agt, "TokenBudgetBatcher", trl_chains.ChainTokenBudgetBatcher)
            patches.set(_agt, "FixedCountBatcher", trl_chains.ChainFixedCountBatcher)
            chains_patched = True

    def create_model_from_path(model_id, *args, **kwargs):
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model = load_model(model_id, *args, **kwargs)
        support = install(model, policy=policy, backends=backends)
        supports.append(support)
        installed.append(model)
        if support.mode == "none":
            raise ValueError(f"tree_recurrent_models: {type(model).__name__} ({model_id}) cannot take tree-packed rows: "
                             f"{support.reason}")
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        remember_model(text_config, model)
        if packing == "chains" or (packing == "auto" and support.mode == "chains"):
            use_chain_batchers()
        if _recurrent_layer_types(text_config):
            hider.hide(text_config)
        return model

    def add_fused_lm_head(model, *args, **kwargs):
        config = getattr(model, "config", None)
        if config is not None:
            hider.restore(config.get_text_config() if hasattr(config, "get_text_config") else config)
        return add_head(model, *args, **kwargs)

    try:
        patches.set(_agt, "create_model_from_path", create_model_from_path)
        patches.set(_agt, "add_fused_lm_head", add_fused_lm_head)
        if flops:
            patches.set(_agt, "compute_flops_per_token", _trainer_flops)
        if packing == "chains":
            use_chain_batchers()
        yield supports
    except BaseException:
        for model in reversed(installed):  # the docstring's promise: nothing changed outlives a failure
            uninstall(model)
        raise
    finally:
        hider.restore_all()
        patches.restore()


# Backend "trl" (install.register_backend: install.py does not know this module): TRL's own tree kernel
# takes the family's modeling modules; without it, this package's hooks with a warning.
register_backend("trl", trl_backend_unavailable, handoff=True, action=hand_off, fallback="auto",
                 owns=owns_if_imported, note_patched=note_if_imported)
