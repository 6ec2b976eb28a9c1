"""The fused SSD backward kernels on the GPU (issue 20, stage 2), through the test-only op
``ssd_fused_backward_stages`` (runs the backward from GIVEN saved buffers, so it is tested even
while the forward kernels are not right): every stage's output against its float64 twin in
ssd_bwd_reference.py (relative RMS printed per quantity, so one run tells which kernel is wrong),
then the final gradients of x, dt, A (and A_log), B, C, D, dt_bias, z and the initial states
against float64 autograd through the token-by-token recurrence, and bitwise identical results on
two runs. Cases: mixed / deep / wide tries, 1-token segments, segments around the chunk, an 8k
segment, G 2 with H 4, D (H) and (H, P), z on/off, softplus on/off, dt_limit, shared and per-root
initial states, chunk 64 / 128 / 256, fp32 / bf16 / fp16 inputs. A last test takes the saved
buffers from the fused forward (op ``ssd_fused_stages``) when it exists.

Run on the GPU:  .venv/bin/python -m pytest tests/python/test_ssd_fused_bwd_gpu.py -q -x -s
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ssd_bwd_reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STAGE_NAMES = ["dy", "dz", "cb", "local", "ds_leave", "ddecay", "d_roots", "q", "v", "ddt_direct", "d_dtA", "ddt",
               "ddt_raw", "dA_part"]
DEVICE = "cuda"  # a CPU harness check may swap it (with a stand-in op)
FINAL_NAMES = ["dx", "ddt_final", "dB", "dC", "dA", "dD", "ddt_bias", "dz_final", "d_initial_state"]


def _ops():
    from tree_recurrence import plugins

    return plugins.ops("mamba2")


def uses_tensor_cores(chunk, P, N):
    """Whether fused::backward takes the tensor-core path (ssd_tc_bwd.cu): chunk 64, P and N <= 128, its
    shared-memory plan (PostPlan) within the H200's 227 KiB opt-in, TREE_RECURRENCE_SSD_BWD_TC not 0."""
    if os.environ.get("TREE_RECURRENCE_SSD_BWD_TC", "1") == "0" or chunk != 64 or P > 128 or N > 128:
        return False
    Pp, Np = (P + 15) // 16 * 16, (N + 15) // 16 * 16
    floats = 128 + 2 * 64 * (Np + 4) + 3 * 64 * 68 + 2 * 64 * (Pp + 4) + Pp * (Np + 4) + 8 * 64 + 3 * 8 * 64
    return floats * 4 <= 232448


def uses_new_local(chunk, P, N, dtype):
    """Whether the bf16 / fp16 local kernel (ssd_local_bwd.cu, round 3) computes the local state gradient:
    the tensor-core path, 16-bit inputs, P and N multiples of 8, TREE_RECURRENCE_SSD_BWD_V1 not 1."""
    return (os.environ.get("TREE_RECURRENCE_SSD_BWD_V1", "0") != "1" and uses_tensor_cores(chunk, P, N)
            and dtype in (torch.bfloat16, torch.float16) and P % 8 == 0 and N % 8 == 0)


# The new local kernel rounds e^Lam dy once to the input dtype (one MMA per product): the stages that
# depend on the local gradient move by ~2^-9 relative (bf16). CPU emulation of that rounding against the
# float64 stages (MIXED / DEEP / WIDE, P 16..64, N 16..128): local, ds_leave, ddecay, d_roots <= 1.8e-3,
# v <= 2.6e-3, d_dtA <= 3.0e-3, the final gradients <= 3e-4 (fp16: 8x smaller).
LOCAL_STAGES = {"local", "ds_leave", "ddecay", "d_roots", "v", "ddt_direct", "d_dtA", "ddt", "ddt_raw", "dA_part"}
NEW_LOCAL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

# H3's bf16 / fp16 post kernel (ssd_post_bwd.cu; its own tests: test_ssd_post_bwd_gpu.py) runs under the same
# conditions as the new local kernel: one MMA per product with operands rounded once to the input type.
POST_STAGES = {"cb", "q", "v", "ddt_direct", "d_dtA", "ddt", "ddt_raw", "dA_part"}
NEW_POST_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


# The tensor-core path splits every fp32 operand into bf16 hi + lo and sums hi*hi + hi*lo + lo*hi: products
# to ~2^-16 relative (the fp32 CUDA-core path: 2^-24), so its stages get a looser bound.
TC_STAGE_TOL = 3e-4


