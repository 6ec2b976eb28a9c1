"""tree_flex (FlexAttention with a block mask from the trie) against samples run alone and against
the dense-mask reference tree_sdpa: causal, sliding windows, grouped KV heads, forward and backward,
at the attention level and in a tiny Qwen3.5 model.

On CPU torch's FlexAttention has no backward: with gradients tree_flex runs the same mask
materialised through SDPA, so the backward tests check the mask; the flex kernel's own backward
is checked on the GPU (tests/python/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models as M
import tree_recurrence as tr
from tree_recurrence import attention as A

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")


class _Module(torch.nn.Module):
    pass


def _qkv(n, heads=4, kv_heads=2, dim=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _alone(tree, q, k, v, window):
    """Each sample alone: its tokens gathered from the row, plain causal SDPA (with the window)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for pos in tree.sample_positions:
        L = pos.numel()
        i = torch.arange(L)
        mask = i[None, :] <= i[:, None]
        if window is not None:
            mask &= (i[:, None] - i[None, :]) < window
        out = F.scaled_dot_product_attention(q[:, :, pos], k[:, :, pos].repeat_interleave(groups, 1),
                                             v[:, :, pos].repeat_interleave(groups, 1), attn_mask=mask)
        outs.append(out[0].transpose(0, 1))  # (L, H, D)
    return outs


def _call(fn, tree, q, k, v, window):
    kw = tree.rich_kwargs()
    if window is not None:
        kw["sliding_window"] = window
    out, _ = fn(_Module().train(), q, k, v, None, scaling=None, **kw)
    return out[0]  # (N, H, D)


@pytest.mark.parametrize("forest", ["mixed", "groups", "tiny", "chain"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_flex_forward_matches_samples_alone_and_tree_sdpa(forest, window, heads):
    tree = M.pack_forest(forest)
    q, k, v = _qkv(tree.num_tokens, *heads)
    with torch.no_grad():  # the real FlexAttention kernel (CPU has it for forward)
        flex = _call(A.tree_flex_attention, tree, q, k, v, window)
        sdpa = _call(A.tree_sdpa_attention, tree, q, k, v, window)
    torch.testing.assert_close(flex, sdpa, rtol=1e-10, atol=1e-10)
    for i, (pos, ref) in enumerate(zip(tree.sample_positions, _alone(tree, q, k, v, window))):
        torch.testing.assert_close(flex[pos], ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"sample {i}: {m}")


@pytest.mark.parametrize("forest", ["mixed", "groups"])
@pytest.mark.parametrize("window", [None, 4])
def test_flex_backward_matches_samples_alone(forest, window):
    tree = M.pack_forest(forest)
    weights = [torch.randn(p.numel(), 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i, p in enumerate(tree.sample_positions)]
    q, k, v = _qkv(tree.num_tokens, grad=True)
    out = _call(A.tree_flex_attention, tree, q, k, v, window)
    sum((out[p] * w).sum() for p, w in zip(tree.sample_positions, weights)).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = _qkv(tree.num_tokens, grad=True)
    sum((o * w).sum() for o, w in zip(_alone(tree, q2, k2, v2, window), weights)).backward()
    for name, g, ref in zip("qkv", got, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("forest", ["mixed", "groups", "multiturn"])
@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_block_mask_matches_dense_mask_and_is_cached(forest, block, window):
    """Block by block (small blocks so the row has many), the block mask's sparsity agrees with the
    dense mask: every block with a visible pair is listed, full blocks only where all pairs are
    (without a window the blocks come from subtree intervals, with one from the mask itself)."""
    tree = M.pack_forest(forest)
    plan = tr.tree_plan(tree.rich_kwargs())
    n = plan.num_tokens
    bm = A.tree_block_mask(plan, "cpu", window, block=block)
    assert A.tree_block_mask(plan, "cpu", window, block=block) is bm  # cached with the plan
    dense = A.tree_attention_mask(plan, "cpu", window)
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, blocks * block, dtype=torch.bool)
    padded[:n, :n] = dense
    tiles = padded.view(blocks, block, blocks, block)
    want_any, want_all = tiles.any(3).any(1), tiles.all(3).all(1)
    num, idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    fnum, fidx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for r in range(blocks):
        assert set(fidx[r, : fnum[r]].tolist()) == set(torch.nonzero(want_all[r]).flatten().tolist()), r
        assert set(idx[r, : num[r]].tolist()) == set(torch.nonzero(want_any[r] & ~want_all[r]).flatten().tolist()), r
    assert bool(want_any.any()) and bool((want_any & ~want_all).any())


def test_register_rejects_unknown_name():
    with pytest.raises(ValueError, match="register_tree_attention: name must be one of"):
        A.register_tree_attention("tree_magic")


def _flex_model(**overrides):
    model = M.make_model("qwen3_5_text", **overrides)
    model.set_attn_implementation(A.register_tree_attention(A.TREE_FLEX))
    assert model.config._attn_implementation == A.TREE_FLEX
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_qwen3_5_with_tree_flex_matches_samples_alone(checkpointing, tree_install, alone_reference):
    tree = M.pack_forest("mixed")
    alone = alone_reference("qwen3_5_text", "mixed", tree)
    model = _flex_model()
    if checkpointing:
        model.gradient_checkpointing_enable()
    support = tree_install(model)
    assert support.mode == "tree", support.reason
    weights = M.loss_weights(tree.samples)
    result = M.run_tree(model, tree, weights, tree.trl_kwargs())
    M.assert_matches(result, alone, model, what=f"qwen3_5_text/tree_flex/ckpt={checkpointing}")
    with torch.no_grad():  # forward through the real FlexAttention kernel
        out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs()).logits[0]
    err, tol = M.logits_error(M.Result([out[p] for p in tree.sample_positions], {}), alone)
    assert err <= tol, f"flex forward: logits max abs error {err:.3e} > {tol:.3e}"


def test_tree_flex_without_tree_kwargs_is_plain_causal_attention():
    model = _flex_model()
    ids = torch.randint(2, M.VOCAB, (2, 9))
    out = model(input_ids=ids, use_cache=False).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits)


def test_tree_flex_mask_skips_huge_packed_masks_and_refuses_them_without_tree_kwargs():
    n = 1 << 15  # 2^30 entries: over the limit, never allocated
    skipped = A.tree_flex_mask(batch_size=1, q_length=n, kv_length=n, allow_is_causal_skip=False, device="cpu")
    assert skipped.numel() == 0 and skipped._tree_recurrence_skipped
    # plain causal rows still get SDPA's answer (None: is_causal), small packed rows their mask
    assert A.tree_flex_mask(batch_size=1, q_length=n, kv_length=n, attention_mask=None, device="cpu") is None
    small = A.tree_flex_mask(batch_size=1, q_length=8, kv_length=8, allow_is_causal_skip=False, device="cpu")
    assert small.shape[-2:] == (8, 8)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="packed row of 4 tokens without tree kwargs"):
        A.tree_flex_attention(_Module(), q, q, q, skipped)


