"""chunk_state_pass: the inter-chunk state pass the chunked recurrent kernels (GDN, SSD) share.

Checked against an independent oracle: a plain float64 loop over the chunks in segment order,
each segment starting from its parent's final state (written with torch ops, so autograd gives the
reference gradients). Random tries: deep chains (20 levels), wide (64 children), forests, 1-chunk
segments; per-root and shared initial states; w None. Plus the plan's ChunkTables,
torch.library.opcheck on both ops, and readable errors on bad input. CUDA cases (skipped without a
GPU) check the CUDA kernels against the CPU op and the oracle.
"""

from __future__ import annotations

import random

import pytest
import torch

import tree_recurrence as tr
from tree_recurrence import plugins

plugins.families()  # loads the shared ops library (torch.ops.tree_recurrence), then the family plugins
FAMILY_NAMESPACES = ["tree_recurrence_gated_delta_net", "tree_recurrence_mamba2", "tree_recurrence_short_conv"]
OPS = plugins.shared_ops()
OP, BACKWARD = OPS.chunk_state_pass, OPS.chunk_state_pass_backward
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# tries, inputs and the oracle
# ------------------------------------------------------------------------------------------------


def make_plan(lengths, parents):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    return tr.tree_plan({"tree_cu_seqlens_q": cu, "tree_segment_parents": torch.tensor(parents, dtype=torch.int64)})


def random_trie(kind, chunk, seed):
    rng = random.Random(seed)
    if kind == "deep":  # a 20-level chain with a few side branches
        parents = [-1] + list(range(19)) + [rng.randrange(19) for _ in range(5)]
    elif kind == "wide":  # one root, 64 children
        parents = [-1] + [0] * 64
    elif kind == "forest":
        parents = []
        for s in range(14):
            parents.append(-1 if s == 0 or rng.random() < 0.25 else rng.randrange(s))
    else:
        raise ValueError(kind)
    if kind == "wide":
        lengths = [rng.randint(1, chunk) for _ in parents]  # every segment one chunk
        lengths[0] = 3 * chunk + 1
    else:
        lengths = [rng.choice([1, chunk - 1, chunk, chunk + 1, rng.randint(1, 3 * chunk)]) for _ in parents]
    return make_plan(lengths, parents)


def make_inputs(tables, heads, k_dim, v_dim, chunk, dtype, seed, with_w=True, h0=None, roots=None):
    gen = torch.Generator().manual_seed(seed)
    nc = tables.num_chunks
    valid = (tables.gather.cpu() >= 0).to(torch.float64)[:, None, :, None]  # padded rows are zero

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    # Small enough that decay*I - kd^T w stays a contraction (no blow-up over long chains).
    scale = 0.6 / (chunk**0.5 + k_dim**0.5)
    w = rand(nc, heads, chunk, k_dim, scale=scale) * valid if with_w else None
    u = rand(nc, heads, chunk, v_dim) * valid
    kd = rand(nc, heads, chunk, k_dim, scale=scale) * valid
    decay = 0.3 + 0.7 * torch.rand(nc, heads, generator=gen, dtype=torch.float64)
    init = None
    if h0 == "shared":
        init = rand(heads, k_dim, v_dim)
    elif h0 == "per_root":
        init = rand(roots, heads, k_dim, v_dim)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(w), cast(u), cast(kd), decay.to(torch.float64 if dtype == torch.float64 else torch.float32), cast(init)


