"""GPU tests of the fused SSD (Mamba2) forward (plugins/mamba2/csrc/ssd_fused), skipped without CUDA.

* every stage of the forward (test-only op ``ssd_fused_stages``: out, dt, Lam, chunk states, states,
  y) against the float64 per-stage reference (ssd_chunk_reference.py) on the same bf16 / fp16 values:
  the relative RMS error of each stage is printed (run with -s), so one run tells which kernel is off;
* ``ssd_tree_scan`` (which dispatches to the fused kernels for bf16 / fp16 on CUDA) against the float64
  token oracle ``ssd_token_scan``, on random and crafted tries (deep, wide, 1-token segments, segments
  around each chunk size, an 8k segment), G 2 with H 4, D (H) and (H, P), z on / off, dt_bias +
  softplus + dt_limit, per-root and shared initial states;
* chunk 64 / 128 / 256 agree up to rounding; two runs are bitwise identical; TREE_RECURRENCE_FUSED=0 runs
  the composite;
* the benchmark's argument pattern (initial_state None, fp32 A / D / dt_bias requiring grad) under
  no_grad and through autograd, and absent optionals' gradient slots;
* the forward's kernel plan (kernels/params.h: FwdPlan), each variant forced through the stages op's
  ``plan`` argument: the fused chunk-state + state pass against the three-kernel path (float64 each, up to
  fp32 summation order between them); the pipelined chunk-state scan bitwise against the three-kernel path
  in every stage; the grouped chunk scan bitwise against the per-head one (odd P / N, 1-token segments,
  fp16, ~77k-token rows with several head slices per block); the op on shapes that select each variant
  equal to that variant forced; forced kernels the shapes do not take are refused.

Run on the GPU:  .venv/bin/python -m pytest tests/python/test_ssd_fused_gpu.py -q -x -s
"""

from __future__ import annotations

import pytest
import torch

import ssd_chunk_reference as ref
from test_ssd_chunked import chunk_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")

FAMILY = "mamba2"
STAGES = ("out", "dt", "Lam", "chunk_states", "states", "y")
# bf16: mamba-ssm's own test bar for the combined chunk scan is rtol 1e-2 / atol 5e-2 class; here the
# relative RMS against float64 (one rounding of x, B, C and of the MMA operands / the stored states).
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
STAGE_TOL = {torch.bfloat16: dict(out=1.5e-2, dt=1e-6, Lam=1e-5, chunk_states=1e-2, states=1e-2, y=1.5e-2),
             torch.float16: dict(out=3e-3, dt=1e-6, Lam=1e-5, chunk_states=2e-3, states=2e-3, y=3e-3)}


def _ops():
    from tree_recurrence import plugins

    return plugins.ops(FAMILY)


def rel_rms(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30))


def offsets_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def random_trie(seed, segments, max_len):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (segments,), generator=g).tolist()
    parents = [-1] + [int(torch.randint(-1, s, (1,), generator=g)) for s in range(1, segments)]
    # DFS pre-order is not needed by the tables (parents before children is)
    return offsets_of(lengths), parents


