"""Cases and helpers of the fused GDN backward's GPU tests (test_gdn_fused_bwd_gpu.py,
test_gdn_fused_bwd_shapes_gpu.py): the named tries and dims, a case's inputs and saved buffers (the float64
forward reference of tests/python/gdn_chunk_reference.py rounded like the kernels store them), the
test-only op ``gdn_fused_backward_stages`` over a case, the float64 twins' rows and the oracle's gradients."""

from __future__ import annotations

import random

import pytest
import torch

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref

if torch.cuda.is_available():
    from test_gdn_chunked import chunk_tables, make_inputs, rand_spec, rel_rms, run_oracle, trie
    from tree_recurrence import plugins

FAMILY = "gated_delta_net"
TOL = 2e-2  # bf16, every gradient (FLA's dbeta / dg tolerance)
STAGE_TOL = 2e-2

NAMES = ["dv_local", "q_g", "grad_state_out", "dv_total", "d_root", "dq_hv", "dk_b", "dG_b", "dk_hv", "dG", "dv", "dbeta",
         "dg", "dq", "dk", "d_initial_state"]

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


def spec_of(spec):
    if isinstance(spec, str):
        return rand_spec(random.Random(spec), spec)
    return spec


def init_of(ins, h0):
    return None if h0 == "none" else (ins["h0"][0] if h0 == "shared" else ins["h0"])


def setup_case(spec, h0="none", l2norm=True, strong=False, seed=0, dtype=torch.bfloat16, **dims):
    """bf16 inputs on the GPU, their float64 copies, and the saved buffers (float64 forward
    reference of the rounded inputs, stored like the kernels store them)."""
    seg_offsets, parents = trie(spec_of(spec))
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
    fwd = fref.stages(x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], tabs_cpu, init_of(x64, h0), 0.0, l2norm,
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


def run_stages(case):
    """The stages op on a case (dq_hv: (NC, HK, C, K), dq^ summed over each key head's value heads)."""
    ops = plugins.ops(FAMILY)
    if not hasattr(ops, "gdn_fused_backward_stages"):
        pytest.skip("this build has no gdn_fused_backward_stages op")
    d, s = case["dev"], case["saved"]
    out = ops.gdn_fused_backward_stages(d["grad"], d["q"], d["k"], d["v"], d["g"], d["beta"], *case["tabs"],
                                        init_of(d, case["h0"]), 0.0, case["l2norm"], s["G"], s["Ainv"], s["w"], s["kd"],
                                        s["h"], s["v_new"], s["rq"], s["rk"])
    torch.cuda.synchronize()
    return dict(zip(NAMES, out))


def dq_like(want_dq_hv, got_dq):
    """The twin's per-value-head dq^ as the kernel returns it: summed over each key head's value heads."""
    NC, HV, C, K = want_dq_hv.shape
    HK = got_dq.shape[1]
    return want_dq_hv if HK == HV else want_dq_hv.reshape(NC, HK, HV // HK, C, K).sum(2)


def dq_per_value_head(dq, HV):
    """The stages op's dq_hv as (NC, HV, C, K) for stage_d (which sums the value heads of each key head):
    the per-key-head sum in each key head's first value head, zeros elsewhere."""
    NC, HK, C, K = dq.shape
    if HK == HV:
        return dq
    out = torch.zeros(NC, HK, HV // HK, C, K, dtype=dq.dtype)
    out[:, :, 0] = dq
    return out.reshape(NC, HV, C, K)


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


def twin_inputs(case):
    """The float64 twins' chunk-major inputs and saved buffers of a case."""
    x = case["x64"]
    inp = bref.inputs(x["grad"], x["q"], x["k"], x["v"], x["g"], x["beta"], case["tabs_cpu"], 0.0, case["l2norm"])
    return inp, {n: c64(t) for n, t in case["saved"].items()}


def stage_b_rows(got, inp, sv):
    """Stage (b) against its float64 twin fed dO (chunk-major, the kernels' rounded grad_o) and the GPU's
    grad_state_out."""
    want = bref.stage_b(inp["qc"], inp["kc"], sv["G"], inp["dOc"], sv["h"], sv["v_new"],
                        c64(got["grad_state_out"]), inp["valid"])
    want["dq_hv"] = dq_like(want["dq_hv"], got["dq_hv"])
    return [("b", n, rel_rms(got[n], want[n]), STAGE_TOL) for n in ("dq_hv", "dk_b", "dG_b")]


def stage_c_rows(got, inp, sv, scatter):
    """Stage (c) against its float64 twin fed the GPU's dv_total, dk_b, dG_b; and the twin's outputs."""
    want = bref.stage_c(inp["kc"], inp["vc"], inp["bc"], sv["G"], sv["Ainv"], sv["w"], sv["h"], c64(got["dv_total"]),
                        c64(got["dk_b"]), c64(got["dG_b"]))
    rows = [("c", "dk_hv", rel_rms(got["dk_hv"], want["dk_hv"]), STAGE_TOL),
            ("c", "dG", rel_rms(got["dG"], want["dG"]), STAGE_TOL),
            ("c", "dv", rel_rms(got["dv"], bref._tokens(want["dv_c"], scatter)), STAGE_TOL),
            ("c", "dbeta", rel_rms(got["dbeta"], bref._tokens(want["dbeta_c"], scatter)), STAGE_TOL)]
    return rows, want


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