def test_tree_rows_run_with_the_dense_mask_skipped(monkeypatch, tree_install, alone_reference):
    """With the limit below the row's size transformers' packed mask is never built; the tree row
    still matches its samples alone (tree_flex reads only the plan)."""
    monkeypatch.setattr(A, "DENSE_MASK_LIMIT", 16)
    tree = M.pack_forest("mixed")
    alone = alone_reference("qwen3_5_text", "mixed", tree)
    model = _flex_model()
    assert tree_install(model).mode == "tree"
    result = M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs())
    M.assert_matches(result, alone, model, what="qwen3_5_text/tree_flex/mask skipped")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_flex_on_rows_not_in_dfs_preorder(window, grad):
    """The richer format only promises parents before children: segment 3's parent may be segment 0
    after segment 1 started another subtree. Subtree ranges do not describe such a row; tree_flex must
    still equal the path mask of tree_sdpa (a subtree-range mask gave 0.94 relative error here)."""
    g = torch.Generator().manual_seed(5)
    parents = [-1, 0, 1, 0, -1, 4, 0, 2, 5, 3, -1, 10, 1, 12]
    assert not all(p in (-1, s - 1) for s, p in enumerate(parents))
    lengths = torch.randint(1, 70, (len(parents),), generator=g)
    offsets = torch.zeros(len(parents) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    kw = {"tree_cu_seqlens_q": offsets, "tree_segment_parents": torch.tensor(parents)}
    if window is not None:
        kw["sliding_window"] = window
    plan = tr.tree_plan(kw)
    assert not A.segments_in_preorder(plan)
    results = []
    for fn in (A.tree_flex_attention, A.tree_sdpa_attention):
        q, k, v = _qkv(plan.num_tokens, 4, 2, seed=1, grad=grad)
        with torch.set_grad_enabled(grad):
            out, _ = fn(_Module().train(), q, k, v, None, scaling=None, **kw)
        if grad:
            out.sum().backward()
            results.append([out.detach(), q.grad, k.grad, v.grad])
        else:
            results.append([out])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_preorder_detection_on_trl_rows():
    for forest in ("mixed", "groups", "tiny", "chain"):
        assert A.segments_in_preorder(tr.tree_plan(M.pack_forest(forest).rich_kwargs())), forest