def rel_rms(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def make(T, H, P, G, N, roots, D_per_channel, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(T, H, P), dt=r(T, H), B=r(T, G, N), C=r(T, G, N), z=r(T, H, P), dout=r(T, H, P),
                D=r(H, P) if D_per_channel else r(H), dt_bias=r(H) * 0.5, h0=r(roots, H, P, N) * 0.5,
                A_log=r(H) * 0.5)


def oracle_grads(d, seg_offsets, parents, D, dt_bias, z, h0t, h0, dt_softplus, dt_limit, oracle_chunk=None):
    """Float64 leaves of ``d`` with their gradients of sum(y * dout), y the float64 forward (the token
    recurrence, or the chunked forward at ``oracle_chunk`` for long rows); the optional inputs used where
    ``D`` / ``dt_bias`` / ``z`` / ``h0t`` are given (``h0 == "shared"``: one initial state for every root)."""
    leaves = {k: v.clone().requires_grad_() for k, v in d.items()}
    A_leaf = -torch.exp(leaves["A_log"])
    oopt = dict(D=leaves["D"] if D is not None else None, dt_bias=leaves["dt_bias"] if dt_bias is not None else None,
                z=leaves["z"] if z is not None else None,
                initial_state=None if h0t is None else (leaves["h0"][0] if h0 == "shared" else leaves["h0"]),
                dt_softplus=dt_softplus, dt_limit=dt_limit)
    if oracle_chunk is None:
        y = ref.token_scan(leaves["x"], leaves["dt"], leaves["B"], leaves["C"], A_leaf, seg_offsets, parents, **oopt)
    else:
        # long rows: autograd through the float64 chunked forward at another chunk size (checked against the
        # token recurrence in test_ssd_bwd_reference.py), which a Python token loop would take minutes for
        otabs = ref.chunk_tables(seg_offsets, parents, oracle_chunk)
        y = ref.forward(leaves["x"], leaves["dt"], leaves["B"], leaves["C"], A_leaf, otabs, **oopt)["out"]
    (y * d["dout"]).sum().backward()
    return leaves


def run_case(seg_offsets, parents, chunk=64, dtype=torch.float32, H=4, P=16, G=2, N=16, D_per_channel=False,
             use=("D", "dt_bias", "z", "h0"), h0="per_root", dt_softplus=True, dt_limit=(0.0, float("inf")),
             seed=0, stage_tol=None, final_tol=None, saved_from_forward=False, oracle_chunk=None, name="", keep=None):
    seg_offsets, parents = list(seg_offsets), list(parents)
    roots = sum(p < 0 for p in parents)
    T = seg_offsets[-1]
    raw = make(T, H, P, G, N, 1 if h0 == "shared" else roots, D_per_channel, seed)
    # inputs as the kernels see them (in-type rounded); the float64 references use the same values
    for k in ("x", "B", "C", "z", "dout"):
        raw[k] = raw[k].to(dtype).double()
    d = raw
    A = -torch.exp(d["A_log"]).float().double()  # A is fp32 in the models
    D = d["D"] if "D" in use else None
    dt_bias = d["dt_bias"] if "dt_bias" in use else None
    z = d["z"] if "z" in use else None
    h0t = None if "h0" not in use else (d["h0"][0] if h0 == "shared" else d["h0"])
    tabs = ref.chunk_tables(seg_offsets, parents, chunk)
    opt = dict(D=D, dt_bias=dt_bias, z=z, initial_state=h0t, dt_softplus=dt_softplus, dt_limit=dt_limit)

    dev = torch.device(DEVICE)
    tabs_dev = ref.chunk_tables(seg_offsets, parents, chunk, dev)
    cu = lambda t, dt_=dtype: None if t is None else t.to(dev, dt_).contiguous()  # noqa: E731
    ops = _ops()
    if saved_from_forward:
        if not hasattr(ops, "ssd_fused_stages"):
            pytest.skip("the fused forward's stage op ssd_fused_stages is not built")
        fw = ops.ssd_fused_stages(cu(d["x"]), cu(d["dt"], torch.float32), cu(d["B"]), cu(d["C"]), tabs_dev["gather"],
                                  tabs_dev["scatter"], tabs_dev["seg_chunk_offsets"], tabs_dev["parents"],
                                  tabs_dev["root_index"], tabs_dev["level_segments"], tabs_dev["level_offsets"],
                                  tabs_dev["child_offsets"], tabs_dev["children"], cu(h0t, torch.float32),
                                  A=cu(A, torch.float32), dt_limit=list(dt_limit), D=cu(D, torch.float32),
                                  dt_bias=cu(dt_bias, torch.float32), dt_softplus=dt_softplus, z=cu(z))
        saved_dev = dict(dt=fw[1], Lam=fw[2], states=fw[4], y=fw[5] if z is not None else None)
        saved = dict(dt=fw[1].double().cpu(), Lam=fw[2].double().cpu(), states=fw[4].double().cpu(),
                     y=fw[5].double().cpu() if z is not None else None)
    else:
        sv = ref.forward(d["x"], d["dt"], d["B"], d["C"], A, tabs, states_dtype=dtype, **opt)
        # saved buffers as the forward stores them: dt / Lam fp32, states and y in-type
        saved = dict(dt=sv["dt"].float().double(), Lam=sv["Lam"].float().double(), states=sv["states"],
                     y=sv["y"].to(dtype).double())
        saved_dev = dict(dt=cu(saved["dt"], torch.float32), Lam=cu(saved["Lam"], torch.float32),
                         states=cu(saved["states"]), y=cu(saved["y"]) if z is not None else None)

    def launch():
        return ops.ssd_fused_backward_stages(
            cu(d["dout"]), cu(d["x"]), cu(d["dt"], torch.float32), cu(d["B"]), cu(d["C"]), cu(A, torch.float32),
            cu(D, torch.float32), cu(dt_bias, torch.float32), cu(z), cu(h0t, torch.float32), list(dt_limit), dt_softplus,
            tabs_dev["gather"], tabs_dev["scatter"], tabs_dev["seg_chunk_offsets"], tabs_dev["parents"],
            tabs_dev["root_index"], tabs_dev["level_segments"], tabs_dev["level_offsets"], tabs_dev["child_offsets"],
            tabs_dev["children"], saved_dev["dt"], saved_dev["Lam"], saved_dev["states"], saved_dev["y"])

    out = launch()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    got = dict(zip(STAGE_NAMES + FINAL_NAMES, out))
    if keep is not None:
        keep.update(got)
        keep["_saved"], keep["_tabs"] = saved, tabs  # for the H5 checks (float64 on the CPU)
    for k, v in got.items():
        assert torch.isfinite(v).all(), f"{name}: {k} is not finite"

    # 1) every stage against its float64 twin on the same saved buffers
    want = ref.backward(d["dout"], d["x"], d["dt"], d["B"], d["C"], A, tabs, saved, **opt)
    tc = uses_tensor_cores(chunk, P, N)
    stage_tol = stage_tol if stage_tol is not None else (TC_STAGE_TOL if tc else 1e-4)
    new_local = uses_new_local(chunk, P, N, dtype)
    tol_of = {k: max(stage_tol, NEW_LOCAL_TOL[dtype]) if new_local and k in LOCAL_STAGES else stage_tol
              for k in STAGE_NAMES}
    if new_local:  # the new post kernel runs too (H3)
        tol_of.update({k: max(tol_of[k], NEW_POST_TOL[dtype]) for k in POST_STAGES})
    stage_err = {}
    for k in STAGE_NAMES:
        key = k
        if k == "d_roots" and h0t is None:
            continue
        if k == "dz" and z is None:
            continue
        if k == "dA_part":
            w = (saved["dt"] * want["d_dtA"]).sum(-1)
        elif k == "local":
            w = want["local"]
        else:
            w = want[key]
        stage_err[k] = rel_rms(got[k], w)
    print(f"\n[{name}] {'tensor-core' if tc else 'fp32 CUDA-core'} path{' + bf16/fp16 local' if new_local else ''}, stages (rel RMS vs float64 stage reference):",
          " ".join(f"{k}={v:.2e}" for k, v in stage_err.items()))

    # 2) final gradients against float64 autograd through the token recurrence
    leaves = oracle_grads(d, seg_offsets, parents, D, dt_bias, z, h0t, h0, dt_softplus, dt_limit, oracle_chunk)
    finals = dict(dx=("x", got["dx"]), ddt_final=("dt", got["ddt_final"]), dB=("B", got["dB"]), dC=("C", got["dC"]),
                  dA=("A_log", got["dA"].double().cpu() * A))
    if D is not None:
        finals["dD"] = ("D", got["dD"])
    if dt_bias is not None:
        finals["ddt_bias"] = ("dt_bias", got["ddt_bias"])
    if z is not None:
        finals["dz_final"] = ("z", got["dz_final"])
    if h0t is not None:
        finals["d_initial_state"] = ("h0", got["d_initial_state"].cpu().reshape(leaves["h0"].shape))
    final_err = {k: rel_rms(v, leaves[n].grad) for k, (n, v) in finals.items()}
    print(f"[{name}] final gradients (rel RMS vs float64 autograd of the token recurrence):",
          " ".join(f"{k}={v:.2e}" for k, v in final_err.items()))

    # 3) bitwise identical on a second run
    again = launch()
    same = {k: torch.equal(a, b) for k, a, b in zip(STAGE_NAMES + FINAL_NAMES, out, again)}
    assert all(same.values()), f"{name}: not bitwise identical on two runs: {[k for k, v in same.items() if not v]}"

    bad = {k: v for k, v in stage_err.items() if not v <= tol_of[k]}
    assert not bad, f"{name}: stages above {stage_tol} (local-dependent stages of the new local kernel: {tol_of['local']}): {bad}"
    if final_tol is None:
        final_tol = 1e-4 if dtype == torch.float32 else 1e-2
    bad = {k: v for k, v in final_err.items() if not v <= final_tol}
    assert not bad, f"{name}: final gradients above {final_tol}: {bad}"
    return stage_err, final_err


# segments of 1, 63, 64, 65 tokens and a 130-token one in a branching trie with two roots
MIXED = ([0, 1, 64, 128, 193, 194, 324, 389], [-1, 0, 1, 0, -1, 4, 4])
DEEP = ([0, 100, 101, 229, 300, 301, 430, 431, 560, 600, 729, 730, 731], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
WIDE = ([0, 130] + [130 + 10 * (k + 1) + k for k in range(12)], [-1] + [0] * 12)


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_mixed_fp32(chunk):
    run_case(*MIXED, chunk=chunk, name=f"mixed fp32 L{chunk}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_half(dtype):
    run_case(*MIXED, dtype=dtype, D_per_channel=True, name=f"mixed {dtype} D(H,P)")


def test_deep_trie_bf16_chunk128():
    run_case(*DEEP, chunk=128, dtype=torch.bfloat16, name="deep bf16 L128")


def test_wide_trie_bf16_shared_h0():
    run_case(*WIDE, chunk=64, dtype=torch.bfloat16, h0="shared", name="wide bf16 shared h0")


def test_no_optionals_no_softplus_dt_limit():
    run_case(*MIXED, use=(), dt_softplus=False, dt_limit=(0.05, 1.5), name="no optionals, clamp")
    run_case(*MIXED, use=("D",), dt_limit=(0.2, 0.9), name="softplus + dt_limit, D only")


def test_one_token_segments():
    run_case([0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, -1], name="1-token segments")


def test_groups_one_and_model_dims_bf16():
    run_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=1, N=64, chunk=128, name="G1 H8 P64 N64 bf16 L128")
    run_case([0, 200, 300], [-1, 0], dtype=torch.bfloat16, H=4, P=128, G=2, N=128, chunk=64, name="P128 N128 bf16")


def test_tensor_core_model_dims():
    """The tensor-core path at the GRPO head shape (P 64, N 128, 4 heads per group, chunk 64), fp32 and bf16,
    and at P 64 / N 64 with odd sizes (P 40, N 24: zero-padded tiles)."""
    assert uses_tensor_cores(64, 64, 128)
    run_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, chunk=64, name="tc P64 N128 bf16 L64")
    run_case(*DEEP, dtype=torch.float32, H=8, P=64, G=2, N=128, chunk=64, name="tc deep P64 N128 fp32 L64")
    run_case(*WIDE, dtype=torch.float16, H=4, P=40, G=1, N=24, chunk=64, h0="shared", name="tc P40 N24 fp16 L64")


def test_cuda_core_fallback(monkeypatch):
    """TREE_RECURRENCE_SSD_BWD_TC=0: the round-1 fp32 CUDA-core kernels, at the tight bound."""
    monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_TC", "0")
    run_case(*MIXED, chunk=64, name="fallback fp32 L64")
    run_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, chunk=64, name="fallback P64 N128 bf16 L64")


