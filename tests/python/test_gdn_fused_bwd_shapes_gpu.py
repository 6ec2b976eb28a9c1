"""GPU tests of the fused GDN backward on harder inputs, through the test-only op
``gdn_fused_backward_stages`` (cases and helpers: gdn_fused_bwd_cases.py; the main stage, gradient and
memory tests: test_gdn_fused_bwd_gpu.py).

* test_extreme_gates: Qwen3.5-like extreme decays (log-gates -8..-26 per token; 1-token, 63/64/65-token
  segments, a tree, K = V = 32 and 128): the gate-gradient cancellation. Stage (b)'s dG against its
  float64 twin fed the kernel's own in-type q^, k^ (sharp: 2e-3; FLA's identity misses this by orders),
  dg / dA_log-like sums against the float64 emulation of the kernels' bf16 roundings
  (test_gdn_bwd_gate_grad.emulate_backward), and the final gradients against float64 autograd.
* test_stage_against_twin_more_shapes: stages (b) and (c) on GRPO-like dims, fp16, one or a partial
  second state half, four value heads per key head (dq^ summed per key head inside (b)).

Run: .venv/bin/python -m pytest tests/python/test_gdn_fused_bwd_shapes_gpu.py -q -x -s
"""

from __future__ import annotations

import pytest
import torch

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref
from gdn_fused_bwd_cases import (CASES, NAMES, STAGE_TOL, TOL, build_case, c64, dq_like, report, run_stages, setup_case,
                                 stage_b_rows, stage_c_rows, twin_inputs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from test_gdn_chunked import rel_rms


# ---- extreme decays (the gate-gradient cancellation; tests/python/test_gdn_bwd_gate_grad.py is the CPU twin)

EXTREME = {
    "x_one_token": dict(spec="one_token", mode="qwen"),
    "x_seg63": dict(spec="seg63", mode="qwen"),
    "x_seg64": dict(spec="seg64", mode="qwen"),
    "x_seg65": dict(spec="seg65", mode="qwen"),
    "x_tree": dict(spec="tree", mode="qwen"),
    "x_tree_uniform": dict(spec="tree", mode="uniform"),
    "x_tree_128": dict(spec="tree", mode="qwen", HK=1, HV=2, K=128, V=128),
}


def setup_extreme(name, dtype=torch.bfloat16):
    import test_gdn_bwd_gate_grad as gg
    cfg = dict(EXTREME[name])
    spec = gg.SPECS[cfg.pop("spec")]
    x64, seg_offsets, parents = gg.extreme_inputs(spec, cfg.pop("mode"), dtype=dtype, **cfg)
    return build_case(x64, x64, seg_offsets, parents, "none", True, dtype, dtype=dtype)


def kernel_rows(x, r, scale, HV, gather, dtype):
    """q^ / k^ exactly as the kernels' scale_rows forms them (in-type of fp32 x * fp32 row scale), chunk-major
    per value head, float64."""
    T, HK, K = x.shape
    s = r.float().cpu() * torch.tensor(scale, dtype=torch.float32)
    y = (x.float() * s.unsqueeze(-1)).to(dtype).double()
    return fref._chunks(y.repeat_interleave(HV // HK, dim=1), gather)


@pytest.mark.parametrize("name", sorted(EXTREME))
def test_extreme_gates(name):
    import test_gdn_bwd_gate_grad as gg
    case = setup_extreme(name)
    got = run_stages(case)
    x = case["x64"]
    tabs = case["tabs_cpu"]
    inp = bref.inputs(x["grad"], x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, 0.0, True)
    G = c64(case["saved"]["G"])
    sv = {n: c64(t) for n, t in case["saved"].items()}
    HV = x["v"].shape[1]
    qk = kernel_rows(x["q"], sv["rq"], inp["scale"], HV, tabs[0], case["dtype"])
    kk = kernel_rows(x["k"], sv["rk"], 1.0, HV, tabs[0], case["dtype"])
    rows = []
    # (b) fed its own inputs (in-type q^, k^ as the kernel rounds them): only fp32 arithmetic is left
    want = bref.stage_b(qk, kk, G, inp["dOc"], sv["h"], sv["v_new"], c64(got["grad_state_out"]), inp["valid"])
    rows += [("b", "dq_hv", rel_rms(got["dq_hv"], dq_like(want["dq_hv"], got["dq_hv"])), STAGE_TOL),
             ("b", "dk_b", rel_rms(got["dk_b"], want["dk_b"]), STAGE_TOL),
             ("b", "dG_b", rel_rms(got["dG_b"], want["dG_b"]), 2e-3)]
    want_c = bref.stage_c(kk, inp["vc"], inp["bc"], G, sv["Ainv"], sv["w"], sv["h"], c64(got["dv_total"]),
                          c64(got["dk_b"]), c64(got["dG_b"]))
    scatter = tabs[1]
    rows += [("c", "dG", rel_rms(got["dG"], want_c["dG"]), STAGE_TOL),
             ("c", "dbeta", rel_rms(got["dbeta"], bref._tokens(want_c["dbeta_c"], scatter)), STAGE_TOL),
             ("c", "dv", rel_rms(got["dv"], bref._tokens(want_c["dv_c"], scatter)), STAGE_TOL)]
    # against the float64 emulation of the kernels' roundings (same bf16 storage, exact arithmetic)
    emu = gg.emulate_backward(x, tabs, dt=torch.float64, round_to=case["dtype"])
    oracle = gg.oracle_dg(x, case["seg_offsets"], case["parents"])
    g = x["g"]
    gA, eA, wA = gg.dA_log(g, c64(got["dg"])), gg.dA_log(g, emu["dg"]), gg.dA_log(g, oracle["g"])
    per_head = lambda a, b: ((a - b).abs() / b.abs()).max().item()  # noqa: E731
    rows += [("emu", "dg", rel_rms(got["dg"], emu["dg"]), 1e-2),
             ("emu", "dA_log-like", per_head(gA, eA), 1e-2)]
    # final gradients against float64 autograd; dg / dA_log: at least the bf16-storage floor (the
    # emulation's own distance to autograd) times 1.25
    floor_dg, floor_dA = rel_rms(emu["dg"], oracle["g"]), per_head(eA, wA)
    print(f"  (info) bf16-storage floor vs autograd: dg {floor_dg:.2e}, dA_log-like {floor_dA:.2e}")
    rows += [("final", f"d{n}", rel_rms(got[f"d{n}"], oracle[n]), TOL) for n in ("q", "k", "v", "beta")]
    rows += [("final", "dg", rel_rms(got["dg"], oracle["g"]), max(TOL, 1.25 * floor_dg)),
             ("final", "dA_log-like", per_head(gA, wA), max(TOL, 1.25 * floor_dA))]
    bad = report(name, rows)
    assert not bad, f"{name}: extreme-gate gradients over tolerance: {bad}"


# ---- wy_bwd.cu (c) and dqk_bwd.cu (b) on more shapes: GRPO-like dims (K = V = 128, grouped heads, fp16 too), one
# state half, a partial second state half, four value heads per key head: each case's stage b or c against its
# float64 twin, fed the GPU's own outputs of the stages before, and two runs bit for bit equal.

WY_CASES = {
    # GRPO-like dims (K = V = 128, grouped heads, a prompt with completions, chunk boundaries mid-segment)
    "wy_grpo_like": dict(spec=[(-1, 150), (0, 60), (0, 60), (0, 70), (0, 45)], h0="none", K=128, V=128, HK=2, HV=4),
    "wy_grpo_like_fp16": dict(spec=[(-1, 150), (0, 60), (0, 60), (0, 70), (0, 45)], h0="shared", K=128, V=128, HK=2,
                              HV=4, dtype=torch.float16),
    "wy_strong": dict(CASES["strong"]),
    "wy_pad": dict(CASES["grouped_no_l2"]),
    "wy_one_token": dict(CASES["one_token"]),
}

DQK_CASES = {
    "dqk_grpo_like": dict(WY_CASES["wy_grpo_like"]),
    "dqk_grpo_like_fp16": dict(WY_CASES["wy_grpo_like_fp16"]),
    "dqk_strong": dict(CASES["strong"]),
    "dqk_pad": dict(CASES["grouped_no_l2"]),   # K = 24, V = 40: one state half, padded columns
    "dqk_k64": dict(CASES["around_chunk"]),    # K = V = 64: one full state half
    "dqk_one_token": dict(CASES["one_token"]),
    "dqk_k96": dict(spec=[(-1, 100), (0, 30), (0, 70)], h0="shared", K=96, V=72, HK=1, HV=2),  # a partial 2nd half
    # four value heads per key head: (b) sums their dq^ in one CTA
    "dqk_hv4_hk1": dict(spec=[(-1, 100), (0, 70), (0, 30)], h0="per_root", K=64, V=64, HK=1, HV=4),
}


@pytest.mark.parametrize("table,name", [("wy", n) for n in WY_CASES] + [("dqk", n) for n in DQK_CASES])
def test_stage_against_twin_more_shapes(table, name):
    case = setup_case(**(WY_CASES if table == "wy" else DQK_CASES)[name])
    got, again = run_stages(case), run_stages(case)
    got = {n: t.cpu() for n, t in got.items()}
    bad = [f"{n} differs between two runs" for n in NAMES if not torch.equal(again[n].cpu(), got[n])]
    inp, sv = twin_inputs(case)
    rows = stage_c_rows(got, inp, sv, case["tabs_cpu"][1])[0] if table == "wy" else stage_b_rows(got, inp, sv)
    bad += report(name, rows)
    assert not bad, f"{name}: {bad}"
