"""Tree attention for transformers models: each segment attends to its root-to-segment path.

Two implementations, registered with transformers' attention interface:

- ``"tree_sdpa"``: the reference (a dense N x N mask + SDPA), for tests and small rows;
- ``"tree_flex"``: FlexAttention with a block mask built once per plan from the trie (a key is
  visible iff it lies on the query's root-to-token path and not after it; sliding windows and
  grouped KV heads as the model asks), for users without TRL's flash kernel.

``register_tree_attention(name)`` registers one of them; without tree kwargs either is
transformers' SDPA attention, so one model serves both ordinary and tree-packed batches.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ._tree_kwargs import tree_plan
from ._engine import ENGINE

TREE_ATTENTION = "tree_sdpa"
TREE_FLEX = "tree_flex"


# Built on the host from the plan and cached: under torch.compile it runs eagerly (a graph break).
@torch.compiler.disable
def tree_attention_mask(plan, device, sliding_window: int | None = None) -> torch.Tensor:
    """(N, N) bool: token t may attend to token u iff u is on t's path at or before t (and, with
    ``sliding_window``, fewer than that many path positions back). Cached with the plan."""
    if sliding_window is not None:
        key = ("attention_mask", torch.device(device), int(sliding_window))

        def build():
            position = plan.tensor("token_position", device)
            near = (position[:, None] - position[None, :]) < int(sliding_window)
            return tree_attention_mask(plan, device) & near

        return plan.cached(key, build)
    key = ("attention_mask", torch.device(device))

    def build():
        gather, _ = plan.padded_paths("cpu")
        leaf = plan.array("segment_source_leaf")[plan.array("token_segment")]
        position = plan.array("token_position")
        rows = gather[leaf]  # (N, Lmax): the path each token takes its outputs from
        steps = torch.arange(gather.shape[1])
        allowed = (steps[None, :] <= position[:, None]) & (rows >= 0)
        mask = torch.zeros(plan.num_tokens, plan.num_tokens, dtype=torch.bool)
        token = torch.arange(plan.num_tokens)[:, None].expand_as(rows)
        mask[token[allowed], rows[allowed]] = True
        return mask.to(device)

    return plan.cached(key, build)


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
    mask = tree_attention_mask(plan, query.device, kwargs.get("sliding_window"))
    # A dense boolean mask sends SDPA to its math kernel, which in half precision rounds the scores
    # and probabilities (the fused causal kernels accumulate in fp32); computing in fp32 keeps this
    # reference at least as accurate as the model's own attention on each sample.
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = F.scaled_dot_product_attention(
        query.to(compute), key.to(compute), value.to(compute), attn_mask=mask[None, None],
        dropout_p=dropout if module.training else 0.0, scale=scaling,
    )
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------------------------
# tree_flex: FlexAttention with a block mask from the trie
# ------------------------------------------------------------------------------------------------


def tree_subtree_ends(plan, device) -> torch.Tensor:
    """(N,) int64: for each token u, one past the last token of the subtree of u's segment.

    Segments are in DFS pre-order, so the subtree of segment a is the contiguous token range
    [seg_offsets[a], seg_offsets[a + size(a)]); a query t sees key u iff u <= t < end[u] (u's
    segment is t's segment or one of its ancestors, and u is not after t). Cached with the plan."""
    device = torch.device(device)
    key = ("subtree_end", device)

    def build():
        parents = plan.array("parents")
        end_segment = torch.arange(1, plan.num_segments + 1, dtype=torch.int64)
        level_offsets = plan.array("level_offsets")
        level_segments = plan.array("level_segments")
        for level in range(plan.num_levels - 1, 0, -1):  # deepest first: children before parents
            segments = level_segments[level_offsets[level]:level_offsets[level + 1]]
            end_segment.scatter_reduce_(0, parents[segments], end_segment[segments], "amax")
        ends = plan.array("seg_offsets")[end_segment][plan.array("token_segment")]
        return ends.to(device)

    return plan.cached(key, build)


def segments_in_preorder(plan) -> bool:
    """Whether every segment's subtree is the contiguous run of segments after it (DFS pre-order,
    as TRL lays rows out). The richer format only promises parents before children; then subtree
    ranges do not describe the tree and tree_flex uses the path mask instead. Cached."""

    def build():
        parents = plan.array("parents")
        size = torch.ones(plan.num_segments, dtype=torch.int64)
        end_segment = torch.arange(1, plan.num_segments + 1, dtype=torch.int64)
        level_offsets = plan.array("level_offsets")
        level_segments = plan.array("level_segments")
        for level in range(plan.num_levels - 1, 0, -1):
            segments = level_segments[level_offsets[level]:level_offsets[level + 1]]
            size.index_add_(0, parents[segments], size[segments])
            end_segment.scatter_reduce_(0, parents[segments], end_segment[segments], "amax")
        # Descendants come after their ancestor, so [a, end) holds the whole subtree; it holds
        # nothing else iff it is exactly as long as the subtree.
        return bool((end_segment - torch.arange(plan.num_segments) == size).all())

    return plan.cached(("preorder",), build)


def tree_mask_mod(plan, device, sliding_window: int | None = None):
    """The FlexAttention ``mask_mod`` of the plan's tree (see :func:`tree_subtree_ends`); for rows not
    in DFS pre-order, a lookup into the path mask of :func:`tree_attention_mask` (N x N, as tree_sdpa)."""
    if not segments_in_preorder(plan):
        allowed = tree_attention_mask(plan, device, sliding_window)

        def mask_mod(b, h, q, kv):
            return allowed[q, kv]
        return mask_mod
    ends = tree_subtree_ends(plan, device)
    if sliding_window is None:
        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q < ends[kv])
    else:
        position = plan.tensor("token_position", device)
        window = int(sliding_window)

        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q < ends[kv]) & (position[q] - position[kv] < window)
    return mask_mod


