"""Formats users send: huggingface/trl#7686's ``tree_n_chunks`` (a kernel's chunk
count, not a level count) and ``tree_sizes`` (``[max_q, max_k, n_kv, n_chunks, *level sizes]``), read
by ``tree_plan`` and ``tree_kwargs_from_batch``; and ``components.tree_conv`` / ``tree_scan`` given a
row a collator padded past the plan (zeros at the padding, in outputs and gradients).

The #7686 fields are built here from TRL's own ``TreeRow.pack()`` output (its ``tree_max_seqlens`` and
``tree_kv_index``) and the harness's segment depths, not from the plan they are checked against."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import components, driver, plugins, stand_ins

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

MODEL_TYPE = "qwen3_5_text"
GDN, SEAM = "gated_delta_net", "torch_chunk_gated_delta_rule"
ARRAYS = ("seg_offsets", "parents", "level_offsets", "level_segments", "path_offsets", "path_tokens")


def _same_plan(a, b):
    assert (a.num_tokens, a.num_segments, a.num_leaves, a.num_levels) == (b.num_tokens, b.num_segments, b.num_leaves,
                                                                          b.num_levels)
    for name in ARRAYS:
        assert torch.equal(a.array(name), b.array(name)), name


def _levels(tree) -> torch.Tensor:
    """Segments per level, counted from the harness's depths (derived from TRL's key paths)."""
    return torch.bincount(tree.depths)


def _chunks(tree, size: int = 4) -> int:
    """A chunk count as a chunked kernel of ``size``-token chunks would give it (any value is valid)."""
    return int(((tree.seg_lengths + size - 1) // size).sum())


def _sizes(tree, n_chunks: int | None = None, pad: int = 0) -> torch.Tensor:
    """#7686's ``tree_sizes`` of ``tree``: max_q and max_k from TRL's ``tree_max_seqlens``, n_kv the length of
    TRL's ``tree_kv_index``, then the level sizes, ``pad`` zeros after them."""
    packed = tree.packed
    header = [int(packed["tree_max_seqlens"][0]), int(packed["tree_max_seqlens"][1]), packed["tree_kv_index"].numel(),
              _chunks(tree) if n_chunks is None else n_chunks]
    return torch.tensor(header + _levels(tree).tolist() + [0] * pad)


# ------------------------------------------------------------------------------------------------
# tree_n_chunks is a chunk count, checked, never used to cut levels
# ------------------------------------------------------------------------------------------------


def test_tree_n_chunks_does_not_cut_the_level_sizes():
    tree = M.pack_forest("mixed")
    plan = tr.tree_plan(tree.rich_kwargs())
    levels = _levels(tree)
    assert len(levels) > 2
    for count in (0, 1, len(levels) - 1, len(levels), len(levels) + 3, _chunks(tree), 10_000):
        for value in (count, torch.tensor(count), torch.tensor([count], dtype=torch.int32), np.int64(count)):
            kwargs = {**tree.rich_kwargs(), "tree_level_sizes": levels.clone(), "tree_n_chunks": value}
            _same_plan(tr.tree_plan(kwargs), plan)
            _same_plan(tr.tree_plan({**tree.trl_kwargs(), "tree_n_chunks": value}), plan)  # without level sizes
    padded = torch.cat([levels, torch.zeros(3, dtype=levels.dtype)])
    _same_plan(tr.tree_plan({**tree.trl_kwargs(), "tree_level_sizes": padded, "tree_n_chunks": 1}), plan)