def oracle(w, u, kd, decay, h0, tables):
    """(h, v_new) by a float64 loop over chunks in segment order (parents come first)."""
    off = tables.seg_chunk_offsets.tolist()
    parents = tables.parents.tolist()
    root_index = tables.root_index.tolist()
    nc, heads, _, v_dim = u.shape
    k_dim = kd.shape[-1]
    final = [None] * len(parents)
    hs, vns = [None] * nc, [None] * nc
    for s, parent in enumerate(parents):
        if parent >= 0:
            state = final[parent]
        elif h0 is None:
            state = torch.zeros(heads, k_dim, v_dim, dtype=torch.float64)
        elif h0.dim() == 3:
            state = h0
        else:
            state = h0[root_index[s]]
        for c in range(off[s], off[s + 1]):
            hs[c] = state
            vn = u[c] if w is None else u[c] - w[c] @ state
            vns[c] = vn
            state = decay[c][:, None, None] * state + kd[c].transpose(-1, -2) @ vn
        final[s] = state
    return torch.stack(hs), torch.stack(vns)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def grads_of(fn, inputs, gh, gv):
    h, vn = fn(*inputs)
    loss = (h.double() * gh).sum() + (vn.double() * gv).sum()
    present = [t for t in inputs if t is not None]
    got = torch.autograd.grad(loss, present)
    it = iter(got)
    return h, vn, [None if t is None else next(it) for t in inputs]


def assert_close(actual, expected, rtol, what):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error {err:.3g} (relative to max |expected| {scale:.3g}) > {rtol}"


CASES = [
    ("deep", "per_root", True),
    ("deep", None, False),
    ("wide", "shared", True),
    ("wide", "per_root", False),
    ("forest", "shared", False),
    ("forest", "per_root", True),
    ("forest", None, True),
]


def run_case(kind, h0_kind, with_w, dtype, device, seed, chunk=4, heads=2, k_dim=3, v_dim=5):
    plan = random_trie(kind, chunk, seed)
    tables = plan.chunk_tables(chunk, device)
    roots = tables.level_offsets[1]
    state = torch.float64 if dtype == torch.float64 else torch.float32
    exact = make_inputs(tables, heads, k_dim, v_dim, chunk, torch.float64, seed, with_w, h0_kind, roots)
    # The op's inputs, and the oracle's: the same values (rounded to the op's dtypes) in float64.
    moved = [None if t is None else t.to(state if i == 3 else dtype) for i, t in enumerate(exact)]
    inputs64 = [None if t is None else t.double() for t in moved]
    gen = torch.Generator().manual_seed(seed + 1)
    gh = torch.randn(tables.num_chunks, heads, k_dim, v_dim, generator=gen, dtype=torch.float64)
    gv = torch.randn(tables.num_chunks, heads, chunk, v_dim, generator=gen, dtype=torch.float64)
    cpu_tables = plan.chunk_tables(chunk, "cpu")
    h_ref, vn_ref, g_ref = grads_of(lambda *a: oracle(*a, cpu_tables), leaves(*inputs64), gh, gv)

    def op(w, u, kd, decay, h0):
        return OP(w, u, kd, decay, h0, *tables.state_args())

    moved = [None if t is None else t.to(device) for t in moved]
    h, vn, g = grads_of(op, leaves(*moved), gh.to(device), gv.to(device))
    return (h, vn, g), (h_ref, vn_ref, g_ref)


NAMES = ["w", "u", "kd", "decay", "initial_state"]


def check_against_oracle(result, reference, rtol, dtype):
    (h, vn, g), (h_ref, vn_ref, g_ref) = result, reference
    state = torch.float64 if dtype == torch.float64 else torch.float32
    assert h.dtype == state and vn.dtype == dtype
    assert_close(h, h_ref, rtol, "h")
    assert_close(vn, vn_ref, rtol, "v_new")
    for name, a, b in zip(NAMES, g, g_ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, rtol, f"grad {name}")


# ------------------------------------------------------------------------------------------------
# CPU against the oracle
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,h0_kind,with_w", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_float64_matches_oracle(kind, h0_kind, with_w, seed):
    result, reference = run_case(kind, h0_kind, with_w, torch.float64, "cpu", seed)
    check_against_oracle(result, reference, 1e-12, torch.float64)