def test_8k_segment():
    run_case([0, 8192, 8292], [-1, 0], chunk=128, dtype=torch.bfloat16, H=2, P=16, G=1, N=16, oracle_chunk=64,
             name="8k bf16 L128")


def test_saved_buffers_from_the_fused_forward():
    run_case(*MIXED, chunk=64, dtype=torch.bfloat16, saved_from_forward=True, name="fused forward's saved buffers")


@pytest.mark.parametrize("chunk", [64, 128])
def test_through_ssd_tree_scan_autograd(chunk):
    """End to end: ssd_tree_scan on CUDA in bf16 (the fused forward + fused::backward when fused::supported
    holds, else the composite) under autograd, every gradient vs float64 autograd of the token oracle."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    seg, par = MIXED
    ins = make_inputs(seg[-1], H=4, P=16, G=2, N=16, dtype=torch.bfloat16, device="cuda", roots=2, D_per_channel=True)
    oracle = as_oracle(ins)
    y = run_chunked(ins, seg, par, chunk=chunk)
    want = run_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    got = torch.autograd.grad((y * w.to(y.device, y.dtype)).sum(), [ins[n] for n in names])
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, got, wanted)}
    errors["y"] = rel_rms(y, want)
    print(f"\n[ssd_tree_scan autograd bf16 L{chunk}] rel RMS vs float64 token oracle:",
          " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


def test_y_recomputed_not_stored_and_fallback(monkeypatch):
    """Issue 20 (memory mode, TREE_RECURRENCE_SSD_RECOMPUTE_Y=1): with z on the bf16 post kernel's route the forward
    stores no pre-gate y (fused::forms_y_itself; 0.75 GiB at GRPO): the post kernel recomputes it. Checked: (1) the memory a forward leaves for its backward is one
    y smaller than under TREE_RECURRENCE_SSD_BWD_V1=1 (a route that reads y: the forward stores it); (2) the gradients
    of the recompute route vs float64; (3) a forward that stored no y followed by a backward on a route that reads it
    (V1 set in between): y comes from the forward kernels, every gradient vs float64 and close to (1)'s."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    monkeypatch.setenv("TREE_RECURRENCE_SSD_RECOMPUTE_Y", "1")  # the memory mode (opt-in; read per call)
    seg, par = MIXED
    ins = make_inputs(seg[-1], H=4, P=16, G=2, N=16, dtype=torch.bfloat16, device="cuda", roots=2, D_per_channel=True)
    oracle = as_oracle(ins)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    want = run_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])

    def forward(env_v1):
        if env_v1:
            monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_V1", "1")
        else:
            monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_V1", raising=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = run_chunked(ins, seg, par, chunk=64)
        torch.cuda.synchronize()
        return y, torch.cuda.memory_allocated() - before

    y_v1, kept_v1 = forward(True)
    del y_v1
    y, kept = forward(False)
    y_bytes = ins["x"].numel() * ins["x"].element_size()
    stored = kept_v1 - kept
    print(f"\n[y recompute] a forward keeps {kept} B (V1 route: {kept_v1} B); y is {y_bytes} B")
    assert stored >= y_bytes and stored < y_bytes + 1024, f"the memory mode's forward kept {stored} B less than V1's, not one y"

    def grads(y):
        return torch.autograd.grad((y * w.to(y.device, y.dtype)).sum(), [ins[n] for n in names])

    got = grads(y)  # the memory mode's route: the post kernel recomputes y
    y2, _ = forward(False)
    monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_V1", "1")  # the backward now takes post_tc, which reads y
    got_fb = grads(y2)
    monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_V1")
    for label, g in (("recomputed in post", got), ("forward-kernel fallback", got_fb)):
        errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, g, wanted)}
        print(f"[y {label}] rel RMS vs float64:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
        bad = {k: v for k, v in errors.items() if not v <= 2e-2}
        assert not bad, f"{label}: {bad}"
    close = {n: rel_rms(a.float(), b.float()) for n, a, b in zip(names, got, got_fb)}
    bad = {k: v for k, v in close.items() if not v <= 2e-2}
    assert not bad, f"recomputed vs fallback: {bad}"


@pytest.mark.parametrize("layout", ["mixed", "flat"])
def test_dz_written_over_the_saved_y(layout):
    """Issue 20 (memory): without retain_graph the bf16 post kernel writes dz over the saved pre-gate y (Saved::
    y_consumable; one (T, H, P) buffer less at the backward's peak, 0.75 GiB at GRPO). Checked: (1) every gradient
    bitwise equal to a retain_graph=True backward (which keeps y: no aliasing), and that one's second backward again
    bitwise equal (y intact); (2) every gradient against float64 autograd of the token recurrence; (3) the backward's
    peak above what it starts from is at least one y smaller than with retain_graph=True (one flat row of 4,096 tokens,
    where the post kernel's outputs set the peak)."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    seg, par = MIXED if layout == "mixed" else ([0, 4096], [-1])
    ins = make_inputs(seg[-1], H=8, P=64, G=2, N=32, dtype=torch.bfloat16, device="cuda", roots=2 if layout == "mixed" else 1)
    oracle = as_oracle(ins)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    want = run_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    wd = w.to("cuda", torch.bfloat16)

    def backward(retain, repeat=1):  # the peak of the first backward only
        out = run_chunked(ins, seg, par, chunk=64)
        loss = (out * wd).sum()
        runs, peak = [], None
        for _ in range(repeat):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            runs.append(torch.autograd.grad(loss, [ins[n] for n in names], retain_graph=retain))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base if peak is None else peak
        return runs, peak

    kept, peak_kept = backward(True, repeat=2)
    (over,), peak_over = backward(False)
    for n, a, b, c in zip(names, kept[0], kept[1], over):
        assert torch.equal(a, b), f"{n}: a second retain_graph backward differs (the saved y was overwritten?)"
        assert torch.equal(a, c), f"{n}: dz over y changed the gradient bits"
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, over, wanted)}
    print(f"\n[dz over y, {layout}] rel RMS vs float64:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad
    y_bytes = ins["x"].numel() * ins["x"].element_size()
    print(f"[dz over y, {layout}] backward peak {peak_over} B (retain_graph: {peak_kept} B); y is {y_bytes} B")
    if layout == "flat":  # (on the small trie the segments' carries, released before the post kernel, may set the peak)
        assert peak_kept - peak_over >= y_bytes, "the backward's peak did not drop by one y"


@pytest.mark.parametrize("dims", [(4, 16, 2, 16), (2, 64, 1, 32)], ids=["PN256", "PN2048"])
@pytest.mark.parametrize("layout", ["flat", "long_tree"])
def test_state_pass_ring_bitwise(monkeypatch, layout, dims):
    """Issue 20 (flat-row speed): the 16-bit reverse state pass of long segments through its cp.async ring
    (state_pass_ring_kernel) gives every gradient bitwise equal to state_pass_kernel<4> (TREE_RECURRENCE_SSD_BWD_STATE_RING=0,
    read per launch), local_bf16's 32 x 32 warp tiles bitwise its 32 x 64 ones (TREE_RECURRENCE_SSD_BWD_LOCAL_TILE=64),
    and the defaults within tolerance of float64 autograd of the token recurrence. Layouts where the segments
    average more than 64 chunks (the two-kernel route): one flat row of 130 chunks; a root of 8,000 tokens with a child of
    4,300 (its carry through ws) and a 1-token child, per-root initial states. PN 256 leaves 192 threads of the block
    past P N (their lanes stay for the shuffles); PN 2048 fills two blocks."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    H, P, G, N = dims
    seg, par = ([0, 8320], [-1]) if layout == "flat" else ([0, 8000, 12300, 12301], [-1, 0, 0])
    ins = make_inputs(seg[-1], H=H, P=P, G=G, N=N, dtype=torch.bfloat16, device="cuda", seed=3)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    w = torch.randn(seg[-1], H, P, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads():
        out = run_chunked(ins, seg, par, chunk=64)
        return torch.autograd.grad((out * w.to("cuda", out.dtype)).sum(), [ins[n] for n in names])

    monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_STATE_RING", "0")
    monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_LOCAL_TILE", "64")
    plain = grads()
    monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_STATE_RING")
    ring_wide = grads()
    monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_LOCAL_TILE")
    ring = grads()  # the defaults: the ring pass, local_bf16's 32 x 32 warp tiles
    for n, a, b, c in zip(names, plain, ring_wide, ring):
        assert torch.equal(a, b), f"{n}: the ring state pass differs from state_pass_kernel<4>"
        assert torch.equal(b, c), f"{n}: local_bf16's 32 x 32 warp tiles differ from its 32 x 64 ones"
    oracle = as_oracle(ins)
    want = run_oracle(oracle, seg, par)
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, ring, wanted)}
    print(f"\n[state pass ring, {layout} {dims}] rel RMS vs float64:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


@pytest.mark.parametrize("trie", ["mixed", "wide"])
def test_state_pass_scalar_fallback(trie):
    """P N = 35 (not a multiple of 4): the reverse state pass's one-element-per-thread variant (every other
    case runs its 16-byte variant); fp32 CUDA-core path (chunk 128), per-root initial states (d_roots),
    2 children (mixed: a partial batch of the 4 children loaded together) and 12 (wide)."""
    seg, par = MIXED if trie == "mixed" else WIDE
    run_case(seg, par, chunk=128, dtype=torch.float32, H=4, P=5, G=2, N=7, name=f"state pass scalar P5 N7 {trie}")


# ---- round 3 (H4): bf16 / fp16 local kernel with dy on the fly, ddecay folded into the state pass ----------

NEW_VS_OLD = ["local", "ds_leave", "ddecay", "d_roots", "v", "d_dtA", "ddt_raw", "dA_part"]


def new_vs_v1(monkeypatch, seg, par, dtype, tol, **kw):
    """The default (new local kernel, folded ddecay) and TREE_RECURRENCE_SSD_BWD_V1=1 (gate + local_tc, the
    ddecay kernel) on the same inputs: each against float64 inside run_case, then against each other."""
    name = kw.pop("name")
    new, old = {}, {}
    monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_V1", raising=False)
    run_case(seg, par, dtype=dtype, keep=new, name=f"{name} new", **kw)
    monkeypatch.setenv("TREE_RECURRENCE_SSD_BWD_V1", "1")
    run_case(seg, par, dtype=dtype, keep=old, name=f"{name} V1", **kw)
    monkeypatch.delenv("TREE_RECURRENCE_SSD_BWD_V1")
    diff = {k: rel_rms(new[k], old[k]) for k in NEW_VS_OLD if new[k].numel() > 0 and old[k].norm() > 0}
    print(f"[{name}] new vs V1 (rel RMS):", " ".join(f"{k}={v:.2e}" for k, v in diff.items()))
    bad = {k: v for k, v in diff.items() if not v <= tol}
    assert not bad, f"{name}: new vs V1 kernels above {tol}: {bad}"


@pytest.mark.parametrize("use", [("D", "dt_bias", "z", "h0"), ("D",)], ids=["z", "no_z"])
def test_local_bf16_model_dims(monkeypatch, use):
    """GRPO head shape (P 64, N 128, 16 heads per group, chunk 64) at a few hundred tokens, z on / off."""
    assert uses_new_local(64, 64, 128, torch.bfloat16)
    new_vs_v1(monkeypatch, *MIXED, torch.bfloat16, 1e-2, H=32, P=64, G=2, N=128, chunk=64, use=use,
              D_per_channel=True, name=f"local bf16 H32 G2 P64 N128 {use[-1]}")


def test_local_bf16_tries_and_pads(monkeypatch):
    """Deep and wide tries, 1-token segments; zero-padded tiles (P 40 -> 64, N 24 -> 64), P 128 / N 128, fp16."""
    new_vs_v1(monkeypatch, *DEEP, torch.bfloat16, 1e-2, H=8, P=64, G=2, N=128, chunk=64, name="local deep bf16")
    new_vs_v1(monkeypatch, *WIDE, torch.bfloat16, 1e-2, H=4, P=40, G=1, N=24, chunk=64, h0="shared",
              name="local wide bf16 P40 N24")
    new_vs_v1(monkeypatch, [0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, -1], torch.bfloat16, 1e-2, H=4, P=16, G=2, N=16,
              chunk=64, name="local 1-token bf16")
    new_vs_v1(monkeypatch, [0, 200, 300], [-1, 0], torch.bfloat16, 1e-2, H=4, P=128, G=2, N=128, chunk=64,
              name="local bf16 P128 N128")
    new_vs_v1(monkeypatch, *MIXED, torch.float16, 2e-3, H=8, P=64, G=2, N=128, chunk=64, name="local fp16")


def test_local_fallback_and_folded_ddecay_fp32(monkeypatch):
    """P 20 (not a multiple of 8): local_tc keeps the local stage; fp32: the folded ddecay alone (local_tc
    on both sides), so new vs V1 differs only by the ddecay summation order."""
    assert not uses_new_local(64, 20, 16, torch.bfloat16)
    new_vs_v1(monkeypatch, *MIXED, torch.bfloat16, 1e-5, H=4, P=20, G=2, N=16, chunk=64, name="local fallback P20")
    new_vs_v1(monkeypatch, *MIXED, torch.float32, 1e-5, H=8, P=64, G=2, N=128, chunk=64, name="folded ddecay fp32")
    new_vs_v1(monkeypatch, *WIDE, torch.float32, 1e-5, H=4, P=5, G=2, N=7, chunk=128,
              name="folded ddecay scalar pass P5 N7")


# ---- issue 20 H5: the state gradient ds in the input type on the bf16 / fp16 path ------------------------------
# The default stores ds_local / ds_leave in x's 16-bit type (local_bf16 rounds its fp32 accumulators once, the
# state pass widens them, carries in fp32, writes ds_leave rounded and takes ddecay / d_roots from the fp32 carry);
# TREE_RECURRENCE_SSD_DS_FP32=1 (read once per process: a subprocess) keeps the fp32 ds. Expected (CPU emulation,
# test_ssd_post_bwd_emulation.py): the extra roundings move ds_leave by ~2e-3 relative in bf16 (fp16 ~8x less)
# and the final gradients by < 3e-3; the stage / final tolerances of run_case are unchanged.
DS16_ROUND = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # unit roundoff of round-to-nearest
DS16_VS_FP32_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DS16_CASES = {
    "model_z_bf16": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=32, P=64, G=2, N=128,
                         chunk=64, D_per_channel=True),
    "deep_no_z_bf16": dict(seg_offsets=DEEP[0], parents=DEEP[1], dtype=torch.bfloat16, H=8, P=64, G=2, N=128,
                           chunk=64, use=("D", "dt_bias", "h0")),
    "wide_pads_fp16": dict(seg_offsets=WIDE[0], parents=WIDE[1], dtype=torch.float16, H=4, P=40, G=1, N=24,
                           chunk=64, h0="shared"),
}


