"""GPU tests of the fused GDN backward kernels (issue 19; plugins/gated_delta_net/csrc/gdn_fused/
gdn_fused_bwd.cpp, kernels/*_bwd.cu), through the test-only op ``gdn_fused_backward_stages``, which
runs the backward from GIVEN saved buffers (here: the float64 forward reference of
tests/python/gdn_chunk_reference.py rounded like the kernels store them), so these tests hold
whatever the forward kernels do.

* test_stages: every stage against its float64 twin (tests/python/gdn_bwd_reference.py) fed with the
  GPU's own outputs of the previous stage, so one run tells which kernel and which quantity is off.
  Prints the relative RMS of every quantity.
* test_final_gradients: dq, dk, dv, dg, dbeta, d_initial_state (and dA_log, ddt_bias when g comes
  from them as in Qwen3.5) against float64 autograd through the token oracle gdn_token_scan.
  bf16: relative RMS <= 2e-2 for every gradient.
* test_extreme_gates: Qwen3.5-like extreme decays (log-gates -8..-26 per token; 1-token, 63/64/65-token
  segments, a tree, K = V = 32 and 128): the gate-gradient cancellation fix. Stage (b)'s dG against its
  float64 twin fed the kernel's own in-type q^, k^ (sharp: 2e-3; FLA's identity misses this by orders),
  dg / dA_log-like sums against the float64 emulation of the kernels' bf16 roundings
  (test_gdn_bwd_gate_grad.emulate_backward), and the final gradients against float64 autograd.
* test_bitwise_deterministic: two runs give identical bits.
* test_through_the_op: gdn_tree_scan's autograd on CUDA bf16 (fused forward + fused backward) vs the
  oracle: the integration with the forward engineer's saved buffers.
* the memory-lean backward (gdn_fused_bwd.cpp's switches TREE_RECURRENCE_GDN_BWD_DQ_SUM: dq^ summed per
  key head inside (b); TREE_RECURRENCE_GDN_BWD_DV_INPLACE: dv_total over dv_local;
  TREE_RECURRENCE_GDN_BWD_DO_TOKENS: the state pass and (b) read dO at the tokens; all on by default, the
  stages op's `mode` picks either path per call): test_stages / test_final_gradients /
  test_bitwise_deterministic run the old (mode 0) and the new (mode 7) path; test_lean_paths_bitwise_equal:
  every mode gives the old path's bits (dq_hv: its ordered group sum); test_retain_graph_double_backward:
  a retain_graph=True backward keeps the saved buffers (the second backward gives the same bits), a third
  one raises; test_backward_peak_memory: the backward's peak equals the live-buffer timeline of
  gdn_fused_bwd.cpp (_predicted_backward_peak), in process and, for the old path and the memory trace
  (TREE_RECURRENCE_GDN_MEMTRACE=1), in subprocesses.

Run: .venv/bin/python -m pytest tests/python/test_gdn_fused_bwd_gpu.py -q -x -s
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from test_gdn_chunked import chunk_tables, make_inputs, rand_spec, rel_rms, run_oracle, trie
    from tree_recurrence import plugins

FAMILY = "gated_delta_net"
TOL = 2e-2  # bf16, every gradient (FLA's dbeta / dg tolerance; issue 19 item 4)
STAGE_TOL = 2e-2

NAMES = ["dv_local", "q_g", "do_c", "grad_state_out", "dv_total", "d_root", "dq_hv", "dk_b", "dG_b", "dk_hv", "dG", "dv",
         "dbeta", "dg", "dq", "dk", "d_initial_state"]

CASES = {
    "one_token": dict(spec=[(-1, 1), (0, 1), (1, 1), (1, 1), (0, 1), (4, 3)], h0="shared", K=16, V=16, HK=1, HV=2),
    "around_chunk": dict(spec=[(-1, 63), (0, 64), (0, 65), (1, 1), (2, 64)], h0="per_root", K=64, V=64, HK=1, HV=2),
    "deep": dict(spec="deep", h0="shared", K=16, V=16, HK=1, HV=2),
    "wide": dict(spec="wide", h0="shared", K=16, V=16, HK=1, HV=2),
    "grouped_l2": dict(spec=[(-1, 70), (0, 40), (0, 90), (2, 5)], h0="shared", K=128, V=128, HK=1, HV=2),
    # K, V multiples of 8 but not of 16: the kernels' zero-padded tiles
    "grouped_no_l2": dict(spec=[(-1, 70), (0, 40), (0, 90), (2, 5)], h0="none", K=24, V=40, HK=2, HV=4, l2norm=False),
    "strong": dict(spec=[(-1, 130), (0, 65), (0, 64), (1, 63)], h0="per_root", K=128, V=128, HK=1, HV=1, strong=True),
    "forest": dict(spec=[(-1, 30), (-1, 64), (0, 20), (-1, 1), (1, 70), (1, 3)], h0="per_root", K=16, V=16, HK=1, HV=2),
    "long_8k": dict(spec=[(-1, 8192), (0, 100)], h0="shared", K=128, V=128, HK=1, HV=1),
}


def _spec(spec):
    if isinstance(spec, str):
        return rand_spec(random.Random(spec), spec)
    return spec


def _init(ins, h0):
    return None if h0 == "none" else (ins["h0"][0] if h0 == "shared" else ins["h0"])


def setup_case(spec, h0="none", l2norm=True, strong=False, seed=0, dtype=torch.bfloat16, **dims):
    """bf16 inputs on the GPU, their float64 copies, and the saved buffers (float64 forward
    reference of the rounded inputs, stored like the kernels store them)."""
    seg_offsets, parents = trie(_spec(spec))
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], roots=roots, strong=strong, l2norm=l2norm, seed=seed, **dims)
    # the inputs as the kernels see them (q, k, v, grad in bf16; g, beta fp32), in float64
    x64 = {n: (t.to(dtype) if n in ("q", "k", "v", "grad") else t.float()).double() for n, t in ins.items()}
    return build_case(ins, x64, seg_offsets, parents, h0, l2norm, dtype)


def build_case(ins, x64, seg_offsets, parents, h0, l2norm, in_dtype, **extra):
    """A case from its inputs (ins; x64: as the kernels see them, in float64): the chunk tables, the device inputs and
    the saved buffers (the float64 forward reference of x64, stored like the kernels store them)."""
    tabs_cpu = chunk_tables(seg_offsets, parents, 64, "cpu")
    tabs = chunk_tables(seg_offsets, parents, 64, "cuda")
    fwd = fref.stages(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], tabs_cpu, _init(x64, h0), 0.0, l2norm,
                      round_to=in_dtype)
    dev = {n: (t.to(in_dtype) if n in ("q", "k", "v", "grad") else t.float()).cuda() for n, t in ins.items()}
    saved = dict(G=fwd["G"].float().cuda(), Ainv=fwd["Ainv"].to(in_dtype).cuda(), w=fwd["w"].to(in_dtype).cuda(),
                 kd=fwd["kd"].to(in_dtype).cuda(), h=fwd["h"].to(in_dtype).cuda(),
                 v_new=fwd["v_new"].to(in_dtype).cuda(), rq=fwd["rq"].float().cuda(), rk=fwd["rk"].float().cuda())
    return dict(seg_offsets=seg_offsets, parents=parents, ins=ins, x64=x64, dev=dev, tabs=tabs, tabs_cpu=tabs_cpu,
                fwd=fwd, saved=saved, h0=h0, l2norm=l2norm, **extra)


_CACHE = {}


def cached_case(name):
    """setup_case of a named case, built once per process (the float64 forward reference is the slow part)."""
    if name not in _CACHE:
        _CACHE[name] = setup_case(**CASES[name])
    return _CACHE[name]


def cached_oracle(name):
    case = cached_case(name)
    if "oracle" not in case:
        case["oracle"] = oracle_grads(case)
    return case["oracle"]


MODES = [0, 7]  # the stages op's mode: 0 the previous backward path, 7 the memory-lean one (dq^ summed, dv in place,
#                 dO read at the tokens)


def run_stages(case, mode=-1):
    """The stages op on a case; mode -1 the backward's switches (default: the lean path), else bit 0 dq^
    summed per key head in (b), bit 1 dv_total written over dv_local, bit 2 dO read at the tokens (no do_c)."""
    ops = plugins.ops(FAMILY)
    if not hasattr(ops, "gdn_fused_backward_stages"):
        pytest.skip("this build has no gdn_fused_backward_stages op")
    d, s = case["dev"], case["saved"]
    out = ops.gdn_fused_backward_stages(d["grad"], d["q"], d["k"], d["v"], d["g"], d["beta"], *case["tabs"],
                                        _init(d, case["h0"]), 0.0, case["l2norm"], s["G"], s["Ainv"], s["w"], s["kd"],
                                        s["h"], s["v_new"], s["rq"], s["rk"], mode)
    torch.cuda.synchronize()
    return dict(zip(NAMES, out))


def dq_like(want_dq_hv, got_dq):
    """The twin's per-value-head dq^ as the kernel returned it: summed over each key head's value heads
    when the stages op's dq_hv has HK heads (the lean path)."""
    NC, HV, C, K = want_dq_hv.shape
    HK = got_dq.shape[1]
    return want_dq_hv if HK == HV else want_dq_hv.reshape(NC, HK, HV // HK, C, K).sum(2)


def dq_per_value_head(dq, HV):
    """The stages op's dq_hv as (NC, HV, C, K) for stage_d (which sums the value heads of each key head):
    the lean path's per-key-head sum in each key head's first value head, zeros elsewhere."""
    NC, HK, C, K = dq.shape
    if HK == HV:
        return dq
    out = torch.zeros(NC, HK, HV // HK, C, K, dtype=dq.dtype)
    out[:, :, 0] = dq
    return out.reshape(NC, HV, C, K)


def group_sum_in_order(dq_hv, HK):
    """fp32 sum of each key head's value heads, from 0, in increasing order (the lean kernel's order)."""
    NC, HV, C, K = dq_hv.shape
    x = dq_hv.reshape(NC, HK, HV // HK, C, K)
    acc = torch.zeros_like(x[:, :, 0])
    for gi in range(HV // HK):
        acc = acc + x[:, :, gi]
    return acc


def c64(t):
    return t.detach().double().cpu()


def report(case_name, rows):
    print(f"\n[{case_name}]")
    bad = []
    for stage, name, err, tol in rows:
        flag = "" if err <= tol else "   <-- over tolerance"
        print(f"  {stage:>8} {name:>16}: rel RMS {err:.3e} (tol {tol:.0e}){flag}")
        if not err <= tol:
            bad.append(f"{stage}/{name} {err:.3e}")
    return bad


def _twin_inputs(case):
    """The float64 twins' chunk-major inputs and saved buffers of a case."""
    x = case["x64"]
    inp = bref.inputs(x["grad"], x["q"], x["k"], x["v"], x["g"], x["beta"], case["tabs_cpu"], 0.0, case["l2norm"])
    return inp, {n: c64(t) for n, t in case["saved"].items()}


def _stage_b_rows(got, inp, sv):
    """Stage (b) against its float64 twin fed the GPU's do_c and grad_state_out."""
    want = bref.stage_b(inp["qc"], inp["kc"], sv["G"], c64(got["do_c"]), sv["h"], sv["v_new"],
                        c64(got["grad_state_out"]), inp["valid"])
    want["dq_hv"] = dq_like(want["dq_hv"], got["dq_hv"])
    return [("b", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("dq_hv", "dk_b", "dG_b")]


def _stage_c_rows(got, inp, sv, scatter):
    """Stage (c) against its float64 twin fed the GPU's dv_total, dk_b, dG_b; and the twin's outputs."""
    want = bref.stage_c(inp["kc"], inp["vc"], inp["bc"], sv["G"], sv["Ainv"], sv["w"], sv["h"], c64(got["dv_total"]),
                        c64(got["dk_b"]), c64(got["dG_b"]))
    rows = [("c", "dk_hv", rel_rms(got["dk_hv"], want["dk_hv"]), STAGE_TOL),
            ("c", "dG", rel_rms(got["dG"], want["dG"]), STAGE_TOL),
            ("c", "dv", rel_rms(got["dv"], bref._tokens(want["dv_c"], scatter)), STAGE_TOL),
            ("c", "dbeta", rel_rms(got["dbeta"], bref._tokens(want["dbeta_c"], scatter)), STAGE_TOL)]
    return rows, want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_stages(name, mode):
    case = cached_case(name)
    got = run_stages(case, mode)
    x = case["x64"]
    inp, sv = _twin_inputs(case)
    G = sv["G"]
    rows = []

    want = bref.stage_a(inp["qc"], inp["kc"], G, inp["dOc"])
    rows += [("a", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("dv_local", "q_g")]
    rows.append(("a", "do_c", rel_rms(got["do_c"], inp["dOc"]), 1e-6))

    init64 = _init(x, case["h0"])
    want = bref.stage_pass(c64(got["dv_local"]), c64(got["q_g"]), c64(got["do_c"]), sv["w"], sv["kd"], G, case["tabs_cpu"],
                           init64)
    rows += [("pass", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("grad_state_out", "dv_total", "d_root")]

    rows += _stage_b_rows(got, inp, sv)

    scatter = case["tabs_cpu"][1]
    c_rows, want = _stage_c_rows(got, inp, sv, scatter)
    rows += c_rows

    HV = x["v"].shape[1]
    want = bref.stage_d(dq_per_value_head(c64(got["dq_hv"]), HV), c64(got["dk_hv"]), c64(got["dG"]), want["dv_c"],
                        want["dbeta_c"], scatter, inp)
    # dq, dk are stored in the inputs' type (bf16: rounding alone is ~1e-3 relative RMS); dg fp32
    rows += [("d", n, rel_rms(got[n], want[n]), 5e-3) for n in ("dq", "dk")]
    rows.append(("d", "dg", rel_rms(got["dg"], want["dg"]), 1e-4))
    if case["h0"] != "none":
        d_root = c64(got["d_root"])
        want_init = d_root.sum(0) if case["h0"] == "shared" else d_root
        rows.append(("d", "d_initial_state", rel_rms(got["d_initial_state"], want_init), 1e-5))
    bad = report(name, rows)
    assert not bad, f"{name}: stages over tolerance: {bad}"


def oracle_grads(case, g_from_params=None):
    """float64 autograd through gdn_token_scan on the rounded inputs."""
    x = {n: t.clone().requires_grad_(n != "grad") for n, t in case["x64"].items()}
    params = None
    if g_from_params is not None:
        params = {n: t.double().clone().requires_grad_(True) for n, t in g_from_params.items()}
        x["g"] = qwen_gate(params)
    out = run_oracle(x, case["seg_offsets"], case["parents"], h0=case["h0"], l2norm=case["l2norm"])
    names = ["q", "k", "v", "beta"] + (["h0"] if case["h0"] != "none" else [])
    leaves = [x[n] for n in names]
    if params is None:
        names.append("g")
        leaves.append(x["g"])
    else:
        names += list(params)
        leaves += list(params.values())
    grads = torch.autograd.grad((out * x["grad"]).sum(), leaves)
    return dict(zip(names, grads))


def qwen_gate(p):
    """Qwen3.5's gate: g = -exp(A_log) * softplus(a + dt_bias)."""
    return -torch.exp(p["A_log"]) * torch.nn.functional.softplus(p["a"] + p["dt_bias"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_final_gradients(name, mode):
    case = cached_case(name)
    got = run_stages(case, mode)
    want = cached_oracle(name)
    rows = [("final", f"d{n}", rel_rms(got[f"d{n}"], want[n]), TOL) for n in ("q", "k", "v", "g", "beta")]
    if case["h0"] != "none":
        w0 = want["h0"][0] if case["h0"] == "shared" else want["h0"]
        rows.append(("final", "d_initial_state", rel_rms(got["d_initial_state"], w0), TOL))
    bad = report(name, rows)
    assert not bad, f"{name}: gradients over tolerance: {bad}"


@pytest.mark.parametrize("name", ["strong", "grouped_l2"])
def test_gate_parameter_gradients(name):
    """dA_log, ddt_bias (and d a) when g = -exp(A_log) softplus(a + dt_bias), A up to 16."""
    cfg = dict(CASES[name])
    case = setup_case(**cfg)
    T, HV = case["ins"]["g"].shape
    gen = torch.Generator().manual_seed(7)
    params = dict(A_log=torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) * 15 + 1),
                  dt_bias=torch.randn(HV, generator=gen, dtype=torch.float64),
                  a=torch.randn(T, HV, generator=gen, dtype=torch.float64))
    g = qwen_gate(params).float()
    case["ins"]["g"] = g.double()
    case["x64"]["g"] = g.double()
    case["dev"]["g"] = g.cuda()
    x = case["x64"]
    fwd = fref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], case["tabs_cpu"], _init(x, case["h0"]), 0.0,
                      case["l2norm"], round_to=torch.bfloat16)
    case["saved"].update(G=fwd["G"].float().cuda(), Ainv=fwd["Ainv"].to(torch.bfloat16).cuda(),
                         w=fwd["w"].to(torch.bfloat16).cuda(), kd=fwd["kd"].to(torch.bfloat16).cuda(),
                         h=fwd["h"].to(torch.bfloat16).cuda(), v_new=fwd["v_new"].to(torch.bfloat16).cuda())
    got = run_stages(case)
    # the kernel's dg through the gate (fp32, as the model computes g in fp32)
    p32 = {n: t.float().cuda().requires_grad_(True) for n, t in params.items()}
    got_p = dict(zip(p32, torch.autograd.grad(qwen_gate(p32), list(p32.values()), got["dg"])))
    want = oracle_grads(case, g_from_params=params)
    rows = [("gate", f"d{n}", rel_rms(got_p[n], want[n]), TOL) for n in params]
    bad = report(name + "/gate", rows)
    assert not bad, f"{name}: gate-parameter gradients over tolerance: {bad}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["around_chunk", "wide", "grouped_l2", "grouped_no_l2"])
def test_bitwise_deterministic(name, mode):
    case = cached_case(name)
    a, b = run_stages(case, mode), run_stages(case, mode)
    diff = [n for n in NAMES if not torch.equal(a[n], b[n])]
    assert not diff, f"{name}: two runs differ in {diff}"


@pytest.mark.parametrize("name", ["around_chunk", "deep", "grouped_l2", "strong"])
def test_through_the_op(name):
    """gdn_tree_scan autograd on CUDA bf16: the fused forward's saved buffers into the fused backward."""
    case = cached_case(name)
    ops = plugins.ops(FAMILY)
    d = {n: t.clone().requires_grad_(n != "grad") for n, t in case["dev"].items()}
    init = _init(d, case["h0"])
    o = ops.gdn_tree_scan(d["q"], d["k"], d["v"], d["g"], d["beta"], *case["tabs"], init, 0.0, case["l2norm"])
    names = ["q", "k", "v", "g", "beta"] + (["h0"] if case["h0"] != "none" else [])
    grads = torch.autograd.grad((o.float() * d["grad"].float()).sum(), [d[n] for n in names])
    want = cached_oracle(name)
    rows = []
    for n, gr in zip(names, grads):
        w = want[n]
        if n == "h0" and case["h0"] == "shared":
            w = w[0]
            gr = gr if gr.dim() == 3 else gr[0]
        rows.append(("op", f"d{n}", rel_rms(gr, w), TOL))
    bad = report(name + "/op", rows)
    assert not bad, f"{name}: gdn_tree_scan gradients over tolerance: {bad}"


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
    want = bref.stage_b(qk, kk, G, c64(got["do_c"]), sv["h"], sv["v_new"], c64(got["grad_state_out"]), inp["valid"])
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
# state half, a partial second state half. (Their previous versions, wy v1 and dqk v1, were compared here until
# they were deleted; what stays is each case's stages b and c against the float64 twins, fed the GPU's own
# outputs of the stages before, and two runs bit for bit equal.)

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
}


@pytest.mark.parametrize("table,name", [("wy", n) for n in WY_CASES] + [("dqk", n) for n in DQK_CASES])
def test_stage_against_twin_more_shapes(table, name):
    case = setup_case(**(WY_CASES if table == "wy" else DQK_CASES)[name])
    got, again = run_stages(case), run_stages(case)
    got = {n: t.cpu() for n, t in got.items()}
    bad = [f"{n} differs between two runs" for n in NAMES if not torch.equal(again[n].cpu(), got[n])]
    inp, sv = _twin_inputs(case)
    rows = _stage_c_rows(got, inp, sv, case["tabs_cpu"][1])[0] if table == "wy" else _stage_b_rows(got, inp, sv)
    bad += report(name, rows)
    assert not bad, f"{name}: {bad}"


# ---- the memory-lean backward (gdn_fused_bwd.cpp's switches; kernels/dqk_bwd.cu's per-key-head dq^ sum)

LEAN_CASES = {
    "lean_grouped_l2": dict(CASES["grouped_l2"]),        # HV = 2 HK, K = V = 128
    "lean_grouped_no_l2": dict(CASES["grouped_no_l2"]),  # HV = 2 HK, padded K, V
    "lean_grpo_like": dict(WY_CASES["wy_grpo_like"]),    # HV = 2 HK, GRPO dims
    "lean_grpo_like_fp16": dict(WY_CASES["wy_grpo_like_fp16"]),
    "lean_hv4_hk1": dict(spec=[(-1, 100), (0, 70), (0, 30)], h0="per_root", K=64, V=64, HK=1, HV=4),  # 4 value heads
    "lean_strong_hv_eq_hk": dict(CASES["strong"]),       # HV = HK
    "lean_one_token": dict(CASES["one_token"]),
}


@pytest.mark.parametrize("name", sorted(LEAN_CASES))
def test_lean_paths_bitwise_equal(name):
    """Every mode (dq^ summed in (b) or not, dv_total in place or not, dO at the tokens or chunk-major) gives
    the previous path's bits: the
    dqk kernel runs the same per-head work and sums dq^ in the finalize stage's order; dv_total in place
    over dv_local changes no arithmetic. dq_hv of the summing modes: the previous one's ordered group sum."""
    case = setup_case(**LEAN_CASES[name])
    HK = case["dev"]["q"].shape[1]
    ref = run_stages(case, 0)
    for mode in range(1, 8):
        got = run_stages(case, mode)
        diff = []
        for n in NAMES:
            want = group_sum_in_order(ref[n], HK) if (n == "dq_hv" and mode & 1) else ref[n]
            if not (got[n].shape == want.shape and torch.equal(got[n], want)):
                diff.append(n)
        assert not diff, f"{name}: mode {mode} differs from mode 0 in {diff}"


@pytest.mark.parametrize("name", ["grouped_l2", "strong", "around_chunk"])
def test_retain_graph_double_backward(name):
    """retain_graph=True keeps the stage buffers (the lean backward frees them only when the graph is not
    kept): a second backward through the graph gives the first one's bits; after a backward without
    retain_graph, another one raises instead of reading freed buffers."""
    case = cached_case(name)
    ops = plugins.ops(FAMILY)
    d = {n: t.clone().requires_grad_(n != "grad") for n, t in case["dev"].items()}
    o = ops.gdn_tree_scan(d["q"], d["k"], d["v"], d["g"], d["beta"], *case["tabs"], _init(d, case["h0"]), 0.0,
                          case["l2norm"])
    leaves = [d[n] for n in ("q", "k", "v", "g", "beta")]
    g1 = torch.autograd.grad(o, leaves, d["grad"], retain_graph=True)
    g2 = torch.autograd.grad(o, leaves, d["grad"])  # the last one: frees the buffers as it goes
    for n, a, b in zip("q k v g beta".split(), g1, g2):
        assert torch.equal(a, b), f"{name}: d{n} of the second backward differs from the first"
    want = cached_oracle(name)
    rows = [("op", f"d{n}", rel_rms(a, want[n]), TOL) for n, a in zip("q k v g beta".split(), g1)]
    bad = report(name + "/retain_graph", rows)
    assert not bad, f"{name}: gradients over tolerance: {bad}"
    with pytest.raises(RuntimeError, match="second time|saved buffer"):
        torch.autograd.grad(o, leaves, d["grad"])


def _predicted_backward_peak(T, S, R, NC, HK, HV, K, V, dq_sum, dv_inplace, do_tokens, beta_cast=True):
    """Bytes above what is allocated when the backward starts (o and the saved buffers included there), at
    the peak of the fused backward's live-buffer timeline (gdn_fused_bwd.cpp's run, ScanFunction handing
    the saved buffers over): per stage the transients alive at its launch minus the saved buffers already
    released (w, kd after the state pass; Ainv, h, v_new after (c)). In-type 2 bytes. do_tokens: no
    chunk-major do_c (the state pass and (b) read the caller's grad_o)."""
    C, bf, f = 64, 2, 4
    cv, ck, kv = NC * HV * C * V * bf, NC * HV * C * K * bf, NC * HV * K * V * bf
    cc, chf = NC * HV * C * C * bf, NC * HV * C * f
    d_root, ws = R * HV * K * V * f, S * HV * K * V * f
    beta32 = T * HV * f if beta_cast else 0
    decay = NC * HV * f
    dq, dk = NC * (HK if dq_sum else HV) * C * K * f, NC * HV * C * K * f
    tok = T * HV * V * bf + 2 * T * HV * f  # dv, dbeta, dg
    do_c = 0 if do_tokens else cv
    stages = {
        "state pass": beta32 + decay + cv + ck + do_c + kv + (0 if dv_inplace else cv) + d_root + ws,
        "(b) dq/dk": beta32 + do_c + cv + kv + d_root + dq + dk + chf - 2 * ck,
        "(c) WY": beta32 + cv + d_root + dq + dk + chf + tok - 2 * ck,
        "(d) finalize": beta32 + d_root + dq + dk + chf + tok + 2 * T * HK * K * bf - 2 * ck - (cc + kv + cv),
    }
    return max(stages.values()), stages


PEAK_SPECS = {
    "flat": dict(spec=[(-1, 65536)], HK=4, HV=8),
    "tree": dict(spec=[(-1, 32768), (0, 16384), (0, 8192), (0, 8192)], HK=4, HV=8),
    "hv_eq_hk": dict(spec=[(-1, 32768), (0, 16384), (0, 16384)], HK=8, HV=8),
}


def _measure_backward_peak(name):
    """Forward, then the backward's peak above the allocation when it starts (bytes), and the prediction
    for the switches in this process's environment."""
    import os
    cfg = PEAK_SPECS[name]
    seg_offsets, parents = trie(cfg["spec"])
    T, HK, HV, K, V = seg_offsets[-1], cfg["HK"], cfg["HV"], 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen, device="cuda", dtype=dt)  # noqa: E731
    x = dict(q=r(T, HK, K), k=r(T, HK, K), v=r(T, HV, V),
             g=-torch.nn.functional.softplus(r(T, HV, dt=torch.float32) - 1.0),
             beta=torch.sigmoid(r(T, HV, dt=torch.float32)).to(torch.bfloat16))
    grad = r(T, HV, V)
    tabs = chunk_tables(seg_offsets, parents, 64, "cuda")
    leaves = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    op = plugins.ops(FAMILY).gdn_tree_scan
    o = op(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, None, 0.0, True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(o, leaves, grad)
    torch.cuda.synchronize()
    got = torch.cuda.max_memory_allocated() - base
    on = lambda v: os.environ.get(v) != "0"  # noqa: E731
    NC, S = tabs[0].shape[0], len(parents)
    R = sum(p < 0 for p in parents)
    want, stages = _predicted_backward_peak(T, S, R, NC, HK, HV, K, V, on("TREE_RECURRENCE_GDN_BWD_DQ_SUM"),
                                            on("TREE_RECURRENCE_GDN_BWD_DV_INPLACE"),
                                            on("TREE_RECURRENCE_GDN_BWD_DO_TOKENS"))
    return dict(got=got, want=want, stages=stages)


PEAK_SLACK = 24 << 20  # the caching allocator's rounding (a block keeps an unsplit remainder under 1 MiB)


def _check_peak(m, label):
    print(f"\n[{label}] backward peak {m['got'] / 2**20:.1f} MiB, predicted {m['want'] / 2**20:.1f} MiB "
          f"(stages: {', '.join(f'{k} {v / 2**20:.1f}' for k, v in m['stages'].items())})")
    assert abs(m["got"] - m["want"]) <= PEAK_SLACK, f"{label}: peak {m['got']} bytes, predicted {m['want']}"


@pytest.mark.parametrize("name", sorted(PEAK_SPECS))
def test_backward_peak_memory(name):
    """The backward's peak (torch.cuda.max_memory_allocated) is the live-buffer timeline's (in process: the
    switches of this environment, by default the lean path)."""
    _check_peak(_measure_backward_peak(name), name)


@pytest.mark.parametrize("env", ["lean", "previous"])
def test_backward_peak_memory_subprocess(env):
    """The same in a fresh process per switch setting (the switches are read once): the lean path and the
    previous one (TREE_RECURRENCE_GDN_BWD_DQ_SUM=0, TREE_RECURRENCE_GDN_BWD_DV_INPLACE=0,
    TREE_RECURRENCE_GDN_BWD_DO_TOKENS=0), each at its own
    predicted peak; TREE_RECURRENCE_GDN_MEMTRACE=1 prints one line per stage."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    e = dict(os.environ, TREE_RECURRENCE_GDN_MEMTRACE="1")
    e.pop("TREE_RECURRENCE_GDN_BWD_DQ_SUM", None)
    e.pop("TREE_RECURRENCE_GDN_BWD_DV_INPLACE", None)
    e.pop("TREE_RECURRENCE_GDN_BWD_DO_TOKENS", None)
    if env == "previous":
        e.update(TREE_RECURRENCE_GDN_BWD_DQ_SUM="0", TREE_RECURRENCE_GDN_BWD_DV_INPLACE="0",
                 TREE_RECURRENCE_GDN_BWD_DO_TOKENS="0")
    e["PYTHONPATH"] = here + os.pathsep + e.get("PYTHONPATH", "")
    code = ("import json, test_gdn_fused_bwd_gpu as t; m = t._measure_backward_peak('tree'); "
            "print('RESULT ' + json.dumps(m))")
    out = subprocess.run([sys.executable, "-c", code], env=e, cwd=here, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    trace = [ln for ln in out.stderr.splitlines() if ln.startswith("[gdn bwd memtrace]")]
    print("\n" + "\n".join(trace))
    for stage in ("start", "(a) dv_local", "state pass", "(b) dq/dk", "(c) WY backward", "(d) finalize", "end"):
        assert any(f"] {stage} " in ln for ln in trace), f"memtrace has no line for {stage!r}"
    m = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    _check_peak(m, f"tree/{env}")