@pytest.mark.parametrize("value", [-1, 2.5, "3", True, torch.tensor([1, 2]), torch.tensor(2.0), torch.tensor(-3)])
def test_tree_n_chunks_must_be_a_non_negative_integer(value):
    tree = M.pack_forest("fan")
    with pytest.raises(ValueError, match=r"tree_n_chunks: expected (one|a) non-negative integer"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_level_sizes": _levels(tree), "tree_n_chunks": value})


# ------------------------------------------------------------------------------------------------
# tree_sizes is [max_q, max_k, n_kv, n_chunks, *level sizes]
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", M.FOREST_NAMES)
def test_tree_sizes_header_and_level_sizes_are_read(name):
    tree = M.pack_forest(name)
    plan = tr.tree_plan(tree.trl_kwargs())
    assert plan.num_levels == len(_levels(tree))
    for fields in (tree.trl_kwargs(), tree.rich_kwargs(), tree.minimal_kwargs()):  # with and without key paths
        for sizes in (_sizes(tree), _sizes(tree, pad=3), _sizes(tree, n_chunks=0).tolist()):
            _same_plan(tr.tree_plan({**fields, "tree_sizes": sizes}), plan)
    # n_chunks is not compared with tree_n_chunks (the reason is in _tree_kwargs._check_level_sizes)
    both = {**tree.trl_kwargs(), "tree_sizes": _sizes(tree, n_chunks=7), "tree_n_chunks": 9,
            "tree_level_sizes": _levels(tree)}
    _same_plan(tr.tree_plan(both), plan)


def test_tree_sizes_header_mismatch_names_both_values():
    tree = M.pack_forest("multiturn")
    good = _sizes(tree)
    max_q, max_k, n_kv = good[:3].tolist()
    assert max_k > max_q and n_kv > tree.num_tokens  # the three differ: each entry is checked on its own
    cases = [(0, r"max_q \(entry 0\) is {}, but the tree's longest segment \(tree_max_seqlen_q\) is {}"),
             (1, r"max_k \(entry 1\) is {}, but the tree's longest key path, root to a segment's end "
                 r"\(tree_max_seqlen_k\) is {}"),
             (2, r"n_kv \(entry 2\) is {}, but the tree's key-index length, .* \(tree_cu_seqlens_k\[-1\]\) is {}")]
    for fields in (tree.trl_kwargs(), tree.minimal_kwargs()):
        for entry, message in cases:
            for delta in (1, -1):
                bad = good.clone()
                bad[entry] += delta
                with pytest.raises(ValueError, match="tree_sizes: " + message.format(int(bad[entry]), int(good[entry]))):
                    tr.tree_plan({**fields, "tree_sizes": bad})
    # the token count is not n_kv: a row whose n_kv reads as its token count is refused
    bad = good.clone()
    bad[2] = tree.num_tokens
    with pytest.raises(ValueError, match=rf"tree_sizes: n_kv \(entry 2\) is {tree.num_tokens}, but .* is {n_kv}"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": bad})


def test_tree_sizes_levels_and_layout_are_checked():
    tree = M.pack_forest("mixed")
    good, levels = _sizes(tree), _levels(tree)
    wrong = good.clone()
    wrong[4 + 1] += 1
    with pytest.raises(ValueError, match=rf"tree_sizes: level 1: {int(levels[1]) + 1} segments, but the key paths put "
                                         rf"{int(levels[1])} segments at level 1"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": wrong})
    with pytest.raises(ValueError, match=rf"tree_sizes: {len(levels) - 1} levels"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": good[:-1].clone()})
    extra = torch.cat([good, torch.tensor([0, 2])])
    with pytest.raises(ValueError, match=rf"tree_sizes: malformed padding after the tree's {len(levels)} levels: "
                                         rf"entry {4 + len(levels)} is 0 but entry {5 + len(levels)} is 2"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": extra})
    with pytest.raises(ValueError, match=r"tree_sizes: 3 entries \[.*\], but huggingface/trl#7686's layout is "
                                         r"\[max_q, max_k, n_kv, n_chunks, \*level sizes\]"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": good[:3].clone()})
    negative = good.clone()
    negative[3] = -1
    with pytest.raises(ValueError, match=r"tree_sizes: n_chunks \(entry 3\) is -1, expected a non-negative integer"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": negative})
    # tree_level_sizes and tree_sizes' level sizes must agree
    other = levels.clone()
    other[0], other[1] = other[1], other[0]
    assert not torch.equal(other, levels)
    with pytest.raises(ValueError, match=r"tree_level_sizes: \[.*\] but tree_sizes gives the level sizes"):
        tr.tree_plan({**tree.trl_kwargs(), "tree_sizes": good, "tree_level_sizes": other})


def _collate(rows: list[dict], negative: tuple) -> dict:
    """Rows padded to one length and stacked: ``negative`` fields with -1 (TRL 1.16), the rest with 0 (#7686)."""
    batch = {}
    for key in rows[0]:
        width = max(r[key].numel() for r in rows)
        pad = -1 if key in negative else 0
        batch[key] = torch.stack([torch.cat([r[key], torch.full((width - r[key].numel(),), pad, dtype=r[key].dtype)])
                                  for r in rows])
    return batch


def test_tree_kwargs_from_batch_reads_a_collated_7686_batch():
    """A collated #7686 batch (tree_sizes, tree_level_sizes and tree_n_chunks per row, no position_ids or
    tree_max_seqlens: tree_kwargs_from_batch builds the plan): every row's kwargs forward like TRL's own."""
    from tree_recurrence.integrations.trl import tree_kwargs_from_batch

    trees = [M.pack_forest("multiturn"), M.pack_forest("fan"), M.pack_forest("chain")]
    rows = [{**t.trl_kwargs(with_max=False), "tree_sizes": _sizes(t), "tree_level_sizes": _levels(t),
             "input_ids": t.input_ids[0]} for t in trees]
    batch = _collate(rows, ("tree_cu_seqlens_q", "tree_kv_index", "tree_cu_seqlens_k"))
    batch["tree_n_chunks"] = torch.tensor([1, 1, 1])  # fewer than the levels of rows 0 and 1: not a level count
    model = M.make_model(MODEL_TYPE)
    tr.install(model)
    try:
        for i, tree in enumerate(trees):
            kwargs = tree_kwargs_from_batch(batch, row=i)
            assert torch.equal(kwargs["tree_sizes"], _sizes(tree)) and torch.equal(kwargs["tree_level_sizes"], _levels(tree))
            assert kwargs["tree_n_chunks"] == 1
            assert torch.equal(kwargs["position_ids"], tree.position_ids)
            assert (kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"]) == tuple(tree.packed["tree_max_seqlens"].tolist())
            with torch.no_grad():
                expected = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False,
                                 **tree.trl_kwargs()).logits
                out = model(use_cache=False, **kwargs).logits
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    finally:
        tr.uninstall(model)
    bad = dict(batch, tree_sizes=batch["tree_sizes"].clone())
    bad["tree_sizes"][1, -1] = 3  # a level size after row 1's padding
    with pytest.raises(ValueError, match=r"tree_kwargs_from_batch: tree_sizes: row 1: malformed padding: .* \(entries "
                                         r"4\.\.\.\) is not the level sizes"):
        tree_kwargs_from_batch(bad, row=1)
    with pytest.raises(ValueError, match=r"tree_sizes: row 0: 3 entries, but its layout is \[max_q, max_k, n_kv"):
        tree_kwargs_from_batch(dict(batch, tree_sizes=batch["tree_sizes"][:, :3]), row=0)
    batch["tree_n_chunks"] = 4  # one for the batch
    assert tree_kwargs_from_batch(batch, row=2)["tree_n_chunks"] == 4
    batch["tree_n_chunks"] = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"tree_n_chunks has 2 entries, expected one per row \(3\) or one for the batch"):
        tree_kwargs_from_batch(batch, row=0)
    batch["tree_n_chunks"] = torch.tensor([1.5, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"tree_n_chunks: expected one non-negative integer"):
        tree_kwargs_from_batch(batch, row=0)


# ------------------------------------------------------------------------------------------------
# components on a row a collator padded past the plan
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["native", "torch"])
def test_tree_conv_on_a_row_padded_past_the_plan(route, monkeypatch):
    if route == "native" and components._family_with_kernel("tree_conv", torch.device("cpu")) is None:
        pytest.skip("no loaded family has a CPU tree_conv kernel in this build")
    if route == "torch":
        monkeypatch.setattr(components, "_family_with_kernel", lambda *args, **kwargs: None)
    tree = M.pack_forest("mixed")
    plan = tr.tree_plan(tree.trl_kwargs())
    n, channels, extra = plan.num_tokens, 6, 5
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, channels, n, generator=gen, dtype=torch.float64)
    padding = torch.randn(1, channels, extra, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    upstream = torch.randn(1, channels, n + extra, generator=gen, dtype=torch.float64)

    def run(inputs):
        xs, w, b = (t.clone().requires_grad_() for t in (inputs, weight, bias))
        y = components.tree_conv(xs, w, b, "silu", plan=plan)
        (y * upstream[..., : y.shape[2]]).sum().backward()
        return y.detach(), xs.grad, w.grad, b.grad

    y, gx, gw, gb = run(x)
    yp, gxp, gwp, gbp = run(torch.cat([x, padding], 2))
    assert yp.shape == (1, channels, n + extra)
    torch.testing.assert_close(yp[..., :n], y, rtol=0, atol=0)
    assert torch.count_nonzero(yp[..., n:]) == 0
    torch.testing.assert_close(gxp[..., :n], gx, rtol=0, atol=0)
    assert torch.count_nonzero(gxp[..., n:]) == 0
    torch.testing.assert_close(gwp, gw, rtol=0, atol=0)
    torch.testing.assert_close(gbp, gb, rtol=0, atol=0)
    # token-major, as short_convolution takes it
    yt = components.short_convolution(torch.cat([x, padding], 2).transpose(1, 2), weight, bias, "silu", plan=plan)
    torch.testing.assert_close(yt.transpose(1, 2), yp, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"tree_conv: x must be \(1, channels, {n}\) .* got \(1, {channels}, {n - 1}\)"):
        components.tree_conv(x[..., : n - 1], weight, bias, "silu", plan=plan)


@pytest.mark.parametrize("route", ["native", "fork", "rescan"])
def test_tree_scan_on_a_row_padded_past_the_plan(route):
    """GDN's scan seam over a padded row: the real tokens' outputs and gradients equal the unpadded call's (and
    every sample run alone), the padding gets zeros and zero gradients."""
    tree = M.pack_forest("mixed")
    plan = tr.tree_plan(tree.trl_kwargs())
    n, extra = plan.num_tokens, 5
    gen = torch.Generator().manual_seed(11)
    inputs = M.gdn_inputs(n, 2, 2, gen)
    padding = M.gdn_inputs(extra, 2, 2, gen)
    if route == "native":
        if not plugins.families()[GDN].has_kernel("gdn_tree_scan", "cpu"):
            pytest.skip("no CPU gdn_tree_scan in this build")
        options = {"family": GDN, "seam": SEAM, "backend": "native"}
    else:
        options = {"spec": plugins.families()[GDN].seams[SEAM], "policy": tr.Policy(strategy=route)}
    upstream = torch.randn(1, n + extra, 2, 8, generator=gen, dtype=torch.float64)

    def run(tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        driver.decisions.clear()
        out = components.tree_scan(stand_ins.stand_in(GDN, SEAM), *leaves, plan=plan, **options)
        out = out[0] if isinstance(out, tuple) else out
        (out * upstream[:, : out.shape[1]]).sum().backward()
        assert driver.decisions[-1][2] == route, driver.decisions
        return out.detach(), [t.grad for t in leaves]

    out, grads = run(inputs)
    outp, gradsp = run([torch.cat([a, b], 1) for a, b in zip(inputs, padding)])
    assert outp.shape == (1, n + extra, 2, 8)
    torch.testing.assert_close(outp[:, :n], out, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(outp[:, n:]) == 0
    for name, g, gp in zip(("q", "k", "v", "g", "beta"), grads, gradsp):
        torch.testing.assert_close(gp[:, :n], g, rtol=1e-12, atol=1e-12, msg=name)
        assert torch.count_nonzero(gp[:, n:]) == 0, f"{name}: the padding got a gradient"
    q, k, v, g, beta = inputs  # the oracle: every sample alone
    for pos in tree.sample_positions:
        o, _ = stand_ins.stand_in(GDN, SEAM)(q[:, pos], k[:, pos], v[:, pos], g[:, pos], beta[:, pos])
        torch.testing.assert_close(outp[:, pos], o, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=rf"expected batch 1 and {n} tokens"):
        components.tree_scan(stand_ins.stand_in(GDN, SEAM), *(t[:, : n - 1] for t in inputs), plan=plan, **options)
