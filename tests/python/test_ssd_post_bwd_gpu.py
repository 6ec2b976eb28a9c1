"""The Half route's bf16 / fp16 post kernel of the fused SSD backward (plugins/mamba2/csrc/ssd_fused/kernels/
ssd_post_bwd.cu) on the GPU, through the test-only op ``ssd_fused_backward_stages``.

For each case the op runs two or three times: the default (the Half route: post_bf16 with dy formed from dout /
z, dz written in z's dtype, dD from its per-chunk partials, the 16-bit ds), with z "recompute_y" (no saved y: the
kernel recomputes y itself, the autograd route of the memory mode TREE_RECURRENCE_SSD_RECOMPUTE_Y=1; every output
but dz the default's bits, dz within STAGE_TOL of it and vs float64) and "tensor_core" (the op's route override 1:
gate + local_tc + post_tc, split-bf16, ~fp32 products). Printed per case (so one run tells which output of which
kernel is wrong):
  * every post-kernel stage (cb, q, v, ddt_direct, d_dtA, ddt, ddt_raw, dA_part) and final gradient (dx, dt, A,
    B, C, D, dt_bias, z, h0) of each variant against its float64 twin (ssd_bwd_reference.py / float64 autograd
    through the token recurrence or the float64 chunked forward);
  * the default vs each other variant, output by output;
and asserted: stages within STAGE_TOL, finals within 1e-2 (the bf16 bound of mamba-ssm's tests), the default vs
tensor_core within STAGE_TOL, bitwise identical outputs on a repeat of the default.

It uses test_ssd_fused_bwd_gpu.py's input maker and constants only.

Run on the GPU:  .venv/bin/python -m pytest tests/python/test_ssd_post_bwd_gpu.py -q -x -s
"""

from __future__ import annotations


import pytest
import torch

import ssd_bwd_reference as ref
from test_ssd_fused_bwd_gpu import (AUTO, DEEP, FINAL_NAMES, MIXED, STAGE_NAMES, TENSOR_CORE, WIDE, make,
                                    oracle_grads, rel_rms)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
POST_STAGES = ["cb", "q", "v", "ddt_direct", "d_dtA", "ddt", "ddt_raw", "dA_part"]
# one bf16 / fp16 MMA per product (operands rounded once to the input type), fp32 accumulation
STAGE_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
FINAL_TOL = 1e-2


def _ops():
    from tree_recurrence import plugins

    return plugins.ops("mamba2")


def _post_inputs(seg_offsets, parents, chunk, dtype, H, P, G, N, D_per_channel, use, h0, seed):
    """A case's float64 inputs (x, B, C, z, dout rounded to ``dtype`` first), A, the optional inputs named in
    ``use`` (None otherwise; ``h0 == "shared"``: one initial state for every root) and the CPU chunk tables."""
    roots = sum(p < 0 for p in parents)
    d = make(seg_offsets[-1], H, P, G, N, 1 if h0 == "shared" else roots, D_per_channel, seed)
    for k in ("x", "B", "C", "z", "dout"):
        d[k] = d[k].to(dtype).double()
    A = -torch.exp(d["A_log"]).float().double()
    D = d["D"] if "D" in use else None
    dt_bias = d["dt_bias"] if "dt_bias" in use else None
    z = d["z"] if "z" in use else None
    h0t = None if "h0" not in use else (d["h0"][0] if h0 == "shared" else d["h0"])
    return d, A, D, dt_bias, z, h0t, ref.chunk_tables(seg_offsets, parents, chunk)


