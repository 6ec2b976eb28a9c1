"""A FLOPs-per-token estimate that works on the models this package serves (``guarded_flops``): TRL 1.16's
``compute_flops_per_token`` reads config attributes many MoE and attention-free configs lack, and charges
every layer softmax attention, linear-attention layers included. Counted from the model's modules when
one is known for the config (``models_by_config``, filled by ``integrations.trl.tree_recurrent_models``),
else from the config. Imports neither transformers nor TRL until called."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .._engine import ENGINE

logger = logging.getLogger("tree_recurrence")

__all__ = ["guarded_flops"]


_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k")
_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# (per-head key/row size, per-head value/state size) attribute pairs of recurrent mixers
_STATE_DIMS = (("head_k_dim", "head_v_dim"), ("head_dim", "ssm_state_size"), ("head_dim", "state_size"),
               ("head_dim", "d_state"))


def _first_int(obj: Any, names) -> int | None:
    for name in names:
        try:
            value = getattr(obj, name, None)
        except Exception:
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class _FlopsShape:
    """What a per-token FLOPs estimate needs, read off a model's modules once."""

    def __init__(self, matmul: float, attention: list[tuple[int, int, int, int | None]], state: float):
        self.matmul = matmul  # active parameters of matmul-like weights (linear, conv, routed experts, router)
        self.attention = attention  # per softmax-attention layer: (heads, qk dim, v dim, sliding window or None)
        self.state = state  # recurrent-state elements summed over the linear layers

    def flops(self, seq_len: int) -> int:
        score = sum(2 * heads * (qk + v) * (min(seq_len, window) if window else seq_len)
                    for heads, qk, v, window in self.attention)
        return int(3 * (2 * self.matmul + score + 6 * self.state))


def _text_modules(model: torch.nn.Module, config: Any) -> list[tuple[str, torch.nn.Module]]:
    """The modules that process text tokens: all of them, or for a model whose config is not the text
    config (a vision-language model) its text model and LM head (the towers do not run per text token)."""
    if getattr(model, "config", config) is config:
        return list(model.named_modules())
    text = next((m for m in model.modules() if m is not model and getattr(m, "config", None) is config), None)
    if text is None:
        return list(model.named_modules())
    modules = [(f"text.{n}" if n else "text", m) for n, m in text.named_modules()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module) and not any(m is head for _, m in modules):
        modules.append(("lm_head", head))
    return modules