def _ds_fp32_outputs(case, tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    path = tmp_path / f"ds_fp32_{case}.pt"
    code = ("import sys, torch; sys.path.insert(0, %r); import test_ssd_fused_bwd_gpu as t; keep = {}; "
            "t.run_case(keep=keep, name=%r, **t.DS16_CASES[%r]); "
            "torch.save({k: v.cpu() for k, v in keep.items() if not k.startswith('_')}, %r)"
            % (here, f"{case} ds fp32", case, str(path)))
    return run_saved_subprocess(code, path, ("TREE_RECURRENCE_SSD_BWD_V1", "TREE_RECURRENCE_SSD_BWD_TC"),
                                {"TREE_RECURRENCE_SSD_DS_FP32": "1"}, timeout=600, tail=3000)


@pytest.mark.parametrize("case", sorted(DS16_CASES))
def test_ds_in_input_type(monkeypatch, tmp_path, case):
    """The 16-bit ds (this process: the default) against float64 (run_case, unchanged tolerances), against the
    float64 state pass of its own rounded locals (element-wise: one rounding of ds_leave; ddecay and d_roots from
    the fp32 carry, 1e-5), and against TREE_RECURRENCE_SSD_DS_FP32=1 (a subprocess): the locals bitwise = the fp32
    locals rounded, the rest within DS16_VS_FP32_TOL."""
    if os.environ.get("TREE_RECURRENCE_SSD_DS_FP32", "") == "1":
        pytest.skip("TREE_RECURRENCE_SSD_DS_FP32=1: this process runs the fp32 ds (read once)")
    for k in ("TREE_RECURRENCE_SSD_BWD_V1", "TREE_RECURRENCE_SSD_BWD_TC"):
        monkeypatch.delenv(k, raising=False)
    kw = DS16_CASES[case]
    dtype = kw["dtype"]
    assert uses_new_local(kw["chunk"], kw["P"], kw["N"], dtype)
    new = {}
    run_case(keep=new, name=f"{case} ds16", **kw)
    saved, tabs = new["_saved"], new["_tabs"]
    local, leave = new["local"].cpu(), new["ds_leave"].cpu()
    # 1) the stage op widens the 16-bit buffer: every value is a value of the input type
    for k, v in (("local", local), ("ds_leave", leave)):
        assert v.dtype == torch.float32 and torch.equal(v.to(dtype).float(), v), f"{case}: {k} is not {dtype}-valued"
    # 2) the state pass on these locals in float64: ds_leave one rounding away, ddecay / d_roots unrounded
    want_leave, want_ddecay, want_roots = ref.state_pass(local, saved["Lam"], saved["states"], tabs)
    err = (leave.double() - want_leave).abs()
    bound = DS16_ROUND[dtype] * want_leave.abs() + 1e-5 * want_leave.abs().max()
    worst = float((err / bound.clamp_min(1e-30)).max())
    e_dd = rel_rms(new["ddecay"], want_ddecay)
    e_dr = rel_rms(new["d_roots"], want_roots) if new["d_roots"].numel() > 0 else 0.0
    print(f"[{case}] ds16 vs its float64 state pass: ds_leave max err / bound {worst:.3f}, ddecay {e_dd:.2e}, "
          f"d_roots {e_dr:.2e}")
    assert worst <= 1.0, f"{case}: ds_leave beyond one rounding of the float64 state pass ({worst:.3f} x bound)"
    assert e_dd <= 1e-5 and e_dr <= 1e-5, f"{case}: ddecay {e_dd:.2e} / d_roots {e_dr:.2e} not from the fp32 carry"
    # 3) against the fp32 ds (subprocess)
    old = _ds_fp32_outputs(case, tmp_path)
    assert torch.equal(old["local"].to(dtype).float(), local), f"{case}: 16-bit locals are not the fp32 ones rounded"
    assert not torch.equal(old["ds_leave"].to(dtype).float(), old["ds_leave"]), f"{case}: the subprocess ran 16-bit ds"
    names = ["ds_leave", "ddecay", "d_roots", "v", "d_dtA", "ddt_raw", "dA_part"] + FINAL_NAMES
    diff = {k: rel_rms(new[k], old[k]) for k in names if new[k].numel() > 0 and old[k].norm() > 0}
    print(f"[{case}] ds16 vs ds fp32 (rel RMS):", " ".join(f"{k}={v:.2e}" for k, v in diff.items()))
    bad = {k: v for k, v in diff.items() if not v <= DS16_VS_FP32_TOL[dtype]}
    assert not bad, f"{case}: 16-bit ds vs fp32 ds above {DS16_VS_FP32_TOL[dtype]}: {bad}"


# ---- issue 20: the fused reverse local + state pass (kernels/ssd_state_pass_bwd.cu) ------------------------------
# TREE_RECURRENCE_SSD_BWD_FUSED_PASS (read once per process, so each mode runs in a subprocess): "1" forces the fused
# pass (ds_local formed inside the reverse pass, never stored), "0" the two kernels (local_bf16 + state pass). Each
# subprocess runs run_case on every case (float64 stage twins and autograd oracle, bitwise repeat on two runs); here
# the two modes are compared output by output. The fused pass reproduces local_bf16's products and the state pass's
# fmaf chain and children's sums, so every output is bitwise the two-kernel path's except ddecay (per-warp partials
# of another layout: fp32 summation order) and what it feeds (d(dt A) -> ddt, ddt_raw, dA partials, dt / A / dt_bias
# gradients): those within FUSED_VS_OLD_TOL. (The default process runs the auto rule: fused on these tries.)
FUSED_CASES = {
    # GRPO head shape (P 64, N 128, 16 heads per group), segments of 1 / 63 / 64 / 65 / 130 tokens, 2 roots with
    # their own initial states, z, D (H, P)
    "grpo_shape_mixed_z": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=32, P=64, G=2, N=128,
                               chunk=64, D_per_channel=True),
    # segments of 63, 64, 65, 1, 64 tokens; no z
    "seg_63_64_65_no_z": dict(seg_offsets=[0, 63, 127, 192, 193, 257], parents=[-1, 0, 0, 1, 3], dtype=torch.bfloat16,
                              H=8, P=64, G=2, N=128, chunk=64, use=("D", "dt_bias", "h0")),
    "one_token_segments": dict(seg_offsets=[0, 1, 2, 3, 4, 5], parents=[-1, 0, 0, 2, -1], dtype=torch.bfloat16, H=4,
                               P=16, G=2, N=16, chunk=64),
    "deep_bf16": dict(seg_offsets=DEEP[0], parents=DEEP[1], dtype=torch.bfloat16, H=8, P=64, G=2, N=128, chunk=64),
    # 12 children of one root (one shared initial state), zero-padded tiles P 40 -> 64, N 24 -> 32, fp16
    "wide_pads_fp16_shared_h0": dict(seg_offsets=WIDE[0], parents=WIDE[1], dtype=torch.float16, H=4, P=40, G=1, N=24,
                                     chunk=64, h0="shared"),
    # P 128 (4 warp rows), N 64 (P 128 / N 128 is off the tensor-core path: PostPlan's shared memory)
    "p128_n64": dict(seg_offsets=[0, 200, 300], parents=[-1, 0], dtype=torch.bfloat16, H=4, P=128, G=2, N=64,
                     chunk=64),
    # P 96 (3 of the 4 warp rows busy), N 96: two N tiles of 64 (the second half empty; 16 ddecay partials)
    "p96_n96_two_tiles": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=4, P=96, G=2, N=96,
                              chunk=64),
    # P 32 (one warp row), N 40 (2 of the 8 warp columns busy, 24 columns zero)
    "p32_n40_idle_warps": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=4, P=32, G=2, N=40,
                               chunk=64),
    # one segment of 79 chunks (NC > 64 S: the auto rule's two-kernel case): a long chain through the fused pass
    "long_row": dict(seg_offsets=[0, 5000], parents=[-1], dtype=torch.bfloat16, H=4, P=64, G=1, N=64, chunk=64,
                     oracle_chunk=64),
}
FUSED_DDECAY_DEPENDENT = {"ddecay", "d_dtA", "ddt", "ddt_raw", "dA_part", "ddt_final", "dA", "ddt_bias"}
FUSED_VS_OLD_TOL = 1e-5
_FUSED_RUNS = {}