def run_post_case(seg_offsets, parents, dtype=torch.bfloat16, H=4, P=16, G=2, N=16,
                  D_per_channel=False, use=("D", "dt_bias", "z", "h0"), h0="per_root", dt_softplus=True,
                  dt_limit=(0.0, float("inf")), seed=0, oracle_chunk=None, variants=("new", "recompute_y", "tensor_core"),
                  name="", keep=None):
    chunk = 64
    seg_offsets, parents = list(seg_offsets), list(parents)
    if "z" not in use:
        variants = tuple(v for v in variants if v != "recompute_y")
    d, A, D, dt_bias, z, h0t, tabs = _post_inputs(seg_offsets, parents, chunk, dtype, H, P, G, N, D_per_channel, use,
                                                  h0, seed)
    opt = dict(D=D, dt_bias=dt_bias, z=z, initial_state=h0t, dt_softplus=dt_softplus, dt_limit=dt_limit)
    dev = torch.device(DEVICE)
    tabs_dev = ref.chunk_tables(seg_offsets, parents, chunk, dev)
    cu = lambda t, dt_=dtype: None if t is None else t.to(dev, dt_).contiguous()  # noqa: E731
    sv = ref.forward(d["x"], d["dt"], d["B"], d["C"], A, tabs, states_dtype=dtype, **opt)
    saved = dict(dt=sv["dt"].float().double(), Lam=sv["Lam"].float().double(), states=sv["states"],
                 y=sv["y"].to(dtype).double())
    saved_dev = dict(dt=cu(saved["dt"], torch.float32), Lam=cu(saved["Lam"], torch.float32),
                     states=cu(saved["states"]), y=cu(saved["y"]) if z is not None else None)
    ops = _ops()

    def launch(var="new"):
        saved_y = None if var == "recompute_y" else saved_dev["y"]  # no y: the post kernel recomputes it
        out = ops.ssd_fused_backward_stages(
            cu(d["dout"]), cu(d["x"]), cu(d["dt"], torch.float32), cu(d["B"]), cu(d["C"]), cu(A, torch.float32),
            cu(D, torch.float32), cu(dt_bias, torch.float32), cu(z), cu(h0t, torch.float32), list(dt_limit), dt_softplus,
            tabs_dev["gather"], tabs_dev["scatter"], tabs_dev["seg_chunk_offsets"], tabs_dev["parents"],
            tabs_dev["root_index"], tabs_dev["level_segments"], tabs_dev["level_offsets"], tabs_dev["child_offsets"],
            tabs_dev["children"], saved_dev["dt"], saved_dev["Lam"], saved_dev["states"], saved_y,
            TENSOR_CORE if var == "tensor_core" else AUTO)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return dict(zip(STAGE_NAMES + FINAL_NAMES, out))

    # float64 twins: stages on the same saved buffers, finals by autograd
    want = ref.backward(d["dout"], d["x"], d["dt"], d["B"], d["C"], A, tabs, saved, **opt)
    want["dA_part"] = (saved["dt"] * want["d_dtA"]).sum(-1)
    leaves = oracle_grads(d, seg_offsets, parents, D, dt_bias, z, h0t, h0, dt_softplus, dt_limit, oracle_chunk)
    finals = dict(dx="x", ddt_final="dt", dB="B", dC="C", dA="A_log")
    if D is not None:
        finals["dD"] = "D"
    if dt_bias is not None:
        finals["ddt_bias"] = "dt_bias"
    if z is not None:
        finals["dz_final"] = "z"
    if h0t is not None:
        finals["d_initial_state"] = "h0"

    def final_of(got, k):
        v = got[k].double().cpu()
        if k == "dA":
            v = v * A
        if k == "d_initial_state":
            v = v.reshape(leaves["h0"].shape)
        return v

    outs, errs = {}, {}
    for var in variants:
        got = launch(var)
        for k, v in got.items():
            assert torch.isfinite(v).all(), f"{name} [{var}]: {k} is not finite"
        se = {k: rel_rms(got[k], want[k]) for k in POST_STAGES}
        fe = {k: rel_rms(final_of(got, k), leaves[n].grad) for k, n in finals.items()}
        print(f"\n[{name}] {var}: stages vs float64:", " ".join(f"{k}={v:.2e}" for k, v in se.items()))
        print(f"[{name}] {var}: finals vs float64:", " ".join(f"{k}={v:.2e}" for k, v in fe.items()))
        outs[var], errs[var] = got, (se, fe)
        if keep is not None:
            keep[var] = {k: v.cpu() for k, v in got.items()}
        if var in ("new", "recompute_y"):
            again = launch(var)
            diff = [k for k in got if not torch.equal(got[k], again[k])]
            assert not diff, f"{name}: not bitwise identical on two runs: {diff}"

    compare = [k for k in POST_STAGES] + list(finals)
    for other in [v for v in variants if v != "new"]:
        dd = {k: rel_rms(final_of(outs["new"], k) if k in finals else outs["new"][k],
                         final_of(outs[other], k) if k in finals else outs[other][k]) for k in compare}
        print(f"[{name}] new vs {other}:", " ".join(f"{k}={v:.2e}" for k, v in dd.items()))
        if other == "tensor_core":
            bad = {k: v for k, v in dd.items() if not v <= STAGE_TOL[dtype]}
            assert not bad, f"{name}: post_bf16 vs post_tc above {STAGE_TOL[dtype]}: {bad}"
        if other == "recompute_y":  # y recomputed in the kernel: dz within rounding, every other output the same bits
            same = [k for k in outs["new"] if k not in ("dz", "dz_final")]
            diff = [k for k in same if not torch.equal(outs["new"][k], outs[other][k])]
            assert not diff, f"{name}: recomputing y changed outputs other than dz: {diff}"
            assert dd["dz_final"] <= STAGE_TOL[dtype], f"{name}: dz with y recomputed vs saved {dd['dz_final']}"
    if z is not None:  # the kernel's dz (z's dtype) vs the gate's fp32 dz stage (the stage op runs the gate too)
        e = rel_rms(outs["new"]["dz_final"], outs["new"]["dz"])
        print(f"[{name}] new dz vs the gate's dz: {e:.2e}")
        assert e <= 1e-2 if dtype == torch.bfloat16 else e <= 2e-3, f"{name}: dz vs gate {e}"
    for var in variants:
        se, fe = errs[var]
        bad = {k: v for k, v in se.items() if not v <= STAGE_TOL[dtype]}
        assert not bad, f"{name} [{var}]: post stages above {STAGE_TOL[dtype]}: {bad}"
        bad = {k: v for k, v in fe.items() if not v <= FINAL_TOL}
        assert not bad, f"{name} [{var}]: final gradients above {FINAL_TOL}: {bad}"
    return errs