def _tree_blocks(ends: torch.Tensor, n: int, block: int):
    """(partial, full) (Q blocks x KV blocks) of the tree mask u <= q < ends[u], from the keys'
    intervals alone: O(N * N / block) work instead of O(N * N). Key u is visible to some query of
    block [lo, hi] iff max(u, lo) <= min(ends[u] - 1, hi), to all of them iff u <= lo and
    ends[u] > hi; blocks running past N are never full."""
    device = ends.device
    blocks = -(-n // block)
    pad = blocks * block - n
    u = torch.arange(blocks * block, device=device)
    e = torch.cat([ends, torch.zeros(pad, dtype=ends.dtype, device=device)])  # padded keys: never visible
    key_last = u.view(blocks, block).amax(dim=1)  # last key of each kv block
    key_end_min = e.view(blocks, block).amin(dim=1)
    kv_complete = torch.arange(blocks, device=device) < n // block
    partial = torch.zeros(blocks, blocks, dtype=torch.bool, device=device)
    full = torch.zeros(blocks, blocks, dtype=torch.bool, device=device)
    rows_per_chunk = max(1, (1 << 27) // (blocks * block))
    for first in range(0, blocks, rows_per_chunk):
        last = min(blocks, first + rows_per_chunk)
        lo = torch.arange(first, last, device=device) * block
        hi = (lo + block).clamp(max=n) - 1
        visible = torch.maximum(u[None, :], lo[:, None]) <= torch.minimum(e[None, :] - 1, hi[:, None])
        any_ = visible.view(last - first, blocks, block).any(dim=2)
        all_ = (key_last[None, :] <= lo[:, None]) & (key_end_min[None, :] > hi[:, None]) & kv_complete[None, :]
        all_ &= (hi - lo + 1 == block)[:, None]
        full[first:last] = all_
        partial[first:last] = any_ & ~all_
    return partial, full


def _blocks_from_mask_mod(mask_mod, n: int, block: int, device):
    """(partial, full) by evaluating ``mask_mod`` chunk by chunk (~256 M entries at a time) against
    the keys up to each chunk's last query; padding past N counts as masked."""
    blocks = -(-n // block)
    partial = torch.zeros(blocks, blocks, dtype=torch.bool, device=device)
    full = torch.zeros(blocks, blocks, dtype=torch.bool, device=device)
    rows_per_chunk = max(1, (1 << 28) // (blocks * block * block))
    padded_keys = torch.arange(blocks * block, device=device)
    for first in range(0, blocks, rows_per_chunk):
        last = min(blocks, first + rows_per_chunk)
        q = torch.arange(first * block, last * block, device=device)
        kv = padded_keys[: last * block]
        m = mask_mod(0, 0, q.clamp(max=n - 1)[:, None], kv.clamp(max=n - 1)[None, :])
        m &= (q[:, None] < n) & (kv[None, :] < n)
        m = m.view(last - first, block, last, block)
        any_ = m.any(dim=3).any(dim=1)
        all_ = m.all(dim=3).all(dim=1)
        full[first:last, :last] = all_
        partial[first:last, :last] = any_ & ~all_
    return partial, full


FLEX_BLOCK = 128  # FlexAttention's sparse block size


def tree_block_mask(plan, device, sliding_window: int | None = None, block: int = FLEX_BLOCK):
    """The plan's FlexAttention BlockMask on ``device``, built once and cached with the plan, so
    every layer and every gradient-checkpoint replay of a forward reuses it.

    Never the whole N x N mask at once (a forest of 64 chains of 2,560 tokens would need 27 GB):
    without a window the blocks come from the keys' subtree intervals (:func:`_tree_blocks`), with
    one the mask is evaluated chunk by chunk (:func:`_blocks_from_mask_mod`)."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    key = ("flex_block_mask", device, None if sliding_window is None else int(sliding_window), block)

    def build():
        n = plan.num_tokens
        mask_mod = tree_mask_mod(plan, device, sliding_window)
        if sliding_window is None and segments_in_preorder(plan):
            partial, full = _tree_blocks(tree_subtree_ends(plan, device), n, block)
        else:
            partial, full = _blocks_from_mask_mod(mask_mod, n, block, device)

        def ordered(flags):
            counts = flags.sum(dim=1, dtype=torch.int32)
            indices = torch.argsort(flags.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
            return counts[None, None].contiguous(), indices[None, None].contiguous()

        kv_num, kv_idx = ordered(partial)
        full_num, full_idx = ordered(full)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                              seq_lengths=(n, n))

    return plan.cached(key, build)


def _dense_flex_mask(plan, device, sliding_window):
    """The block mask's mask materialised (N, N) bool, for the CPU backward path; cached."""
    key = ("flex_dense_mask", torch.device(device), None if sliding_window is None else int(sliding_window))

    def build():
        n = plan.num_tokens
        q = torch.arange(n, device=device)
        return tree_mask_mod(plan, device, sliding_window)(0, 0, q[:, None], q[None, :])

    return plan.cached(key, build)



def _flex_kernel():
    """flex_attention compiled once (its eager form materialises every score: only for CPU), for
    dynamic shapes: row lengths change every step, and a static compile would recompile for each."""
    if ENGINE.compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        ENGINE.compiled_flex = torch.compile(flex_attention, dynamic=True)
    return ENGINE.compiled_flex


# Packed rows (position ids restarting) make transformers build a dense (N, N) mask before any
# layer runs; tree_flex ignores it on tree rows, and for a 164k-token row it would take 27 GB.
# Above this many entries tree_flex's mask function returns SKIPPED_MASK instead.
DENSE_MASK_LIMIT = 1 << 28


def _skipped_mask(device) -> torch.Tensor:
    mask = torch.empty(0, dtype=torch.bool, device=device)
    mask._tree_recurrence_skipped = True
    return mask


def tree_flex_mask(*args, **kwargs):
    """transformers mask function of ``"tree_flex"``: SDPA's, except that a packed row's dense mask
    larger than DENSE_MASK_LIMIT is not built (a marker stands in; tree rows never read it, and an
    ordinary packed row that large is refused by the attention with the reason)."""
    from transformers.masking_utils import sdpa_mask

    b, q, kv = kwargs.get("batch_size"), kwargs.get("q_length"), kwargs.get("kv_length")
    if (not args and b == 1 and isinstance(q, int) and isinstance(kv, int) and q * kv > DENSE_MASK_LIMIT
            and not kwargs.get("allow_is_causal_skip", True)):
        return _skipped_mask(kwargs.get("device", "cpu"))
    return sdpa_mask(*args, **kwargs)


def tree_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    plan = tree_plan(kwargs)
    if plan is None:  # an ordinary batch: plain causal SDPA with the mask transformers built
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if getattr(attention_mask, "_tree_recurrence_skipped", False):
            raise ValueError(
                f"attention '{TREE_FLEX}': a packed row of {query.shape[2]} tokens without tree kwargs; its dense mask "
                f"(over {DENSE_MASK_LIMIT} entries) was not built: pass the tree kwargs (one chain per sample) or use 'sdpa'")

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != plan.num_tokens:
        raise ValueError(
            f"attention '{TREE_FLEX}': expected one packed row of {plan.num_tokens} tokens, got query {tuple(query.shape)}"
        )
    if module.training and dropout:
        raise ValueError(f"attention '{TREE_FLEX}': attention dropout {dropout} is not supported (set attention_dropout=0)")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention '{TREE_FLEX}': softcap {kwargs['softcap']} is not supported")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"attention '{TREE_FLEX}': {query.shape[1]} query heads are not a multiple of {key.shape[1]} key heads")
    window = kwargs.get("sliding_window")
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if query.device.type == "cpu" and grad:
        # torch's FlexAttention has no CPU backward: the same mask, materialised, through SDPA.
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        out = F.scaled_dot_product_attention(query.to(compute), key.to(compute), value.to(compute),
                                             attn_mask=_dense_flex_mask(plan, query.device, window)[None, None], scale=scaling)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = tree_block_mask(plan, query.device, window)
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cpu":  # eager flex (it materialises the scores; CPU rows are small)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    else:
        out = _flex_kernel()(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


_IMPLEMENTATIONS = {TREE_ATTENTION: tree_sdpa_attention, TREE_FLEX: tree_flex_attention}
_MASKS = {TREE_ATTENTION: None, TREE_FLEX: tree_flex_mask}  # None: SDPA's own


def register_tree_attention(name: str = TREE_ATTENTION) -> str:
    """Registers tree attention ``name`` (``"tree_sdpa"`` or ``"tree_flex"``) with transformers and
    returns the name, to pass as ``attn_implementation``."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"register_tree_attention: name must be one of {sorted(_IMPLEMENTATIONS)}, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, _IMPLEMENTATIONS[name])
    # Ordinary batches get SDPA's own mask; tree-packed rows ignore it (the plan gives the mask).
    AttentionMaskInterface.register(name, _MASKS[name] or sdpa_mask)
    return name
