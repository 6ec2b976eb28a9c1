"""GPU tests of the fused GDN backward kernels (plugins/gated_delta_net/csrc/gdn_fused/
gdn_fused_bwd.cpp, kernels/*_bwd.cu), through the test-only op ``gdn_fused_backward_stages``, which
runs the backward from GIVEN saved buffers (here: the float64 forward reference of
tests/python/gdn_chunk_reference.py rounded like the kernels store them), so these tests hold
whatever the forward kernels do. Cases and helpers: gdn_fused_bwd_cases.py; extreme gates and more
shapes: test_gdn_fused_bwd_shapes_gpu.py.

* test_stages: every stage against its float64 twin (tests/python/gdn_bwd_reference.py) fed with the
  GPU's own outputs of the previous stage, so one run tells which kernel and which quantity is off.
  Prints the relative RMS of every quantity.
* test_final_gradients: dq, dk, dv, dg, dbeta, d_initial_state (and dA_log, ddt_bias when g comes
  from them as in Qwen3.5) against float64 autograd through the token oracle gdn_token_scan.
  bf16: relative RMS <= 2e-2 for every gradient.
* test_bitwise_deterministic: two runs give identical bits.
* test_through_the_op: gdn_tree_scan's autograd on CUDA bf16 (fused forward + fused backward) vs the
  oracle: the fused forward's saved buffers into the fused backward.
* the backward's memory (dq^ summed per key head inside (b), dv_total written over dv_local, dO read at
  the tokens by (a), the state pass and (b)): test_retain_graph_double_backward: a retain_graph=True
  backward keeps the saved buffers (the second backward gives the same bits), a third one raises;
  test_backward_peak_memory: the backward's peak equals the live-buffer timeline of gdn_fused_bwd.cpp
  (_predicted_backward_peak).

Run: .venv/bin/python -m pytest tests/python/test_gdn_fused_bwd_gpu.py -q -x -s
"""

from __future__ import annotations

import pytest
import torch

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref
from gdn_fused_bwd_cases import (CASES, FAMILY, NAMES, STAGE_TOL, TOL, c64, cached_case, cached_oracle,
                                 dq_per_value_head, init_of, oracle_grads, qwen_gate, report, run_stages, setup_case,
                                 stage_b_rows, stage_c_rows, twin_inputs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from test_gdn_chunked import chunk_tables, rel_rms, trie
    from tree_recurrence import plugins


@pytest.mark.parametrize("name", sorted(CASES))
def test_stages(name):
    case = cached_case(name)
    got = run_stages(case)
    x = case["x64"]
    inp, sv = twin_inputs(case)
    G = sv["G"]
    rows = []

    want = bref.stage_a(inp["qc"], inp["kc"], G, inp["dOc"])
    rows += [("a", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("dv_local", "q_g")]

    init64 = init_of(x, case["h0"])
    want = bref.stage_pass(c64(got["dv_local"]), c64(got["q_g"]), inp["dOc"], sv["w"], sv["kd"], G, case["tabs_cpu"],
                           init64)
    rows += [("pass", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("grad_state_out", "dv_total", "d_root")]

    rows += stage_b_rows(got, inp, sv)

    scatter = case["tabs_cpu"][1]
    c_rows, want = stage_c_rows(got, inp, sv, scatter)
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


@pytest.mark.parametrize("name", sorted(CASES))
def test_final_gradients(name):
    case = cached_case(name)
    got = run_stages(case)
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
    fwd = fref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], case["tabs_cpu"], init_of(x, case["h0"]), 0.0,
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


@pytest.mark.parametrize("name", ["around_chunk", "wide", "grouped_l2", "grouped_no_l2"])
def test_bitwise_deterministic(name):
    case = cached_case(name)
    a, b = run_stages(case), run_stages(case)
    diff = [n for n in NAMES if not torch.equal(a[n], b[n])]
    assert not diff, f"{name}: two runs differ in {diff}"


@pytest.mark.parametrize("name", ["around_chunk", "deep", "grouped_l2", "strong"])
def test_through_the_op(name):
    """gdn_tree_scan autograd on CUDA bf16: the fused forward's saved buffers into the fused backward."""
    case = cached_case(name)
    ops = plugins.ops(FAMILY)
    d = {n: t.clone().requires_grad_(n != "grad") for n, t in case["dev"].items()}
    init = init_of(d, case["h0"])
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


# ---- the backward's memory (gdn_fused_bwd.cpp: every buffer freed after its last reader)


@pytest.mark.parametrize("name", ["grouped_l2", "strong", "around_chunk"])
def test_retain_graph_double_backward(name):
    """retain_graph=True keeps the stage buffers (the backward frees them only when the graph is not
    kept): a second backward through the graph gives the first one's bits; after a backward without
    retain_graph, another one raises instead of reading freed buffers."""
    case = cached_case(name)
    ops = plugins.ops(FAMILY)
    d = {n: t.clone().requires_grad_(n != "grad") for n, t in case["dev"].items()}
    o = ops.gdn_tree_scan(d["q"], d["k"], d["v"], d["g"], d["beta"], *case["tabs"], init_of(d, case["h0"]), 0.0,
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


def _predicted_backward_peak(T, S, R, NC, HK, HV, K, V, beta_cast=True):
    """Bytes above what is allocated when the backward starts (o and the saved buffers included there), at
    the peak of the fused backward's live-buffer timeline (gdn_fused_bwd.cpp's run, ScanFunction handing
    the saved buffers over): per stage the transients alive at its launch minus the saved buffers already
    released (w, kd after the state pass; Ainv, h, v_new after (c)). In-type 2 bytes. dv_total is written
    over dv_local; dq^ is summed per key head; dO is read at the tokens (no chunk-major copy)."""
    C, bf, f = 64, 2, 4
    cv, ck, kv = NC * HV * C * V * bf, NC * HV * C * K * bf, NC * HV * K * V * bf
    cc, chf = NC * HV * C * C * bf, NC * HV * C * f
    d_root, ws = R * HV * K * V * f, S * HV * K * V * f
    beta32 = T * HV * f if beta_cast else 0
    decay = NC * HV * f
    dq, dk = NC * HK * C * K * f, NC * HV * C * K * f
    tok = T * HV * V * bf + 2 * T * HV * f  # dv, dbeta, dg
    stages = {
        "state pass": beta32 + decay + cv + ck + kv + d_root + ws,
        "(b) dq/dk": beta32 + cv + kv + d_root + dq + dk + chf - 2 * ck,
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
    """Forward, then the backward's peak above the allocation when it starts (bytes), and the prediction."""
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
    NC, S = tabs[0].shape[0], len(parents)
    R = sum(p < 0 for p in parents)
    want, stages = _predicted_backward_peak(T, S, R, NC, HK, HV, K, V)
    return dict(got=got, want=want, stages=stages)


PEAK_SLACK = 24 << 20  # the caching allocator's rounding (a block keeps an unsplit remainder under 1 MiB)


def _check_peak(m, label):
    print(f"\n[{label}] backward peak {m['got'] / 2**20:.1f} MiB, predicted {m['want'] / 2**20:.1f} MiB "
          f"(stages: {', '.join(f'{k} {v / 2**20:.1f}' for k, v in m['stages'].items())})")
    assert abs(m["got"] - m["want"]) <= PEAK_SLACK, f"{label}: peak {m['got']} bytes, predicted {m['want']}"


@pytest.mark.parametrize("name", sorted(PEAK_SPECS))
def test_backward_peak_memory(name):
    """The backward's peak (torch.cuda.max_memory_allocated) is the live-buffer timeline's."""
    _check_peak(_measure_backward_peak(name), name)