def make(T, H=4, P=32, G=2, N=16, dtype=torch.bfloat16, roots=1, D_per_channel=False, seed=0, shared_h0=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = dict(x=r(T, H, P), dt=r(T, H) * 0.5 - 1.0, B=r(T, G, N), C=r(T, G, N), z=r(T, H, P),
               D=r(H, P) if D_per_channel else r(H), dt_bias=r(H) * 0.5,
               h0=r(H, P, N) if shared_h0 else r(roots, H, P, N))
    A = -(torch.rand(H, generator=g, dtype=torch.float64) * 2.0 + 0.1)
    out = {k: v.to("cuda", dtype) for k, v in ins.items()}
    out["A"] = A.to("cuda", torch.float32)
    out["dt_bias"] = out["dt_bias"].float()  # the models keep dt_bias, A, D in fp32
    out["D"] = out["D"].float()
    return out


def call(op, ins, tabs, use=("D", "dt_bias", "z", "h0"), dt_limit=(0.0, float("inf")), softplus=True, plan=None):
    """``op`` (ssd_tree_scan or ssd_fused_stages) on ``ins``; ``plan`` (stages op only): the forced plan parts
    (fused_pass, pipelined, three_kernel, group_scan, head_scan; comma-separated)."""
    extra = {} if plan is None else {"plan": plan}
    return op(ins["x"], ins["dt"], ins["B"], ins["C"], tabs["gather"], tabs["scatter"], tabs["seg_chunk_offsets"],
              tabs["parents"], tabs["root_index"], tabs["level_segments"], tabs["level_offsets"], tabs["child_offsets"],
              tabs["children"], ins["h0"] if "h0" in use else None, A=ins["A"], dt_limit=list(dt_limit),
              D=ins["D"] if "D" in use else None, dt_bias=ins["dt_bias"] if "dt_bias" in use else None,
              dt_softplus=softplus, z=ins["z"] if "z" in use else None, **extra)


def stages(ins, tabs, use=("D", "dt_bias", "z", "h0"), plan=None, **kw):
    """The stages op's outputs by name."""
    return dict(zip(STAGES, call(_ops().ssd_fused_stages, ins, tabs, use, plan=plan, **kw)))


def reference(ins, tabs, use=("D", "dt_bias", "z", "h0"), dt_limit=(0.0, float("inf")), softplus=True):
    cpu = {k: v.detach().cpu() for k, v in ins.items()}
    t = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in tabs.items()}
    return ref.stages(cpu["x"], cpu["dt"], cpu["B"], cpu["C"], cpu["A"], t, D=cpu["D"] if "D" in use else None,
                      dt_bias=cpu["dt_bias"] if "dt_bias" in use else None, dt_softplus=softplus, dt_limit=dt_limit,
                      z=cpu["z"] if "z" in use else None, initial_state=cpu["h0"] if "h0" in use else None)


def oracle(ins, seg_offsets, parents, use=("D", "dt_bias", "z", "h0"), dt_limit=(0.0, float("inf")), softplus=True):
    c = {k: v.detach().cpu().double() for k, v in ins.items()}
    return _ops().ssd_token_scan(
        c["x"], c["dt"], c["B"], c["C"], torch.as_tensor(seg_offsets), torch.as_tensor(parents),
        c["h0"] if "h0" in use else None, A=c["A"], dt_limit=list(dt_limit), D=c["D"] if "D" in use else None,
        dt_bias=c["dt_bias"] if "dt_bias" in use else None, dt_softplus=softplus, z=c["z"] if "z" in use else None)


def check_stages(seg_offsets, parents, chunk=64, dtype=torch.bfloat16, use=("D", "dt_bias", "z", "h0"),
                 dt_limit=(0.0, float("inf")), label="", plan=None, **kw):
    roots = sum(p < 0 for p in parents)
    ins = make(seg_offsets[-1], dtype=dtype, roots=roots, **kw)
    tabs = chunk_tables(seg_offsets, parents, chunk, "cuda")
    got = stages(ins, tabs, use, plan, dt_limit=dt_limit)
    want = reference(ins, tabs, use, dt_limit)
    errors = {}
    for name in STAGES:
        if name == "y" and "z" not in use:
            assert got["y"].numel() == 0
            continue
        g = got[name]
        assert torch.isfinite(g.float()).all(), (label, name)
        errors[name] = rel_rms(g, want[name])
    print(f"\n[ssd fused stages {label} L={chunk} {dtype} plan={plan}] "
          + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= STAGE_TOL[dtype][k]}
    assert not bad, (label, chunk, plan, bad)
    return ins, tabs, got