@pytest.mark.parametrize("kind,h0_kind,with_w", CASES[:3])
def test_cpu_float32_matches_oracle(kind, h0_kind, with_w):
    result, reference = run_case(kind, h0_kind, with_w, torch.float32, "cpu", 3)
    check_against_oracle(result, reference, 1e-5, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_types_widen(dtype):
    result, reference = run_case("forest", "per_root", True, dtype, "cpu", 4)
    check_against_oracle(result, reference, 2e-2, dtype)


def test_larger_dims_and_full_chunks():
    result, reference = run_case("forest", "shared", True, torch.float64, "cpu", 5, chunk=16, heads=3, k_dim=8, v_dim=12)
    check_against_oracle(result, reference, 1e-12, torch.float64)


def test_the_op_is_registered_once_in_the_shared_namespace():
    """One op, torch.ops.tree_recurrence.chunk_state_pass (libtree_recurrence_ops.so): no family registers a copy
    in its own namespace, and the families that run on it still list their scans as running (kernel_list.h finds
    the shared op)."""
    for name in ("chunk_state_pass", "chunk_state_pass_backward", "tree_conv", "tree_conv_backward"):
        assert torch._C._jit_get_schemas_for_operator(f"tree_recurrence::{name}"), name
        for ns in FAMILY_NAMESPACES:
            assert not torch._C._jit_get_schemas_for_operator(f"{ns}::{name}"), f"{ns}::{name}"
    for family, scan in (("gated_delta_net", "gdn_tree_scan"), ("mamba2", "ssd_tree_scan")):
        if family in plugins.families():
            assert plugins.families()[family].has_kernel(scan, "cpu"), family
    plan = random_trie("forest", 4, 7)
    tables = plan.chunk_tables(4, "cpu")
    inputs = make_inputs(tables, 2, 3, 5, 4, torch.float64, 7, True, "shared", None)
    a = OP(*inputs, *tables.state_args())
    b = torch.ops.tree_recurrence.chunk_state_pass.default(*inputs, *tables.state_args())
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_deterministic_and_gradient_of_shared_state_is_sum_over_roots():
    plan = make_plan([5, 3, 9, 2], [-1, -1, 0, 1])
    tables = plan.chunk_tables(4, "cpu")
    w, u, kd, decay, _ = make_inputs(tables, 2, 3, 5, 4, torch.float64, 8, True, None, None)
    h0 = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    h0_roots = h0.detach().expand(2, 2, 3, 5).clone().requires_grad_(True)
    out_shared = OP(w, u, kd, decay, h0, *tables.state_args())
    out_roots = OP(w, u, kd, decay, h0_roots, *tables.state_args())
    for x, y in zip(out_shared, out_roots):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    gh = torch.randn_like(out_shared[0])
    (g_shared,) = torch.autograd.grad((out_shared[0] * gh).sum(), h0)
    (g_roots,) = torch.autograd.grad((out_roots[0] * gh).sum(), h0_roots)
    torch.testing.assert_close(g_shared, g_roots.sum(0), rtol=1e-12, atol=1e-12)
    assert g_roots[0].abs().sum() > 0 and g_roots[1].abs().sum() > 0
    again = torch.autograd.grad((OP(w, u, kd, decay, h0, *tables.state_args())[0] * gh).sum(), h0)[0]
    assert torch.equal(again, g_shared)


def test_unused_output_gradient():
    plan = random_trie("forest", 4, 9)
    tables = plan.chunk_tables(4, "cpu")
    w, u, kd, decay, h0 = leaves(*make_inputs(tables, 2, 3, 5, 4, torch.float64, 9, True, "shared", None))
    h, _ = OP(w, u, kd, decay, h0, *tables.state_args())
    h.sum().backward()
    w2, u2, kd2, decay2, h02 = leaves(w, u, kd, decay, h0)
    oracle(w2, u2, kd2, decay2, h02, tables)[0].sum().backward()
    for a, b, name in zip((w, u, kd, decay, h0), (w2, u2, kd2, decay2, h02), NAMES):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-11, msg=name)