def _fused_mode_outputs(mode, ds_fp32, tmp_path_factory):
    """All FUSED_CASES run in one subprocess with TREE_RECURRENCE_SSD_BWD_FUSED_PASS=mode (and
    TREE_RECURRENCE_SSD_DS_FP32=1 when ds_fp32): {case: {output name: tensor}} (cached per module)."""
    key = (mode, ds_fp32)
    if key in _FUSED_RUNS:
        return _FUSED_RUNS[key]
    here = os.path.dirname(os.path.abspath(__file__))
    path = tmp_path_factory.mktemp("fused_pass") / f"mode{mode}_ds{'32' if ds_fp32 else '16'}.pt"
    code = ("import sys, torch; sys.path.insert(0, %r); import test_ssd_fused_bwd_gpu as t; res = {}\n"
            "for case, kw in t.FUSED_CASES.items():\n"
            "    keep = {}; t.run_case(keep=keep, name=case + %r, **kw)\n"
            "    res[case] = {k: v.cpu() for k, v in keep.items() if not k.startswith('_')}\n"
            "torch.save(res, %r)\n" % (here, f" fused_pass={mode}{' ds fp32' if ds_fp32 else ''}", str(path)))
    env_set = {"TREE_RECURRENCE_SSD_BWD_FUSED_PASS": mode}
    if ds_fp32:
        env_set["TREE_RECURRENCE_SSD_DS_FP32"] = "1"
    _FUSED_RUNS[key] = run_saved_subprocess(
        code, path, ("TREE_RECURRENCE_SSD_BWD_V1", "TREE_RECURRENCE_SSD_BWD_TC", "TREE_RECURRENCE_SSD_DS_FP32"), env_set,
        timeout=1200, tail=4000)
    return _FUSED_RUNS[key]