CRAFTED = {
    # segments around each chunk size, in a chain and as siblings
    "around_chunks": (offsets_of([63, 64, 65, 127, 128, 129, 255, 256, 257, 1]), [-1, 0, 1, 2, 3, 3, 5, -1, 7, 8]),
    "one_token": (offsets_of([1] * 20), [-1] + list(range(19))),
    "deep": (offsets_of([5, 17, 40, 1, 33, 8, 2, 29, 11, 64, 3, 21, 130, 7]), [-1] + list(range(13))),
    "wide": (offsets_of([70] + [1 + 9 * i for i in range(16)] + [300, 5, 200]), [-1] + [0] * 16 + [-1, 17, 17]),
}


@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("name", list(CRAFTED))
def test_stages_bf16(name, chunk):
    check_stages(*CRAFTED[name], chunk=chunk, label=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(4, 64, 2, 128), (4, 128, 1, 256), (2, 8, 2, 8), (8, 24, 4, 40)],
                         ids=["P64N128", "P128N256", "P8N8", "P24N40"])
def test_stages_dims(dtype, dims):
    H, P, G, N = dims
    off, par = random_trie(1, 12, 300)
    check_stages(off, par, chunk=128, dtype=dtype, H=H, P=P, G=G, N=N, label=f"H{H}P{P}G{G}N{N}", D_per_channel=True)