def test_post_model_head_shape_mixed_bf16():
    """P 64, N 128 (a model head shape), 4 heads per group; 1 / 63 / 64 / 65 / 130-token segments; z, D (H, P)."""
    run_post_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, D_per_channel=True,
                  name="post P64 N128 bf16 mixed z D(H,P)")


def test_post_no_z_D_per_head_bf16():
    run_post_case(*MIXED, dtype=torch.bfloat16, H=8, P=64, G=2, N=128, use=("D", "dt_bias", "h0"),
                  name="post P64 N128 bf16 no z, D(H)")


def test_post_one_token_segments_and_fp16():
    run_post_case([0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, -1], dtype=torch.bfloat16, name="post 1-token bf16")
    run_post_case(*MIXED, dtype=torch.float16, H=4, P=16, G=2, N=16, name="post P16 N16 fp16 mixed")


def test_post_pads_wide_shared_h0_fp16():
    """P 40, N 24 (zero-padded 16-column tiles), 12 children, shared h0, softplus off + dt_limit."""
    run_post_case(*WIDE, dtype=torch.float16, H=4, P=40, G=1, N=24, h0="shared", dt_softplus=False,
                  dt_limit=(0.05, 1.5), name="post P40 N24 fp16 wide")


def test_post_model_dims_bf16():
    """Model dims H 128, P 64, N 128, G 8 (16 heads per group) at 330 tokens (around the chunk),
    with and without z; oracle: autograd through the float64 chunked forward (chunk 32)."""
    seg, par = [0, 64, 65, 200, 330], [-1, 0, 0, 2]
    run_post_case(seg, par, dtype=torch.bfloat16, H=128, P=64, G=8, N=128, D_per_channel=True,
                  oracle_chunk=32, name="post model dims bf16 z")
    run_post_case(seg, par, dtype=torch.bfloat16, H=128, P=64, G=8, N=128, use=("D", "dt_bias"),
                  oracle_chunk=32, variants=("new", "tensor_core"), name="post model dims bf16 no z")


def test_post_N64_G1_bf16():
    """P 64, N 64 (2 column blocks per warp of the dC / dB accumulators), G 1 with 8 heads, deep trie."""
    run_post_case(*DEEP, dtype=torch.bfloat16, H=8, P=64, G=1, N=64, D_per_channel=True,
                  name="post P64 N64 G1 bf16 deep")


@pytest.mark.parametrize("P,N,dtype", [(24, 40, torch.bfloat16), (8, 8, torch.float16)], ids=["P24_N40_bf16", "P8_N8_fp16"])
def test_post_small_padded_tiles(P, N, dtype):
    """P and N below one 16-column tile or between tiles (zero-padded operands, idle column tiles)."""
    run_post_case(*MIXED, dtype=dtype, H=4, P=P, G=2, N=N, name=f"post P{P} N{N} {dtype}")


# P, N = 128 is not covered: the tensor-core routes' gate (ssd_bwd_tc_supported: post_tc's shared-memory plan)
# is false there, so fused::backward takes the fp32 CUDA-core kernels and the 16-bit post kernel is not used.
