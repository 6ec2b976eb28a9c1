"""The chunked Mamba2 SSD tree scan (op ``ssd_tree_scan``) against its float64 token-by-token oracle
(op ``ssd_token_scan``): outputs and the gradients of x, dt, A (hence A_log), B, C, D, dt_bias, z
and the initial states, on tries with segments of 1 token, around the chunk size and long, deep and
wide, grouped and ungrouped B/C, D per head and per channel, dt_limit clamping active, strong decays.

fp32 runs are judged by the relative error max|got - want| / max|want| of every tensor (<= 1e-5);
the oracle runs on float64 copies of the same inputs. A CUDA class (skipped without a GPU) checks
the same on the device, an 8k-token segment included.
"""

from __future__ import annotations

import pytest
import torch
import tries

from tree_recurrence import plugins

FAMILY = "mamba2"
CHUNK = 64


def _ops():
    return plugins.ops(FAMILY)


def chunk_tables(seg_offsets, parents, chunk=CHUNK, device="cpu") -> dict:
    """The chunk tables (TreePlan.chunk_tables' contract, tries.py's loop) as a mapping by name."""
    return tries.chunk_tables(seg_offsets, parents, chunk, device)._asdict()


# ------------------------------------------------------------------------------------------------
# inputs, the oracle, the comparison
# ------------------------------------------------------------------------------------------------


def make_inputs(T, H=4, P=6, G=2, N=5, dtype=torch.float32, device="cpu", seed=0, roots=1, D_per_channel=False,
                strong=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = dict(x=r(T, H, P), dt=r(T, H), B=r(T, G, N), C=r(T, G, N), z=r(T, H, P),
               D=r(H, P) if D_per_channel else r(H), dt_bias=r(H) * 0.5, h0=r(roots, H, P, N))
    # A is fp32 in the models whatever their dtype (float64 in the float64 test)
    ins["A"] = -(torch.rand(H, generator=g, dtype=torch.float64) * (40.0 if strong else 2.0) + 0.1)
    if strong:
        ins["dt"] = ins["dt"].abs() * 10 + 5
    return {k: v.to(device=device, dtype=dtype if k != "A" or dtype == torch.float64 else torch.float32).requires_grad_() for k, v in ins.items()}


def run_chunked(ins, seg_offsets, parents, dt_limit=(0.0, float("inf")), use=("D", "dt_bias", "z", "h0"), chunk=CHUNK):
    tabs = chunk_tables(seg_offsets, parents, chunk, ins["x"].device)
    return _ops().ssd_tree_scan(
        ins["x"], ins["dt"], ins["B"], ins["C"], tabs["gather"], tabs["scatter"], tabs["seg_chunk_offsets"], tabs["parents"],
        tabs["root_index"], tabs["level_segments"], tabs["level_offsets"], tabs["child_offsets"], tabs["children"],
        ins["h0"] if "h0" in use else None, A=ins["A"], dt_limit=list(dt_limit), D=ins["D"] if "D" in use else None,
        dt_bias=ins["dt_bias"] if "dt_bias" in use else None, dt_softplus=True, z=ins["z"] if "z" in use else None)


def run_oracle(ins, seg_offsets, parents, dt_limit=(0.0, float("inf")), use=("D", "dt_bias", "z", "h0")):
    return _ops().ssd_token_scan(
        ins["x"], ins["dt"], ins["B"], ins["C"], torch.as_tensor(seg_offsets), torch.as_tensor(parents),
        ins["h0"] if "h0" in use else None, A=ins["A"], dt_limit=list(dt_limit), D=ins["D"] if "D" in use else None,
        dt_bias=ins["dt_bias"] if "dt_bias" in use else None, dt_softplus=True, z=ins["z"] if "z" in use else None)


def as_oracle(ins):
    return {k: v.detach().cpu().double().requires_grad_() for k, v in ins.items()}


def rel(got, want, floor=1e-30):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max()) / max(float(want.abs().max()), floor)


def check(seg_offsets, parents, tol=1e-5, dt_limit=(0.0, float("inf")), use=("D", "dt_bias", "z", "h0"),
          dtype=torch.float32, device="cpu", floor=1e-30, **kw):
    seg_offsets, parents = list(seg_offsets), list(parents)
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], dtype=dtype, device=device, roots=roots, **kw)
    ref = as_oracle(ins)
    y = run_chunked(ins, seg_offsets, parents, dt_limit, use)
    want = run_oracle(ref, seg_offsets, parents, dt_limit, use)
    # fp32 (float64 for float64 x); the fused CUDA path (bf16 / fp16 on CUDA) returns x's dtype
    fused_dtype = dtype if device != "cpu" and dtype in (torch.bfloat16, torch.float16) else torch.float32
    assert y.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) or y.dtype == fused_dtype
    assert torch.isfinite(y).all()
    assert rel(y, want) <= tol, ("y", rel(y, want))
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C"] + [n for n in ("D", "dt_bias", "z") if n in use] + (["h0"] if "h0" in use else [])
    got_g = torch.autograd.grad((y * w.to(y.device, y.dtype)).sum(), [ins[n] for n in names])
    want_g = torch.autograd.grad((want * w).sum(), [ref[n] for n in names])
    errors = {n: rel(a, b, floor) for n, a, b in zip(names, got_g, want_g)}
    for n, a in zip(names, got_g):
        assert torch.isfinite(a).all(), n
    assert all(e <= tol for e in errors.values()), errors
    return y, want, errors


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------

