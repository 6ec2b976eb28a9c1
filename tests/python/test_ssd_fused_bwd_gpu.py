"""The fused SSD backward kernels on the GPU, through the test-only op ``ssd_fused_backward_stages``
(runs the backward from GIVEN saved buffers; its ``route`` / ``fused_pass`` arguments override the
kernel plan, so every route is tested on any shape it takes): every stage's output against its float64 twin in
ssd_bwd_reference.py (relative RMS printed per quantity, so one run tells which kernel is wrong),
then the final gradients of x, dt, A (and A_log), B, C, D, dt_bias, z and the initial states
against float64 autograd through the token-by-token recurrence, and bitwise identical results on
two runs. Cases: mixed / deep / wide tries, 1-token segments, segments around the chunk, an 8k
segment, G 2 with H 4, D (H) and (H, P), z on/off, softplus on/off, dt_limit, shared and per-root
initial states, chunk 64 / 128 / 256, fp32 / bf16 / fp16 inputs; the saved buffers from the fused
forward (op ``ssd_fused_stages``); the routes against each other (Half vs TensorCore, the fused
reverse pass vs local_bf16 + the state pass); the memory mode and dz written over the saved y.

Run on the GPU:  .venv/bin/python -m pytest tests/python/test_ssd_fused_bwd_gpu.py -q -x -s
"""

from __future__ import annotations

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


# kernel plan routes (ssd_fused_bwd.h, the op's ``route`` argument; -1: the plan's choice)
AUTO, CUDA_CORE, TENSOR_CORE, HALF = -1, 0, 1, 2


def uses_tensor_cores(chunk, P, N):
    """Whether the plan may take a tensor-core route (TensorCore or Half): chunk 64, P and N <= 128, post_tc's
    shared-memory plan (PostPlan) within the H200's 227 KiB opt-in; else the fp32 CUDA-core kernels."""
    if chunk != 64 or P > 128 or N > 128:
        return False
    Pp, Np = (P + 15) // 16 * 16, (N + 15) // 16 * 16
    floats = 128 + 2 * 64 * (Np + 4) + 3 * 64 * 68 + 2 * 64 * (Pp + 4) + Pp * (Np + 4) + 8 * 64 + 3 * 8 * 64
    return floats * 4 <= 232448


def uses_half(chunk, P, N, dtype):
    """Whether the plan takes the Half route (local_bf16 or the fused pass, post_bf16; fresh aligned test inputs):
    the tensor-core shapes, 16-bit inputs, P and N multiples of 8."""
    return uses_tensor_cores(chunk, P, N) and dtype in (torch.bfloat16, torch.float16) and P % 8 == 0 and N % 8 == 0


# The Half route's local kernel rounds e^Lam dy once to the input dtype (one MMA per product): the stages that
# depend on the local gradient move by ~2^-9 relative (bf16). CPU emulation of that rounding against the
# float64 stages (MIXED / DEEP / WIDE, P 16..64, N 16..128): local, ds_leave, ddecay, d_roots <= 1.8e-3,
# v <= 2.6e-3, d_dtA <= 3.0e-3, the final gradients <= 3e-4 (fp16: 8x smaller).
LOCAL_STAGES = {"local", "ds_leave", "ddecay", "d_roots", "v", "ddt_direct", "d_dtA", "ddt", "ddt_raw", "dA_part"}
NEW_LOCAL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

# The Half route's post kernel (ssd_post_bwd.cu; its own tests: test_ssd_post_bwd_gpu.py): one MMA per product with
# operands rounded once to the input type.
POST_STAGES = {"cb", "q", "v", "ddt_direct", "d_dtA", "ddt", "ddt_raw", "dA_part"}
NEW_POST_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