def _shape_from_model(model: torch.nn.Module, config: Any) -> _FlopsShape:
    top_k = _first_int(config, _TOP_K_NAMES)
    experts = _first_int(config, _EXPERT_COUNT_NAMES)
    named = _text_modules(model, config)
    expert_lists = [name for name, m in named
                    if isinstance(m, torch.nn.ModuleList) and experts and top_k and len(m) == experts and experts > top_k]
    matmul, state, attention, attention_paths = 0.0, 0.0, [], []
    for name, module in named:
        if isinstance(module, torch.nn.Embedding):
            continue  # a lookup; a tied lm_head is counted through its Linear module
        inside_attention = any(name.startswith(p + ".") for p in attention_paths)
        if isinstance(getattr(module, "is_causal", None), bool) and not inside_attention and name:
            # transformers' softmax attention modules (they set is_causal for the attention interface)
            cfg = getattr(module, "config", config)
            heads = _first_int(module, ("num_heads", "num_attention_heads")) or _first_int(cfg, ("num_attention_heads",))
            if heads:
                qk = _first_int(module, ("head_dim", "qk_head_dim")) or (cfg.hidden_size // heads)
                v = _first_int(module, ("v_head_dim",)) or qk
                window = getattr(module, "sliding_window", None)
                attention.append((heads, qk, v, window if isinstance(window, int) and window > 0 else None))
                attention_paths.append(name)
        share = 1.0
        if any(name.startswith(p + ".") for p in expert_lists):
            share = top_k / experts  # routed experts as a ModuleList: top_k of them run per token
        for pname, p in module.named_parameters(recurse=False):
            if pname == "A_log":
                heads = p.numel()
                dims = next(((getattr(module, a), getattr(module, b)) for a, b in _STATE_DIMS
                             if isinstance(getattr(module, a, None), int) and isinstance(getattr(module, b, None), int)),
                            None)
                if dims is not None:
                    state += heads * dims[0] * dims[1]
                continue
            if p.dim() < 2:
                continue  # norms, biases, decays: elementwise
            n = float(p.numel())
            if (p.dim() == 3 and top_k and experts and p.shape[0] == experts and experts > top_k
                    and not isinstance(module, torch.nn.modules.conv._ConvNd)):
                n *= top_k / experts  # routed experts stacked in one (experts, ., .) weight
            matmul += n * share
    return _FlopsShape(matmul, attention, state)


def _shape_from_config(config: Any) -> _FlopsShape:
    """A config-only fallback (when the model cannot be built on the meta device): trl's formula, with
    every attribute guarded and softmax attention only on attention layers."""
    h = getattr(config, "hidden_size", 0) or 0
    layers = getattr(config, "num_hidden_layers", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (h // heads if heads else 0)
    types = []
    for attr in ("layer_types", "layers_block_type"):
        try:
            types = list(getattr(config, attr, None) or [])
        except Exception:
            types = []
        if types:
            break
    attention_layers = (sum(1 for t in types if "attention" in t and "linear" not in t or t == "hybrid")
                        if types else (layers if heads else 0))
    projections = h * (heads * head_dim + 2 * kv * head_dim) + heads * head_dim * h
    top_k = _first_int(config, _TOP_K_NAMES)
    experts = _first_int(config, _EXPERT_COUNT_NAMES)
    dense = 3 * h * (getattr(config, "intermediate_size", 0) or 0)
    if top_k and experts:
        expert_size = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0) or 0
        mlp = top_k * 3 * h * expert_size + h * experts
    else:
        mlp = dense
    matmul = layers * (projections + mlp) + h * (getattr(config, "vocab_size", 0) or 0)
    window = getattr(config, "sliding_window", None)
    attention = [(heads, head_dim, head_dim, None)] * attention_layers
    if types and window:
        attention = [(heads, head_dim, head_dim, window if t == "sliding_attention" else None)
                     for t in types if "attention" in t and "linear" not in t or t == "hybrid"]
    return _FlopsShape(matmul, attention, 0.0)


_shapes: dict[int, tuple[weakref.ref, _FlopsShape]] = ENGINE.flops_shapes
# config id -> the model loaded under tree_recurrent_models() with that config (the trainer passes configs only)
_models_by_config: dict[int, tuple[weakref.ref, weakref.ref]] = ENGINE.flops_models_by_config


def remember_model(config: Any, model: torch.nn.Module) -> None:
    """Records ``model`` as the one loaded with ``config`` (held weakly): the trainer passes configs only."""
    _models_by_config[id(config)] = (weakref.ref(config), weakref.ref(model))


def _cached_shape(key_obj: Any, build) -> _FlopsShape:
    entry = _shapes.get(id(key_obj))
    if entry is not None and entry[0]() is key_obj:
        return entry[1]
    shape = build()
    try:
        _shapes[id(key_obj)] = (weakref.ref(key_obj), shape)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return shape


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(verbosity)


def guarded_flops(config: Any, seq_len: int, model: torch.nn.Module | None = None) -> int:
    """Training FLOPs per token (forward + backward = 3 x forward), trl's ``compute_flops_per_token``
    convention (non-causal attention score), for any causal LM config, MoE and hybrid included.

    trl 1.16's estimate raises ``AttributeError`` on most MoE configs (it reads ``num_local_experts``,
    ``moe_intermediate_size`` and ``decoder_sparse_step``, which many MoE configs lack, and
    ``num_attention_heads``, which attention-free configs lack) and charges every layer softmax attention, linear-attention layers included.

    Here the matmul work is read off the model's modules: 2 FLOPs per active weight (linear layers,
    convs, routers, routed experts scaled by top-k / experts, the LM head; embeddings are lookups).
    ``model``: the model itself; else the one loaded under :func:`tree_recurrent_models` with this
    config, else one built from the config on the meta device (no memory, cached). Softmax attention
    layers (transformers' attention modules) add ``2 * heads * (qk_dim + v_dim) * seq_len`` (capped at
    a sliding window); recurrent layers add ``6 * heads * key_dim * value_dim`` (state update and
    readout, independent of ``seq_len``). Only the attention term grows with ``seq_len``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if model is None:
        entry = _models_by_config.get(id(config))
        if entry is not None and entry[0]() is config:
            model = entry[1]()
    if model is not None:
        shape = _cached_shape(model, lambda: _shape_from_model(model, config))
    else:
        def build():
            try:
                return _shape_from_model(_meta_model(config), config)
            except Exception as error:  # a config transformers cannot instantiate: the guarded formula
                logger.debug("tree_recurrence: guarded_flops: meta model of %s failed (%s); config formula",
                             getattr(config, "model_type", "?"), error)
                return _shape_from_config(config)

        shape = _cached_shape(config, build)
    return shape.flops(int(seq_len))