# segments of 1, 63, 64, 65 tokens and a 130-token one in a branching trie with two roots
MIXED = ([0, 1, 64, 128, 193, 194, 324, 389], [-1, 0, 1, 0, -1, 4, 4])


def test_mixed_trie_fp32_matches_the_float64_oracle():
    check(*MIXED)


def test_groups_one_and_per_channel_D_and_dt_limit_clamping():
    _, _, errors = check(*MIXED, G=1, D_per_channel=True, dt_limit=(0.2, 0.9))
    assert errors["dt_bias"] >= 0  # every gradient compared (dt_limit clamps most of dt here)


def test_without_optional_inputs():
    check(*MIXED, use=())


def test_deep_trie():
    # a chain of 12 segments of 5..40 tokens, each the child of the previous
    lengths = [5, 17, 40, 1, 33, 8, 2, 29, 11, 64, 3, 21]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    check(offsets, [-1] + list(range(len(lengths) - 1)), G=4, H=4)


def test_wide_trie():
    # one 70-token prompt with 12 completions of 1..60 tokens, and a second root with 3 children
    lengths = [70] + [1 + 5 * i for i in range(12)] + [9, 64, 65, 1]
    parents = [-1] + [0] * 12 + [-1, 13, 13, 13]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    check(offsets, parents)


def test_long_segment():
    check([0, 2048, 2100], [-1, 0], H=2, P=4, G=1, N=4)


def test_strong_decays_do_not_nan():
    # dt * A down to -600 per token: every decay across a token underflows (fp32, and float64 near
    # it), so A's gradient is ~1e-19 in float64 and 0 or denormal in fp32: judged against 1, not
    # against its own vanishing size.
    check(*MIXED, strong=True, floor=1.0)


def test_float64_is_exact():
    check(*MIXED, dtype=torch.float64, tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    # one rounding of every input (2^-8 / 2^-11 relative) apart from the float64 oracle on the same values
    check(*MIXED, dtype=dtype, tol=2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_shared_initial_state_and_chunk_sizes():
    ins = make_inputs(MIXED[0][-1], roots=1)
    shared = dict(ins, h0=ins["h0"][0])
    y64 = run_chunked(shared, *MIXED)
    for chunk in (1, 7, 32):
        assert rel(run_chunked(shared, *MIXED, chunk=chunk), y64) <= 1e-5, chunk
    # (1, H, P, N) is shared by every root, as (H, P, N) is
    torch.testing.assert_close(run_chunked(ins, *MIXED), y64, atol=0, rtol=0)
    want = run_oracle(as_oracle(shared), *MIXED)
    assert rel(y64, want) <= 1e-5


def test_errors_name_the_argument():
    ins = make_inputs(10)
    off, par = [0, 10], [-1]
    tabs = chunk_tables(off, par)
    base = [ins["x"], ins["dt"], ins["B"], ins["C"], tabs["gather"], tabs["scatter"], tabs["seg_chunk_offsets"],
            tabs["parents"], tabs["root_index"], tabs["level_segments"], tabs["level_offsets"], tabs["child_offsets"],
            tabs["children"], None]
    op = _ops().ssd_tree_scan
    with pytest.raises(ValueError, match="dt must be"):
        op(*([ins["x"], ins["dt"][:, :2]] + base[2:]), A=ins["A"], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="multiple of groups"):
        op(*([ins["x"][:, :3], ins["dt"][:, :3]] + base[2:]), A=ins["A"][:3], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="scatter"):
        op(*(base[:5] + [tabs["scatter"][:5]] + base[6:]), A=ins["A"], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="gather"):
        op(*(base[:4] + [tabs["gather"].int()] + base[5:]), A=ins["A"], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="initial_state"):
        op(*(base[:13] + [torch.zeros(2, 2, 6, 5)]), A=ins["A"], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="dt_limit"):
        op(*base, A=ins["A"], dt_limit=[1.0, 0.0])
    with pytest.raises(ValueError, match="D must be"):
        op(*base, A=ins["A"], dt_limit=[0.0, 1.0], D=torch.zeros(3))


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestCuda:
    def test_mixed_trie(self):
        check(*MIXED, device="cuda", tol=1e-5)

    def test_wide_and_grouped(self):
        lengths = [70] + [1 + 5 * i for i in range(12)]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        check(offsets, [-1] + [0] * 12, device="cuda", H=8, P=64, G=2, N=64)

    def test_8k_segment(self):
        check([0, 8192, 8192 + 100], [-1, 0], device="cuda", H=2, P=16, G=1, N=16)

    def test_bf16(self):
        check(*MIXED, device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_these_tables_are_the_plans():
    """The tables these tests build are TreePlan.chunk_tables' (what the seam passes), field by field."""
    from tree_recurrence._tree_kwargs import tree_plan

    offsets, parents = MIXED
    plan = tree_plan({"tree_cu_seqlens_q": torch.tensor(offsets, dtype=torch.int32),
                      "tree_segment_parents": torch.tensor(parents, dtype=torch.int32)})
    for chunk in (1, 7, CHUNK):
        got, want = plan.chunk_tables(chunk, "cpu"), chunk_tables(offsets, parents, chunk)
        for name, value in want.items():
            assert (list(getattr(got, name)) if name == "level_offsets" else getattr(got, name).tolist()) == \
                (value if name == "level_offsets" else value.tolist()), (chunk, name)