# The TensorCore route splits every fp32 operand into bf16 hi + lo and sums hi*hi + hi*lo + lo*hi: products
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
             seed=0, stage_tol=None, final_tol=None, saved_from_forward=False, oracle_chunk=None, name="", keep=None,
             route=AUTO, fused_pass=-1, drop_y=False):
    """The stage op on one case (``route`` / ``fused_pass`` override the kernel plan; ``drop_y``: no saved y, as a
    forward in the memory mode leaves it), checked against float64 stage by stage and end to end, and bitwise on
    a second run. Returns the relative RMS errors (stages, final gradients)."""
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
            tabs_dev["children"], saved_dev["dt"], saved_dev["Lam"], saved_dev["states"],
            None if drop_y else saved_dev["y"], route, fused_pass)

    out = launch()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    got = dict(zip(STAGE_NAMES + FINAL_NAMES, out))
    if keep is not None:
        keep.update(got)
        keep["_saved"], keep["_tabs"] = saved, tabs  # for the 16-bit ds checks (float64 on the CPU)
    for k, v in got.items():
        assert torch.isfinite(v).all(), f"{name}: {k} is not finite"

    # 1) every stage against its float64 twin on the same saved buffers
    want = ref.backward(d["dout"], d["x"], d["dt"], d["B"], d["C"], A, tabs, saved, **opt)
    tc = uses_tensor_cores(chunk, P, N) if route == AUTO else route != CUDA_CORE
    stage_tol = stage_tol if stage_tol is not None else (TC_STAGE_TOL if tc else 1e-4)
    half = uses_half(chunk, P, N, dtype) if route == AUTO else route == HALF
    tol_of = {k: max(stage_tol, NEW_LOCAL_TOL[dtype]) if half and k in LOCAL_STAGES else stage_tol
              for k in STAGE_NAMES}
    if half:  # the 16-bit post kernel too
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
    route_name = "Half" if half else "TensorCore" if tc else "CudaCore"
    print(f"\n[{name}] {route_name} route, stages (rel RMS vs float64 stage reference):",
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
    assert not bad, f"{name}: stages above {stage_tol} (local-dependent stages on the Half route: {tol_of['local']}): {bad}"
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
    """The tensor-core routes at a model head shape (P 64, N 128, 4 heads per group, chunk 64), fp32 and bf16,
    and at P 64 / N 64 with odd sizes (P 40, N 24: zero-padded tiles)."""
    assert uses_tensor_cores(64, 64, 128)
    run_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, chunk=64, name="tc P64 N128 bf16 L64")
    run_case(*DEEP, dtype=torch.float32, H=8, P=64, G=2, N=128, chunk=64, name="tc deep P64 N128 fp32 L64")
    run_case(*WIDE, dtype=torch.float16, H=4, P=40, G=1, N=24, chunk=64, h0="shared", name="tc P40 N24 fp16 L64")


def test_cuda_core_route_at_chunk_64():
    """The CudaCore route (the only backward of chunk 128 / 256 and of P / N beyond the tensor-core plan) forced at
    chunk 64 through the op's route argument, at the tight bound."""
    run_case(*MIXED, chunk=64, route=CUDA_CORE, name="CudaCore fp32 L64")
    run_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, chunk=64, route=CUDA_CORE,
             name="CudaCore P64 N128 bf16 L64")


def test_route_override_refused():
    """An override the inputs do not allow is an error naming it: Half on fp32 inputs, the fused pass off Half."""
    with pytest.raises(ValueError, match="route 2"):
        run_case(*MIXED, chunk=64, route=HALF, name="Half on fp32")
    with pytest.raises(ValueError, match="fused reverse pass"):
        run_case(*MIXED, chunk=64, dtype=torch.bfloat16, H=4, P=20, G=2, N=16, fused_pass=1, name="fused pass at P20")


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