# ------------------------------------------------------------------------------------------------
# ChunkTables
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunk_tables(chunk):
    lengths, parents = [7, 1, 4, 9, 3, 12], [-1, 0, 0, -1, 3, 1]
    plan = make_plan(lengths, parents)
    t = plan.chunk_tables(chunk, "cpu")
    assert plan.chunk_tables(chunk, "cpu") is t  # cached
    n = sum(lengths)
    counts = [(length + chunk - 1) // chunk for length in lengths]
    assert t.num_chunks == sum(counts) and t.gather.shape == (sum(counts), chunk)
    assert t.seg_chunk_offsets.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
    assert t.gather.reshape(-1)[t.scatter].tolist() == list(range(n))
    assert int((t.gather >= 0).sum()) == n
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    for s in range(len(lengths)):  # each chunk lies inside its segment, tokens in order
        rows = t.gather[t.seg_chunk_offsets[s] : t.seg_chunk_offsets[s + 1]]
        tokens = rows[rows >= 0].tolist()
        assert tokens == list(range(starts[s], starts[s + 1]))
        for row in rows.tolist():  # padding only at the end of a segment's last chunk
            valid = [x for x in row if x >= 0]
            assert row[: len(valid)] == valid
    assert t.parents.tolist() == parents
    assert t.root_index.tolist() == [0, -1, -1, 1, -1, -1]
    assert t.level_offsets == [0, 2, 5, 6] and isinstance(t.level_offsets, list)
    assert t.level_segments.tolist() == [0, 3, 1, 2, 4, 5]
    assert t.child_offsets.tolist() == [0, 2, 3, 3, 4, 4, 4] and t.children.tolist() == [1, 2, 5, 4]
    assert t.state_args()[4] is t.level_offsets and len(t.state_args()) == 7


# ------------------------------------------------------------------------------------------------
# opcheck and errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_w,h0_kind", [(True, "per_root"), (False, None), (True, "shared")])
def test_opcheck(with_w, h0_kind):
    plan = random_trie("forest", 4, 11)
    tables = plan.chunk_tables(4, "cpu")
    inputs = leaves(*make_inputs(tables, 2, 3, 5, 4, torch.float32, 11, with_w, h0_kind, tables.level_offsets[1]))
    torch.library.opcheck(OP, (*inputs, *tables.state_args()))
    h, vn = OP(*[None if t is None else t.detach() for t in inputs], *tables.state_args())
    w, _, kd, decay, h0 = [None if t is None else t.detach() for t in inputs]
    bargs = (torch.randn_like(h), torch.randn_like(vn), w, kd, decay, h, vn, h0, *tables.state_args())
    torch.library.opcheck(BACKWARD, bargs)
    torch.library.opcheck(BACKWARD, (None, torch.randn_like(vn), *bargs[2:]))


def good_args():
    plan = make_plan([5, 3, 9], [-1, 0, 0])
    tables = plan.chunk_tables(4, "cpu")
    w, u, kd, decay, h0 = make_inputs(tables, 2, 3, 5, 4, torch.float32, 12, True, "shared", None)
    return [w, u, kd, decay, h0, *tables.state_args()]


def with_arg(i, value):
    args = good_args()
    args[i] = value
    return args


@pytest.mark.parametrize("make,error,pattern", [
    (lambda a: with_arg(1, a[1][..., 0]), ValueError, r"u must be \(chunks, heads, chunk_len, V\)"),
    (lambda a: with_arg(2, a[2][:, :1]), ValueError, r"kd must be \(chunks=\d+, heads=2"),
    (lambda a: with_arg(0, a[0][..., :2]), ValueError, r"w must be .* like kd"),
    (lambda a: with_arg(0, a[0].double()), TypeError, r"w has dtype .* but u has"),
    (lambda a: with_arg(3, a[3][:, :1]), ValueError, r"decay must be \(chunks="),
    (lambda a: with_arg(3, a[3].half()), TypeError, r"decay has dtype"),
    (lambda a: with_arg(1, a[1].long()), TypeError, r"u has dtype"),
    (lambda a: with_arg(4, a[4][None].expand(3, -1, -1, -1)), ValueError, r"initial_state must be \(heads=2, K=3, V=5\) or \(roots=1"),
    (lambda a: with_arg(5, a[5].int()), TypeError, r"seg_chunk_offsets must be int64"),
    (lambda a: with_arg(6, a[6][:2]), ValueError, r"root_index must have segments = 2|seg_chunk_offsets must have segments\+1"),
    (lambda a: with_arg(9, [0, 1, 2]), ValueError, r"level_offsets must run from 0 to the number of segments 3"),
    (lambda a: with_arg(5, torch.tensor([0, 2, 2, a[5][-1]])), ValueError, r"seg_chunk_offsets\[2\] = 2: every segment needs at least one chunk"),
    (lambda a: with_arg(6, torch.tensor([-1, 0, 1])), ValueError, r"segment 2 is at level 1 in level_segments but its parent 1"),
    (lambda a: with_arg(6, torch.tensor([-1, 2, 0])), ValueError, r"parents\[1\] = 2, expected -1 or an earlier segment"),
    (lambda a: with_arg(7, torch.tensor([1, -1, -1])), ValueError, r"root_index\[0\] = 1 for a root, expected \[0, 1\)"),
    (lambda a: with_arg(11, torch.tensor([1, 1])), ValueError, r"children\[1\] = 1 is listed twice"),
    (lambda a: with_arg(10, torch.tensor([0, 1, 2, 2])), ValueError, r"child_offsets\[3\] = 2|children\[1\] = 2 is not a child of segment 1"),
])
def test_errors_are_readable(make, error, pattern):
    args = make(good_args())
    with pytest.raises(error, match=pattern):
        OP(*args)


# ------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): against the CPU op and the oracle
# ------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("kind,h0_kind,with_w", CASES)
def test_cuda_float64_matches_oracle(kind, h0_kind, with_w):
    result, reference = run_case(kind, h0_kind, with_w, torch.float64, "cuda", 21)
    check_against_oracle(result, reference, 1e-12, torch.float64)


@cuda
@pytest.mark.parametrize("kind,h0_kind,with_w", CASES)
@pytest.mark.parametrize("dims", [(4, 2, 3, 5), (64, 2, 128, 128), (64, 1, 64, 64), (32, 2, 100, 70), (16, 1, 256, 40)])
def test_cuda_float32_matches_oracle(kind, h0_kind, with_w, dims):
    chunk, heads, k_dim, v_dim = dims
    result, reference = run_case(kind, h0_kind, with_w, torch.float32, "cuda", 22, chunk, heads, k_dim, v_dim)
    check_against_oracle(result, reference, 1e-5, torch.float32)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_types(dtype):
    result, reference = run_case("forest", "per_root", True, dtype, "cuda", 23, 64, 2, 128, 128)
    check_against_oracle(result, reference, 2e-2, dtype)


@cuda
def test_cuda_matches_cpu_op_float32_bitwise_deterministic():
    plan = random_trie("deep", 64, 24)
    t_cpu, t_gpu = plan.chunk_tables(64, "cpu"), plan.chunk_tables(64, "cuda")
    inputs = make_inputs(t_cpu, 4, 128, 128, 64, torch.float32, 24, True, "shared", None)
    a = OP(*inputs, *t_cpu.state_args())
    b1 = OP(*[x.cuda() for x in inputs], *t_gpu.state_args())
    b2 = OP(*[x.cuda() for x in inputs], *t_gpu.state_args())
    for x, y, z in zip(a, b1, b2):
        assert torch.equal(y, z)
        assert_close(y, x, 1e-5, "cuda vs cpu")


@cuda
def test_cuda_opcheck():
    plan = random_trie("forest", 4, 25)
    tables = plan.chunk_tables(4, "cuda")
    inputs = make_inputs(tables, 2, 3, 5, 4, torch.float32, 25, True, "per_root", tables.level_offsets[1])
    inputs = leaves(*[t.cuda() for t in inputs])
    torch.library.opcheck(OP, (*inputs, *tables.state_args()))


@cuda
def test_cuda_tables_on_the_host_are_refused():
    args = good_args()
    args = [a.cuda() if isinstance(a, torch.Tensor) and i < 5 else a for i, a in enumerate(args)]
    with pytest.raises(ValueError, match=r"seg_chunk_offsets is on cpu but u is on cuda"):
        OP(*args)
