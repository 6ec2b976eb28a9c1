"""torch.ops.tree_recurrence.tree_conv (the shared ops library, registered once for every family): the causal depthwise conv over a trie.

Checked on CPU against an independent reference: every sample's root-to-leaf path run through
``torch.nn.functional.conv1d`` on its own (the path positions come from TRL's packing, not from
the plan), outputs and gradients; plus torch.library.opcheck and float64 gradcheck.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models as M
import tree_recurrence as tr
from tree_recurrence import plugins

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

plugins.families()  # loads the shared ops library (torch.ops.tree_recurrence), then the family plugins
OP = plugins.shared_ops().tree_conv
CHANNELS = 5


@pytest.fixture(scope="module")
def trees():
    return {name: M.pack_forest(name) for name in ("tiny", "mixed", "chain")}


def tables(tree, width):
    return tr.tree_plan(tree.trl_kwargs()).conv_tables(width)


def inputs(tree, width, dtype, bias, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tree.num_tokens, CHANNELS, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(CHANNELS, width, generator=gen, dtype=torch.float64) / width).to(dtype)
    b = torch.randn(CHANNELS, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    if requires_grad:
        for t in (x, w, b):
            if t is not None:
                t.requires_grad_(True)
    return x, w, b


def per_path_reference(tree, x, w, b, silu):
    """y (N, C): each token's output from a plain causal conv1d over the path of a sample through it
    (the first such sample; every path through a token agrees on its history)."""
    width = w.shape[1]
    y = [None] * tree.num_tokens
    for pos in tree.sample_positions:
        xp = x[pos].transpose(0, 1)[None]  # (1, C, L)
        out = F.conv1d(F.pad(xp, (width - 1, 0)), w[:, None, :], b, groups=x.shape[1])[0].transpose(0, 1)
        if silu:
            out = F.silu(out)
        for i, t in enumerate(pos.tolist()):
            if y[t] is None:
                y[t] = out[i]
    assert all(v is not None for v in y)
    return torch.stack(y)


# ------------------------------------------------------------------------------------------------
# the plan's tables
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("forest", ["tiny", "mixed", "chain"])
def test_conv_tables_match_the_paths(forest, width, trees):
    tree = trees[forest]
    ancestors, reader_offsets, readers = tables(tree, width)
    assert ancestors.shape == (tree.num_tokens, width - 1) and ancestors.dtype == torch.int64
    rows = {}
    for pos in tree.sample_positions:
        for i, t in enumerate(pos.tolist()):
            row = [int(pos[i - j]) if i - j >= 0 else -1 for j in range(1, width)]
            assert rows.setdefault(t, row) == row  # every path through a token shares its history
    assert sorted(rows) == list(range(tree.num_tokens))
    expected = torch.tensor([rows[t] for t in range(tree.num_tokens)], dtype=torch.long).reshape(tree.num_tokens, width - 1)
    assert torch.equal(ancestors, expected)
    # reverse table: readers of u are the flat entries t*(W-1)+(j-1) with ancestors[t, j-1] == u, in order
    flat = ancestors.reshape(-1)
    assert reader_offsets.numel() == tree.num_tokens + 1 and int(reader_offsets[0]) == 0
    for u in range(tree.num_tokens):
        assert readers[reader_offsets[u]:reader_offsets[u + 1]].tolist() == torch.nonzero(flat == u).flatten().tolist()


# ------------------------------------------------------------------------------------------------
# forward and backward against per-path conv1d
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_per_path_conv1d(width, dtype, bias, silu, trees):
    tree = trees["mixed"]
    x, w, b = inputs(tree, width, dtype, bias, requires_grad=True)
    y = OP(x, w, b, *tables(tree, width), silu)
    assert y.dtype == dtype and y.shape == x.shape
    xr, wr, br = (t.detach().double().requires_grad_(True) if t is not None else None for t in (x, w, b))
    ref = per_path_reference(tree, xr, wr, br, silu)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.double(), ref.detach(), **tol)
    # gradients of a weighted sum of every token's output
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y.double() * gy).sum().backward()
    (ref * gy).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    # grad_weight / grad_bias are accumulated in float64 on CPU but returned through an fp32
    # buffer for every dtype (kernels/tree_conv.h), hence the fp32-level tolerance in float64 too
    wtol = dict(rtol=1e-6, atol=1e-6 * float(wr.grad.abs().max()))
    torch.testing.assert_close(w.grad.double(), wr.grad, **(wtol if dtype == torch.float64 else tol))
    if bias:
        torch.testing.assert_close(b.grad.double(), br.grad, **(wtol if dtype == torch.float64 else tol))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_round_once(dtype, trees):
    """CPU computes half types in fp32 and rounds the result once."""
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, dtype, True)
    anc = tables(tree, 4)
    y = OP(x, w, b, *anc, True)
    assert y.dtype == dtype
    assert torch.equal(y, OP(x.float(), w.float(), b.float(), *anc, True).to(dtype))


@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gradcheck_float64(bias, silu, trees):
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, torch.float64, bias, requires_grad=True)
    anc = tables(tree, 4)
    args = (x, w, b) if bias else (x, w)
    fn = (lambda x, w, b: OP(x, w, b, *anc, silu)) if bias else (lambda x, w: OP(x, w, None, *anc, silu))
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------

EAGER_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_opcheck(dtype, bias, silu, trees):
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, dtype, bias, requires_grad=True)
    for args in ((x, w, b, *tables(tree, 4), silu), (x.detach(), w.detach(), b, *tables(tree, 4), silu)):
        result = torch.library.opcheck(OP, args, test_utils=EAGER_CHECKS)
        assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_aot_dispatch(trees):
    """torch.compile / AOTAutograd must be able to trace the op's backward. It cannot: the autograd
    kernel (sdk tree_conv_op.h, TreeConvFunction::backward) calls the CPU/CUDA backward directly on
    raw data pointers instead of through a registered op, so under fake tensors it fails with
    'Cannot access data pointer of Tensor'."""
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, torch.float32, True, requires_grad=True)
    result = torch.library.opcheck(OP, (x, w, b, *tables(tree, 4), True),
                                   test_utils=("test_aot_dispatch_static", "test_aot_dispatch_dynamic"))
    assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def test_bad_input_errors(trees):
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, torch.float32, True)
    anc, ro, rd = tables(tree, 4)
    with pytest.raises(ValueError, match="ancestors must be"):
        OP(x, w, b, anc[:, :2], ro, rd, False)
    with pytest.raises(ValueError, match="weight must be"):
        OP(x, w[:-1], b, anc, ro, rd, False)
    with pytest.raises(ValueError, match="bias must be"):
        OP(x, w, b[:-1], anc, ro, rd, False)
    with pytest.raises(TypeError, match="int64"):
        OP(x, w, b, anc.int(), ro, rd, False)
    bad = anc.clone()
    bad[3, 0] = tree.num_tokens  # outside the row
    with pytest.raises(ValueError):
        OP(x, w, b, bad, ro, rd, False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_float_input_is_refused(dtype, trees):
    """The op is defined for float32/float64/bfloat16/float16 (tree_conv_op.h kernel_dtype, and the
    CUDA path refuses anything else). The CPU path widens any x to fp32 before the dtype check and
    casts the result back, so integer input silently returns a truncated integer conv."""
    tree = trees["tiny"]
    x, w, b = inputs(tree, 4, torch.float32, True)
    with pytest.raises(TypeError, match="dtype"):
        OP((x * 3).to(dtype), w, b, *tables(tree, 4), False)