def test_y_recomputed_not_stored(monkeypatch):
    """The memory mode (TREE_RECURRENCE_SSD_RECOMPUTE_Y=1): with z on the Half route the forward stores no pre-gate y
    (fused::forms_y_itself) and the post kernel recomputes it. Checked: (1) the memory a forward leaves for its
    backward is one y smaller than in the default mode (the forward stores y); (2) the gradients vs float64 autograd
    of the token recurrence, and close to the default mode's."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    seg, par = MIXED
    ins = make_inputs(seg[-1], H=4, P=16, G=2, N=16, dtype=torch.bfloat16, device="cuda", roots=2, D_per_channel=True)
    oracle = as_oracle(ins)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    want = run_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])

    def forward(recompute):
        monkeypatch.setenv("TREE_RECURRENCE_SSD_RECOMPUTE_Y", "1" if recompute else "0")  # read per call
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = run_chunked(ins, seg, par, chunk=64)
        torch.cuda.synchronize()
        return y, torch.cuda.memory_allocated() - before

    def grads(y):
        return torch.autograd.grad((y * w.to(y.device, y.dtype)).sum(), [ins[n] for n in names])

    y_std, kept_std = forward(False)
    got_std = grads(y_std)
    del y_std
    y, kept = forward(True)
    y_bytes = ins["x"].numel() * ins["x"].element_size()
    stored = kept_std - kept
    print(f"\n[y recompute] a forward keeps {kept} B (default mode: {kept_std} B); y is {y_bytes} B")
    assert stored >= y_bytes and stored < y_bytes + 1024, f"the memory mode's forward kept {stored} B less, not one y"
    got = grads(y)
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, got, wanted)}
    print("[y recomputed in post] rel RMS vs float64:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad
    close = {n: rel_rms(a.float(), b.float()) for n, a, b in zip(names, got, got_std)}
    bad = {k: v for k, v in close.items() if not v <= 2e-2}
    assert not bad, f"recomputed vs stored y: {bad}"


@pytest.mark.parametrize("route", [HALF, TENSOR_CORE, CUDA_CORE], ids=["half", "tensor_core", "cuda_core"])
def test_backward_without_saved_y(route):
    """A backward that finds no saved y (a forward in the memory mode): on Half the post kernel recomputes y (the
    stage op's gate reads it from the forward kernels); on the other routes the forward kernels recompute it. Every
    stage and gradient vs float64 (the recomputed y rounds like the forward's, not like the float64 twin's saved y:
    the dz stage gets the end-to-end bound)."""
    run_case(*MIXED, dtype=torch.bfloat16, H=4, P=16, G=2, N=16, chunk=64, D_per_channel=True, route=route,
             drop_y=True, stage_tol=2e-2, final_tol=2e-2, name=f"no saved y, route {route}")


@pytest.mark.parametrize("layout", ["mixed", "flat"])
def test_dz_written_over_the_saved_y(layout):
    """Without retain_graph the bf16 post kernel writes dz over the saved pre-gate y (Saved::y_consumable; one
    (T, H, P) buffer less at the backward's peak). Checked: (1) every gradient
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
def test_long_segments_two_kernel_route(layout, dims):
    """Layouts where the segments average more than 64 chunks, so the plan takes local_bf16 + the 16-bit ring state
    pass (state_pass_ring_kernel): every gradient within tolerance of float64 autograd of the token recurrence, and
    bitwise on a second run. One flat row of 130 chunks; a root of 8,000 tokens with a child of 4,300 (its carry
    through ws) and a 1-token child, per-root initial states. PN 256 leaves 192 threads of the block past P N (their
    lanes stay for the shuffles); PN 2048 fills two blocks."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    H, P, G, N = dims
    seg, par = ([0, 8320], [-1]) if layout == "flat" else ([0, 8000, 12300, 12301], [-1, 0, 0])
    ins = make_inputs(seg[-1], H=H, P=P, G=G, N=N, dtype=torch.bfloat16, device="cuda", seed=3)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    w = torch.randn(seg[-1], H, P, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads():
        out = run_chunked(ins, seg, par, chunk=64)
        return torch.autograd.grad((out * w.to("cuda", out.dtype)).sum(), [ins[n] for n in names])

    got, again = grads(), grads()
    for n, a, b in zip(names, got, again):
        assert torch.equal(a, b), f"{n}: not bitwise identical on two runs"
    oracle = as_oracle(ins)
    want = run_oracle(oracle, seg, par)
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, got, wanted)}
    print(f"\n[two-kernel route, {layout} {dims}] rel RMS vs float64:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


@pytest.mark.parametrize("trie", ["mixed", "wide"])
def test_state_pass_scalar_fallback(trie):
    """P N = 35 (not a multiple of 4): the reverse state pass's one-element-per-thread variant (every other
    case runs its 16-byte variant); fp32 CUDA-core path (chunk 128), per-root initial states (d_roots),
    2 children (mixed: a partial batch of the 4 children loaded together) and 12 (wide)."""
    seg, par = MIXED if trie == "mixed" else WIDE
    run_case(seg, par, chunk=128, dtype=torch.float32, H=4, P=5, G=2, N=7, name=f"state pass scalar P5 N7 {trie}")


# ---- the Half route against the TensorCore route (gate + local_tc + post_tc, fp32 ds) on the same inputs ----------

HALF_VS_TC = ["local", "ds_leave", "ddecay", "d_roots", "v", "d_dtA", "ddt_raw", "dA_part"]


def half_vs_tensor_core(seg, par, dtype, tol, **kw):
    """The plan's Half route and the TensorCore route forced (route=1) on the same inputs: each against float64
    inside run_case, then against each other (they differ by the 16-bit rounding of dy, ds and the operands)."""
    name = kw.pop("name")
    half, tc = {}, {}
    run_case(seg, par, dtype=dtype, keep=half, name=f"{name} Half", **kw)
    run_case(seg, par, dtype=dtype, keep=tc, name=f"{name} TensorCore", route=TENSOR_CORE, **kw)
    diff = {k: rel_rms(half[k], tc[k]) for k in HALF_VS_TC if half[k].numel() > 0 and tc[k].norm() > 0}
    print(f"[{name}] Half vs TensorCore (rel RMS):", " ".join(f"{k}={v:.2e}" for k, v in diff.items()))
    bad = {k: v for k, v in diff.items() if not v <= tol}
    assert not bad, f"{name}: Half vs TensorCore routes above {tol}: {bad}"


@pytest.mark.parametrize("use", [("D", "dt_bias", "z", "h0"), ("D",)], ids=["z", "no_z"])
def test_half_model_dims(use):
    """Model head shape (P 64, N 128, 16 heads per group, chunk 64) at a few hundred tokens, z on / off."""
    assert uses_half(64, 64, 128, torch.bfloat16)
    half_vs_tensor_core(*MIXED, torch.bfloat16, 1e-2, H=32, P=64, G=2, N=128, chunk=64, use=use,
                        D_per_channel=True, name=f"bf16 H32 G2 P64 N128 {use[-1]}")


def test_half_tries_and_pads():
    """Deep and wide tries, 1-token segments; zero-padded tiles (P 40 -> 64, N 24 -> 64), fp16."""
    half_vs_tensor_core(*DEEP, torch.bfloat16, 1e-2, H=8, P=64, G=2, N=128, chunk=64, name="deep bf16")
    half_vs_tensor_core(*WIDE, torch.bfloat16, 1e-2, H=4, P=40, G=1, N=24, chunk=64, h0="shared",
                        name="wide bf16 P40 N24")
    half_vs_tensor_core([0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, -1], torch.bfloat16, 1e-2, H=4, P=16, G=2, N=16,
                        chunk=64, name="1-token bf16")
    half_vs_tensor_core(*MIXED, torch.float16, 2e-3, H=8, P=64, G=2, N=128, chunk=64, name="fp16")


def test_tensor_core_route_for_inputs_the_half_kernels_refuse():
    """P 20 (not a multiple of 8) in bf16: the plan takes the TensorCore route."""
    assert not uses_half(64, 20, 16, torch.bfloat16)
    run_case(*MIXED, dtype=torch.bfloat16, H=4, P=20, G=2, N=16, chunk=64, name="TensorCore bf16 P20")


def test_z_of_another_dtype_through_ssd_tree_scan():
    """bf16 x / B / C with an fp32 z (the 16-bit kernels refuse it: the plan takes the TensorCore route) under
    autograd through ssd_tree_scan: the fused path ran (bf16 output), every gradient in its input's dtype and
    against float64 autograd of the token oracle."""
    from test_ssd_chunked import as_oracle, make_inputs, run_chunked, run_oracle

    seg, par = MIXED
    ins = make_inputs(seg[-1], H=4, P=16, G=2, N=16, dtype=torch.bfloat16, device="cuda", roots=2, D_per_channel=True)
    ins["z"] = ins["z"].detach().float().requires_grad_()
    oracle = as_oracle(ins)
    y = run_chunked(ins, seg, par, chunk=64)
    assert y.dtype == torch.bfloat16, "ssd_tree_scan did not take the fused path"
    want = run_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    got = torch.autograd.grad((y * w.to(y.device, y.dtype)).sum(), [ins[n] for n in names])
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    for n, a in zip(names, got):
        assert a.dtype == ins[n].dtype and a.shape == ins[n].shape, n
    errors = {n: rel_rms(a.float(), b) for n, a, b in zip(names, got, wanted)}
    errors["y"] = rel_rms(y, want)
    print("\n[z fp32, x bf16] rel RMS vs float64 token oracle:", " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


def test_z_with_a_leading_unit_dim_through_ssd_tree_scan():
    """z given as (1, T, H, P) (the op's schema takes it): the fused forward and backward run as with z (T, H, P),
    the output and every gradient bitwise equal, dz in z's own shape."""
    from test_ssd_chunked import make_inputs, run_chunked

    seg, par = MIXED
    ins = make_inputs(seg[-1], H=4, P=16, G=2, N=16, dtype=torch.bfloat16, device="cuda", roots=2, D_per_channel=True)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    w = torch.randn(seg[-1], 4, 16, generator=torch.Generator().manual_seed(13)).to("cuda", torch.bfloat16)
    runs = []
    for unit_dim in (False, True):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in ins.items()}
        if unit_dim:
            leaves["z"] = leaves["z"].detach().unsqueeze(0).requires_grad_()
        y = run_chunked(leaves, seg, par, chunk=64)
        assert y.dtype == torch.bfloat16, "ssd_tree_scan did not take the fused path"
        runs.append((y, torch.autograd.grad((y * w).sum(), [leaves[n] for n in names])))
    (y3, g3), (y4, g4) = runs
    assert torch.equal(y3, y4)
    for n, a, b in zip(names, g3, g4):
        if n == "z":
            assert b.shape == (1, *a.shape), b.shape
            b = b[0]
        assert torch.equal(a, b), n


# ---- the state gradient ds in the input type on the Half route ----------------------------------------------------
# The Half route stores ds_local / ds_leave in x's 16-bit type (local_bf16 rounds its fp32 accumulators once, the
# state pass widens them, carries in fp32, writes ds_leave rounded and takes ddecay / d_roots from the fp32 carry).
# Expected (CPU emulation, test_ssd_post_bwd_emulation.py): the roundings move ds_leave by ~2e-3 relative in bf16
# (fp16 ~8x less) and the final gradients by < 3e-3; the stage / final tolerances of run_case hold.
DS16_ROUND = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # unit roundoff of round-to-nearest
DS16_CASES = {
    "model_z_bf16": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=32, P=64, G=2, N=128,
                         chunk=64, D_per_channel=True),
    "deep_no_z_bf16": dict(seg_offsets=DEEP[0], parents=DEEP[1], dtype=torch.bfloat16, H=8, P=64, G=2, N=128,
                           chunk=64, use=("D", "dt_bias", "h0")),
    "wide_pads_fp16": dict(seg_offsets=WIDE[0], parents=WIDE[1], dtype=torch.float16, H=4, P=40, G=1, N=24,
                           chunk=64, h0="shared"),
}


