"""What install reads from a model: its text config and ``layer_types``, the plain module descriptions
the family plugins' detectors (C++, ``sdk/detectors.h``) judge, which mixers they claim and which
recurrent layers no family covers, and whether a mixer's instance forward bypasses its seams."""

from __future__ import annotations

from typing import Any

import torch

from . import _core, plugins

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