@pytest.mark.parametrize("variant", ["no_optionals", "no_z", "dt_limit", "shared_h0", "no_softplus_z_fp32"])
def test_stages_variants(variant):
    off, par = CRAFTED["around_chunks"]
    use, dt_limit, kw = ("D", "dt_bias", "z", "h0"), (0.0, float("inf")), {}
    if variant == "no_optionals":
        use = ()
    elif variant == "no_z":
        use = ("D", "dt_bias", "h0")
    elif variant == "dt_limit":
        dt_limit = (0.05, 0.6)
    elif variant == "shared_h0":
        kw["shared_h0"] = True
    if variant != "no_softplus_z_fp32":
        check_stages(off, par, chunk=64, use=use, dt_limit=dt_limit, label=variant, **kw)
        return
    roots = sum(p < 0 for p in par)
    ins = make(off[-1], roots=roots)
    ins["z"] = ins["z"].float()
    ins["dt"] = ins["dt"].float().abs() * 0.3
    tabs = chunk_tables(off, par, 64, "cuda")
    got = stages(ins, tabs, softplus=False)
    want = reference(ins, tabs, softplus=False)
    errors = {k: rel_rms(got[k], want[k]) for k in STAGES}
    print(f"\n[ssd fused stages {variant}] " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert all(errors[k] <= STAGE_TOL[torch.bfloat16][k] for k in STAGES), errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_op_matches_token_oracle_random_tries(dtype, seed):
    off, par = random_trie(seed, 40, 200)
    roots = sum(p < 0 for p in par)
    ins = make(off[-1], dtype=dtype, roots=roots, seed=seed, D_per_channel=seed == 1)
    tabs = chunk_tables(off, par, 64, "cuda")
    y = call(_ops().ssd_tree_scan, ins, tabs)
    assert y.dtype == dtype  # the fused path returns x's dtype (ssd_chunked.h)
    # the fused path ran: the op's output is the stages op's out
    st = call(_ops().ssd_fused_stages, ins, tabs)
    assert torch.equal(y, st[0]), "ssd_tree_scan did not take the fused path"
    want = oracle(ins, off, par)
    e = rel_rms(y, want)
    print(f"\n[ssd fused vs token oracle seed={seed} {dtype}] rel_rms={e:.2e}")
    assert e <= TOL[dtype]


def test_8k_segment():
    off, par = [0, 8192, 8192 + 100, 8192 + 300], [-1, 0, 0]
    for chunk in (64, 256):
        ins, tabs, got = check_stages(off, par, chunk=chunk, label="8k", H=2, P=64, G=1, N=64)
    want = oracle(ins, off, par)
    e = rel_rms(got["out"], want)
    print(f"\n[ssd fused 8k vs token oracle] rel_rms={e:.2e}")
    assert e <= TOL[torch.bfloat16]


def test_chunk_sizes_agree_and_runs_repeat_bitwise():
    off, par = random_trie(5, 30, 400)
    roots = sum(p < 0 for p in par)
    ins = make(off[-1], roots=roots, H=4, P=64, G=2, N=64)
    outs = {}
    for chunk in (64, 128, 256):
        tabs = chunk_tables(off, par, chunk, "cuda")
        a = call(_ops().ssd_tree_scan, ins, tabs)
        b = call(_ops().ssd_tree_scan, ins, tabs)
        assert torch.equal(a, b), f"two runs differ at chunk {chunk}"
        outs[chunk] = a
    want = oracle(ins, off, par)
    errs = {c: rel_rms(o, want) for c, o in outs.items()}
    between = {c: rel_rms(outs[c], outs[64]) for c in (128, 256)}
    print(f"\n[ssd fused chunk sizes] vs oracle {errs}, vs chunk 64 {between}")
    assert all(e <= TOL[torch.bfloat16] for e in errs.values()), errs
    assert all(e <= TOL[torch.bfloat16] for e in between.values()), between


def test_disabled_by_env_runs_the_composite(monkeypatch):
    off, par = CRAFTED["deep"]
    ins = make(off[-1])
    tabs = chunk_tables(off, par, 64, "cuda")
    fused = call(_ops().ssd_tree_scan, ins, tabs)
    monkeypatch.setenv("TREE_RECURRENCE_FUSED", "0")
    composite = call(_ops().ssd_tree_scan, ins, tabs)
    e = rel_rms(fused, composite)
    print(f"\n[ssd fused vs composite] rel_rms={e:.2e}")
    assert e <= TOL[torch.bfloat16]
    assert not torch.equal(fused, composite)  # the variable really changed the path


# The benchmark's call (benchmarks/ssd_bench.py): initial_state None and the other optionals absent or present
# (absent optionals reach ScanFn::apply as std::nullopt, never as undefined tensors).
BENCH_TRIE = ([0, 1, 64, 128, 193, 194, 324, 389, 520], [-1, 0, 1, 0, -1, 4, 4, 6])


def bench_inputs(T, H=4, P=32, G=2, N=16, seed=11):
    """benchmarks/ssd_bench.py's inputs(): x, dt, B, C, z bf16; A < 0, D (H), dt_bias (H) fp32."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bf = lambda v: v.to("cuda", torch.bfloat16)  # noqa: E731
    return dict(x=bf(r(T, H, P)), dt=bf(r(T, H)), B=bf(r(T, G, N) * N ** -0.5), C=bf(r(T, G, N) * N ** -0.5),
                z=bf(r(T, H, P)), A=(-torch.rand(H, generator=g) * 4 - 0.5).cuda(),
                D=torch.rand(H, generator=g).cuda(), dt_bias=(torch.randn(H, generator=g) * 0.5 - 2.0).cuda())


def bench_call(ins, tabs, use=("D", "dt_bias", "z")):
    return _ops().ssd_tree_scan(
        ins["x"], ins["dt"], ins["B"], ins["C"], tabs["gather"], tabs["scatter"], tabs["seg_chunk_offsets"],
        tabs["parents"], tabs["root_index"], tabs["level_segments"], tabs["level_offsets"], tabs["child_offsets"],
        tabs["children"], None, A=ins["A"], dt_limit=[0.0, float("inf")], D=ins["D"] if "D" in use else None,
        dt_bias=ins["dt_bias"] if "dt_bias" in use else None, dt_softplus=True, z=ins["z"] if "z" in use else None)


def bench_oracle(leaves, seg, par, use=("D", "dt_bias", "z")):
    import ssd_bwd_reference as bref

    return bref.token_scan(leaves["x"], leaves["dt"], leaves["B"], leaves["C"], leaves["A"], seg, par,
                           D=leaves["D"] if "D" in use else None, dt_bias=leaves["dt_bias"] if "dt_bias" in use else None,
                           z=leaves["z"] if "z" in use else None, initial_state=None, dt_softplus=True,
                           dt_limit=(0.0, float("inf")))


@pytest.mark.parametrize("chunk", [64, 128])
def test_benchmark_argument_pattern(chunk):
    """initial_state None; x, dt, B, C, z bf16 and A, D (H), dt_bias fp32 all requiring grad; dt_limit (0, inf);
    softplus. Forward under no_grad (== the stages op's out, vs the float64 token oracle), then every gradient
    through autograd vs float64 autograd of the token recurrence."""
    seg, par = BENCH_TRIE
    tabs = chunk_tables(seg, par, chunk, "cuda")
    base = bench_inputs(seg[-1])
    names = ["x", "dt", "B", "C", "z", "D", "dt_bias", "A"]
    ins = {k: v.detach().clone().requires_grad_() for k, v in base.items()}
    with torch.no_grad():
        y0 = bench_call(ins, tabs)
    assert y0.dtype == torch.bfloat16 and not y0.requires_grad  # the fused path returns x's dtype
    st = _ops().ssd_fused_stages(ins["x"].detach(), ins["dt"].detach(), ins["B"].detach(), ins["C"].detach(),
                                 tabs["gather"], tabs["scatter"], tabs["seg_chunk_offsets"], tabs["parents"],
                                 tabs["root_index"], tabs["level_segments"], tabs["level_offsets"],
                                 tabs["child_offsets"], tabs["children"], None, A=base["A"],
                                 dt_limit=[0.0, float("inf")], D=base["D"], dt_bias=base["dt_bias"],
                                 dt_softplus=True, z=base["z"])
    assert torch.equal(y0, st[0]), "no_grad forward did not take the fused path"
    y = bench_call(ins, tabs)
    assert y.requires_grad and torch.equal(y.detach(), y0), "grad-mode forward differs from the no_grad one"
    oracle = {k: v.detach().cpu().double().requires_grad_() for k, v in base.items()}
    want = bench_oracle(oracle, seg, par)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((y.float() * w.to(y.device, torch.float32)).sum(), [ins[n] for n in names])
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    errors = {"y": rel_rms(y, want)}
    for n, a, b in zip(names, got, wanted):
        assert a is not None and a.shape == ins[n].shape and a.dtype == ins[n].dtype, n
        errors[n] = rel_rms(a.float(), b)
    print(f"\n[benchmark pattern L{chunk}] rel RMS vs float64 token oracle:",
          " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


def test_absent_optionals_gradient_slots():
    """D and initial_state absent, dt_bias present but not requiring grad, A not requiring grad: every gradient
    lands on its own input."""
    seg, par = BENCH_TRIE
    use = ("dt_bias", "z")
    tabs = chunk_tables(seg, par, 64, "cuda")
    base = bench_inputs(seg[-1], seed=12)
    names = ["x", "dt", "B", "C", "z"]
    ins = {k: v.detach().clone().requires_grad_(k in names) for k, v in base.items()}
    y = bench_call(ins, tabs, use)
    oracle = {k: v.detach().cpu().double().requires_grad_(k in names) for k, v in base.items()}
    want = bench_oracle(oracle, seg, par, use)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = torch.autograd.grad((y.float() * w.to(y.device, torch.float32)).sum(), [ins[n] for n in names])
    wanted = torch.autograd.grad((want * w).sum(), [oracle[n] for n in names])
    errors = {"y": rel_rms(y, want)}
    errors.update({n: rel_rms(a.float(), b) for n, a, b in zip(names, got, wanted)})
    print("\n[absent optionals] rel RMS vs float64 token oracle:",
          " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= 2e-2}
    assert not bad, bad


# the pipelined chunk-state scan against the three-kernel path, both forced: (layout, dims) pairs; long layouts
# at two dims, the crafted tries (short segments: the plan's own choice is the fused pass) at the odd ones too
PIPE_LAYOUTS = {
    "flat_129": (offsets_of([8200]), [-1]),                               # 129 chunks in a row
    "long_tree": (offsets_of([5000, 3000, 2000, 700, 64]), [-1, 0, 0, 2, -1]),  # levels, a leaf root, h0 per root
    "around_chunks": CRAFTED["around_chunks"],
    "one_token": CRAFTED["one_token"],
    "wide": CRAFTED["wide"],
}
PIPE_CASES = [("flat_129", (4, 64, 2, 128)), ("flat_129", (8, 24, 4, 40)), ("long_tree", (4, 64, 2, 128)),
              ("long_tree", (4, 128, 2, 256)), ("around_chunks", (2, 8, 2, 8)), ("around_chunks", (4, 56, 2, 72)),
              ("one_token", (4, 64, 2, 128)), ("wide", (6, 32, 3, 64))]




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,dims", PIPE_CASES, ids=[f"{n}-H{d[0]}P{d[1]}G{d[2]}N{d[3]}" for n, d in PIPE_CASES])
def test_pipelined_pass_bitwise_three_kernel(name, dims, dtype):
    """Chunk 64: the pipelined chunk-state scan and the three-kernel path (both forced) pass the float64 stage
    check and give every stage bitwise equal (the same MMA on the same tiles, the same fmaf per chunk in order);
    with initial states, D, dt_bias and z, and without h0 / dt_bias."""
    H, P, G, N = dims
    off, par = PIPE_LAYOUTS[name]
    for use in (("D", "dt_bias", "z", "h0"), ("D", "z")):
        runs = {plan: check_stages(off, par, chunk=64, dtype=dtype, use=use, H=H, P=P, G=G, N=N, plan=plan,
                                   label=f"{name} {len(use)}")[2] for plan in ("three_kernel", "pipelined")}
        diff = [k for k in STAGES if not torch.equal(runs["pipelined"][k], runs["three_kernel"][k])]
        assert not diff, (name, dims, use, {k: rel_rms(runs["pipelined"][k], runs["three_kernel"][k]) for k in diff})


@pytest.mark.parametrize("name", ["around_chunks", "wide", "one_token"])
@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_fused_pass_vs_three_kernel_path(name, chunk):
    """The fused chunk-state + state-pass kernel and the three-kernel path (both forced): each against the float64
    stage reference (check_stages), dt / Lam bitwise equal (same arithmetic), states and out equal up to fp32
    summation order, per-root h0 and none."""
    off, par = CRAFTED[name]
    for use in (("D", "dt_bias", "z", "h0"), ("D", "z")):
        fused, three = (check_stages(off, par, chunk=chunk, use=use, label=f"{name} {len(use)}", H=4, P=64, G=2, N=128,
                                     plan=plan)[2] for plan in ("fused_pass", "three_kernel"))
        assert torch.equal(fused["dt"], three["dt"]) and torch.equal(fused["Lam"], three["Lam"])
        e = {k: rel_rms(fused[k], three[k]) for k in ("states", "out")}
        print(f"[fused pass vs 3-kernel {name} L={chunk}] " + " ".join(f"{k}={v:.2e}" for k, v in e.items()))
        assert all(v <= 1e-2 for v in e.values()), e


# shapes that select each state path (kernels::fwd_plan): (offsets, parents), chunk, the path
PLAN_ROWS = {
    "trie_L64": (random_trie(9, 30, 300), 64, "fused_pass"),      # segments of a few chunks
    "trie_L128": (random_trie(9, 30, 300), 128, "fused_pass"),
    "flat_L64": ((offsets_of([20000]), [-1]), 64, "pipelined"),    # 313 chunks in one segment
    "flat_L256": ((offsets_of([20000]), [-1]), 256, "three_kernel"),  # 79 chunks in one segment
}


@pytest.mark.parametrize("case", list(PLAN_ROWS))
def test_plan_by_shape(case):
    """The op on shapes that select each state path: two runs bitwise equal, its output equal to the stages op's
    out under the plan's own choice and under that path forced, within the bf16 bar of the float64 token oracle."""
    (off, par), chunk, path = PLAN_ROWS[case]
    ins = make(off[-1], roots=sum(p < 0 for p in par), H=4, P=64, G=2, N=128, seed=5)
    tabs = chunk_tables(off, par, chunk, "cuda")
    a = call(_ops().ssd_tree_scan, ins, tabs)
    assert torch.equal(a, call(_ops().ssd_tree_scan, ins, tabs)), "two runs differ"
    assert torch.equal(a, stages(ins, tabs)["out"]), "the op and the stages op took different plans"
    assert torch.equal(a, stages(ins, tabs, plan=path)["out"]), f"the plan did not take {path}"
    e = rel_rms(a, oracle(ins, off, par))
    print(f"\n[plan {case}: {path}] vs token oracle {e:.2e}")
    assert e <= TOL[torch.bfloat16]


def test_plan_refuses_what_the_shapes_do_not_take():
    """Forced plan parts the shapes do not take raise a ValueError (the pipelined scan at chunk 128, the grouped
    scan at P 128, an unknown name); parts combine (three_kernel,head_scan equals pipelined bitwise)."""
    off, par = CRAFTED["deep"]
    ins = make(off[-1], H=4, P=128, G=2, N=64)
    for chunk, plan, match in ((128, "pipelined", "pipelined"), (64, "group_scan", "grouped"),
                               (64, "fused_pass,bogus", "unknown plan part")):
        with pytest.raises(ValueError, match=match):
            stages(ins, chunk_tables(off, par, chunk, "cuda"), plan=plan)
    tabs = chunk_tables(off, par, 64, "cuda")
    a, b = stages(ins, tabs, plan="three_kernel,head_scan"), stages(ins, tabs, plan="pipelined")
    assert all(torch.equal(a[k], b[k]) for k in STAGES)


# the chunk scans: the grouped kernel (chunk 64, P <= 64, N <= 128 or <= 192 at P <= 32) and the per-head one
SCAN_DIMS = [(16, 64, 2, 128), (8, 64, 1, 128), (16, 32, 4, 64), (2, 8, 2, 8), (8, 24, 4, 40), (6, 32, 3, 64),
             (4, 56, 2, 72), (4, 32, 2, 176), (4, 64, 4, 256), (4, 128, 2, 64), (4, 128, 1, 256)]
SCAN_IDS = ["H16P64G2N128", "G1", "H16G4", "P8N8", "P24N40", "H6P32G3", "P56N72", "P32N176", "P64N256", "P128N64",
            "P128N256"]
SCAN_LAYOUTS = [("around_chunks", 64), ("one_token", 64), ("wide", 64), ("random", 64), ("around_chunks", 128)]
SCAN_TRIES = {**CRAFTED, "random": random_trie(3, 16, 200)}
SCAN_USES = ((("D", "dt_bias", "z", "h0"), False), (("dt_bias", "z"), True), (("D", "h0"), False), ((), False))


def group_scan_takes(chunk, P, N):
    """Whether the grouped chunk scan takes these dims (kernels::ssd_chunk_scan_group_supported, H % G == 0)."""
    return chunk == 64 and P <= 64 and -(-N // 64) * 64 <= (192 if P <= 32 else 128)


def scan_kernels_agree(ins, tabs, use, want, dtype, label):
    """The stages under the plan's own chunk scan, the per-head one forced and (where it fits) the grouped one
    forced: out and y within STAGE_TOL of the float64 ``want``, and bitwise equal to each other (the same
    arithmetic per element; -0 and +0 compare equal). Where the grouped scan does not fit, forcing it raises."""
    chunk, P, N = tabs["gather"].shape[1], ins["x"].shape[2], ins["B"].shape[2]
    plans = [None, "head_scan"]
    if group_scan_takes(chunk, P, N):
        plans.append("group_scan")
    else:
        with pytest.raises(ValueError, match="grouped chunk scan"):
            stages(ins, tabs, use, "group_scan")
    runs = {}
    for plan in plans:
        got = runs[plan] = stages(ins, tabs, use, plan)
        errors = {k: rel_rms(got[k], want[k]) for k in ("out", "y") if got[k].numel()}
        print(f"\n[scan {plan} {label}] vs float64: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
        assert all(torch.isfinite(got[k].float()).all() for k in ("out", "y")), plan
        bad = {k: v for k, v in errors.items() if not v <= STAGE_TOL[dtype][k]}
        assert not bad, (plan, bad)
    for plan in plans[1:]:
        for k in ("out", "y"):
            assert runs[plan][k].shape == runs[None][k].shape, (plan, k)
            assert torch.equal(runs[plan][k], runs[None][k]), (plan, k, rel_rms(runs[plan][k], runs[None][k]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", SCAN_DIMS, ids=SCAN_IDS)
@pytest.mark.parametrize("name,chunk", SCAN_LAYOUTS, ids=[f"{n}-L{c}" for n, c in SCAN_LAYOUTS])
def test_scan_kernels_bitwise(name, chunk, dims, dtype):
    """scan_kernels_agree on the crafted tries and a random one: odd P / N (P 8, 24, 56; N 8, 40, 72, 176: the
    grouped scan's N-rounded-to-64 instantiations 64 / 128 / 192), 1-token segments, G 1, z in-type / fp32 /
    none, D (H, P) / none, per-root h0. P64N256 and P 128 do not fit the grouped scan; chunk 128 takes the
    per-head scan only."""
    H, P, G, N = dims
    off, par = SCAN_TRIES[name]
    roots = sum(p < 0 for p in par)
    for use, z_fp32 in SCAN_USES:
        ins = make(off[-1], dtype=dtype, roots=roots, H=H, P=P, G=G, N=N, D_per_channel=True, seed=7)
        if z_fp32:
            ins["z"] = ins["z"].float()
        tabs = chunk_tables(off, par, chunk, "cuda")
        scan_kernels_agree(ins, tabs, use, reference(ins, tabs, use), dtype,
                           f"{name} L={chunk} {dims} {dtype} use={use} z_fp32={z_fp32}")


@pytest.mark.parametrize("dims", [(4, 64, 2, 128), (8, 64, 1, 128), (16, 32, 2, 64)], ids=["H4G2", "H8G1", "H16G2P32"])
def test_scan_head_slices_bitwise(dims):
    """~77k tokens of a random trie (>= 1,024 chunks of 64): the grouped scan's grid with 1 (H4G2), 2 (H8G1: 4
    heads per block) and 1 (H16G2P32: 8 heads per block, the longest double-buffer chain) head slices per
    (chunk, group); out and y bitwise equal to the per-head scan's, two runs bitwise equal, the op
    (ssd_tree_scan) equal to the grouped run's out and within the bf16 bar of the float64 token oracle."""
    H, P, G, N = dims
    off, par = random_trie(11, 48, 3200)
    ins = make(off[-1], roots=sum(p < 0 for p in par), H=H, P=P, G=G, N=N, D_per_channel=True, seed=5)
    tabs = chunk_tables(off, par, 64, "cuda")
    assert tabs["gather"].shape[0] >= 1024, tabs["gather"].shape
    a, a2, b = (stages(ins, tabs, plan=plan) for plan in ("group_scan", "group_scan", "head_scan"))
    op = call(_ops().ssd_tree_scan, ins, tabs)
    for k in ("out", "y"):
        assert torch.isfinite(a[k].float()).all(), k
        assert torch.equal(a[k], a2[k]), f"two grouped runs differ ({k})"
        assert torch.equal(a[k], b[k]), (k, rel_rms(a[k], b[k]))
    assert torch.equal(op, a["out"])
    if dims == (4, 64, 2, 128):
        e = rel_rms(op, oracle(ins, off, par))
        print(f"\n[grouped scan head slices {dims}] vs token oracle {e:.2e}")
        assert e <= TOL[torch.bfloat16]