@pytest.mark.parametrize("case", sorted(DS16_CASES))
def test_ds_in_input_type(case):
    """The 16-bit ds against float64 (run_case) and against the float64 state pass of its own rounded locals
    (element-wise: one rounding of ds_leave; ddecay and d_roots from the fp32 carry, 1e-5)."""
    kw = DS16_CASES[case]
    dtype = kw["dtype"]
    assert uses_half(kw["chunk"], kw["P"], kw["N"], dtype)
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


# ---- the fused reverse local + state pass (kernels/ssd_state_pass_bwd.cu) against local_bf16 + the state pass ------
# The op's fused_pass argument forces either (the plan: fused where the segments average at most 64 chunks). Each run
# checks its outputs against float64 and bitwise on two runs (run_case); here the two are compared output by output.
# The fused pass reproduces local_bf16's products and the state pass's fmaf chain and children's sums, so every output
# is bitwise the two-kernel path's except ddecay (per-warp partials of another layout: fp32 summation order) and what
# it feeds (d(dt A) -> ddt, ddt_raw, dA partials, dt / A / dt_bias gradients): those within FUSED_VS_TWO_TOL.
FUSED_CASES = {
    # model head shape (P 64, N 128, 16 heads per group), segments of 1 / 63 / 64 / 65 / 130 tokens, 2 roots with
    # their own initial states, z, D (H, P)
    "model_shape_mixed_z": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=32, P=64, G=2, N=128,
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
    # P 128 (4 warp rows), N 64 (P 128 / N 128 is off the tensor-core routes: PostPlan's shared memory)
    "p128_n64": dict(seg_offsets=[0, 200, 300], parents=[-1, 0], dtype=torch.bfloat16, H=4, P=128, G=2, N=64,
                     chunk=64),
    # P 96 (3 of the 4 warp rows busy), N 96: two N tiles of 64 (the second half empty; 16 ddecay partials)
    "p96_n96_two_tiles": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=4, P=96, G=2, N=96,
                              chunk=64),
    # P 32 (one warp row), N 40 (2 of the 8 warp columns busy, 24 columns zero)
    "p32_n40_idle_warps": dict(seg_offsets=MIXED[0], parents=MIXED[1], dtype=torch.bfloat16, H=4, P=32, G=2, N=40,
                               chunk=64),
    # one segment of 79 chunks (NC > 64 S: the plan's two-kernel case): a long chain through the fused pass
    "long_row": dict(seg_offsets=[0, 5000], parents=[-1], dtype=torch.bfloat16, H=4, P=64, G=1, N=64, chunk=64,
                     oracle_chunk=64),
}
FUSED_DDECAY_DEPENDENT = {"ddecay", "d_dtA", "ddt", "ddt_raw", "dA_part", "ddt_final", "dA", "ddt_bias"}
FUSED_VS_TWO_TOL = 1e-5


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_pass_vs_two_kernels(case):
    """The fused reverse local + state pass (fused_pass=1) against local_bf16 + the state pass (fused_pass=0): bitwise
    equal outputs except the ddecay-dependent ones (FUSED_VS_TWO_TOL)."""
    kw = FUSED_CASES[case]
    assert uses_half(kw["chunk"], kw["P"], kw["N"], kw["dtype"]), f"{case}: not on the Half route"
    fused, two = {}, {}
    run_case(keep=fused, name=f"{case} fused pass", fused_pass=1, **kw)
    run_case(keep=two, name=f"{case} two kernels", fused_pass=0, **kw)
    names = [k for k in fused if not k.startswith("_")]
    differ = [k for k in names if k not in FUSED_DDECAY_DEPENDENT and not torch.equal(fused[k], two[k])]
    diff = {k: rel_rms(fused[k], two[k]) for k in FUSED_DDECAY_DEPENDENT
            if k in fused and fused[k].numel() > 0 and two[k].norm() > 0}
    print(f"[{case}] fused pass vs two kernels: not bitwise {differ}; rel RMS "
          + " ".join(f"{k}={v:.2e}" for k, v in diff.items()))
    assert not differ, f"{case}: fused pass not bitwise equal to the two-kernel path in {differ}"
    bad = {k: v for k, v in diff.items() if not v <= FUSED_VS_TWO_TOL}
    assert not bad, f"{case}: fused pass vs two kernels above {FUSED_VS_TWO_TOL}: {bad}"
    if case == "model_shape_mixed_z":
        # the two runs did take different kernels: the ddecay partials are summed in another order
        assert not torch.equal(fused["ddecay"], two["ddecay"]), f"{case}: ddecay bitwise equal: did the fused pass run?"