def run_saved_subprocess(code, path, env_drop, env_set, timeout, tail):
    """Runs ``python -c code`` in this folder with ``env_drop`` removed from and ``env_set`` added to this
    process's environment (and TREE_RECURRENCE_TEST_OPS=1: the stage ops, which conftest sets for this process),
    asserts it succeeded (its output's last ``tail`` characters otherwise), and returns what it saved to ``path``."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_set)
    env["TREE_RECURRENCE_TEST_OPS"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=here, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    print(proc.stdout[-(tail * 3 // 4):])
    return torch.load(path)


@pytest.mark.parametrize("ds_fp32", [False, True], ids=["ds16", "ds_fp32"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_pass_vs_two_kernels(tmp_path_factory, case, ds_fp32):
    """The fused reverse local + state pass (=1) against local_bf16 + the state pass (=0), each also against float64
    and bitwise on two runs (inside run_case, in its subprocess): bitwise equal outputs except the ddecay-dependent
    ones (FUSED_VS_OLD_TOL); with 16-bit ds (the default) and with TREE_RECURRENCE_SSD_DS_FP32=1 (the fused pass's
    fp32-ds instantiation)."""
    kw = FUSED_CASES[case]
    assert uses_new_local(kw["chunk"], kw["P"], kw["N"], kw["dtype"]), f"{case}: not on the bf16 / fp16 local path"
    new = _fused_mode_outputs("1", ds_fp32, tmp_path_factory)[case]
    old = _fused_mode_outputs("0", ds_fp32, tmp_path_factory)[case]
    assert new.keys() == old.keys()
    differ = [k for k in new if k not in FUSED_DDECAY_DEPENDENT and not torch.equal(new[k], old[k])]
    diff = {k: rel_rms(new[k], old[k]) for k in FUSED_DDECAY_DEPENDENT
            if k in new and new[k].numel() > 0 and old[k].norm() > 0}
    print(f"[{case}{' ds fp32' if ds_fp32 else ''}] fused pass vs two kernels: not bitwise {differ}; rel RMS "
          + " ".join(f"{k}={v:.2e}" for k, v in diff.items()))
    assert not differ, f"{case}: fused pass not bitwise equal to the two-kernel path in {differ}"
    bad = {k: v for k, v in diff.items() if not v <= FUSED_VS_OLD_TOL}
    assert not bad, f"{case}: fused pass vs two kernels above {FUSED_VS_OLD_TOL}: {bad}"
    if case == "grpo_shape_mixed_z":
        # the two processes did run different kernels: the ddecay partials are summed in another order
        assert not torch.equal(new["ddecay"], old["ddecay"]), f"{case}: ddecay bitwise equal: did the fused pass run?"
