"""Tree attention for transformers models: each segment attends to its root-to-segment path.

A reference implementation (dense mask + SDPA) for tests and for users without TRL's flash
kernel. ``register_tree_attention()`` registers it as attention implementation ``"tree_sdpa"``;
without tree kwargs it is transformers' SDPA attention, so one model serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._plan import tree_plan

TREE_ATTENTION = "tree_sdpa"


def tree_attention_mask(plan, device) -> torch.Tensor:
    """(N, N) bool: token t may attend to token u iff u is on t's path at or before t. Cached."""
    key = ("attention_mask", torch.device(device))
    cache = plan._on_device
    if key not in cache:
        gather, _ = plan.padded_paths("cpu")
        leaf = plan.array("segment_source_leaf")[plan.array("token_segment")]
        position = plan.array("token_position")
        rows = gather[leaf]  # (N, Lmax): the path each token takes its outputs from
        steps = torch.arange(gather.shape[1])
        allowed = (steps[None, :] <= position[:, None]) & (rows >= 0)
        mask = torch.zeros(plan.num_tokens, plan.num_tokens, dtype=torch.bool)
        token = torch.arange(plan.num_tokens)[:, None].expand_as(rows)
        mask[token[allowed], rows[allowed]] = True
        cache[key] = mask.to(device)
    return cache[key]


def tree_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    plan = tree_plan(kwargs)
    if plan is None:  # an ordinary batch: plain causal SDPA with the mask transformers built
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != plan.num_tokens:
        raise ValueError(
            f"attention '{TREE_ATTENTION}': expected one packed row of {plan.num_tokens} tokens, got query {tuple(query.shape)}"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    mask = tree_attention_mask(plan, query.device)
    # A dense boolean mask sends SDPA to its math kernel, which in half precision rounds the scores
    # and probabilities (the fused causal kernels accumulate in fp32); computing in fp32 keeps this
    # reference at least as accurate as the model's own attention on each sample.
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = F.scaled_dot_product_attention(
        query.to(compute), key.to(compute), value.to(compute), attn_mask=mask[None, None],
        dropout_p=dropout if module.training else 0.0, scale=scaling,
    )
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_tree_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_sdpa_attention)
    from transformers.masking_utils import sdpa_mask

    # Ordinary batches get SDPA's own mask; tree-packed rows ignore it (the plan gives the mask).
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    return TREE_ATTENTION
