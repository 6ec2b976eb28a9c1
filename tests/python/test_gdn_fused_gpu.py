"""The fused GDN forward on CUDA (plugins/gated_delta_net/csrc/gdn_fused/), bf16 and fp16.

Per stage (op gdn_fused_stages: [o, G, Ainv, w, u, kd, decay, h, v_new, final_state, rq, rk]) against
the float64 reference of gdn_chunk_reference.py on the same (rounded) inputs, two ways, each printed
as a relative RMS:
  exact  the stage vs the float64 reference of the whole chain up to it;
  local  the stage vs the float64 reference of that kernel alone, fed the previous kernel's outputs
         (prep: its inputs; the tree state pass: the kernel's w, u, kd, decay; out: its G, h, v_new),
so one run tells which kernel and which quantity is wrong. Then the op (gdn_tree_scan dispatching to
the fused path) against the float64 token oracle (gdn_token_scan) on the same rounded inputs (relative
RMS <= 5e-3), bitwise repeatability, and the kill switch (TREE_RECURRENCE_FUSED=0: the ATen composite).
Tries: deep (20 levels), wide (64 children), 1-token segments, 63/64/65-token segments, an 8k segment,
grouped heads, K = V = 128 and 16 and dims not multiples of 16 (V = 88: a partly used second column half
in the out kernel), l2norm on and off, per-root initial states, strong decays (A up to 16).

Run: .venv/bin/python -m pytest tests/python/test_gdn_fused_gpu.py -q -s   (-s shows the tables)
"""

from __future__ import annotations

import random

import pytest
import torch

import gdn_chunk_reference as ref
from test_gdn_chunked import _ops, chunk_tables, make_inputs, rand_spec, rel_rms, trie

STAGES = ["o", "G", "Ainv", "w", "u", "kd", "decay", "h", "v_new", "final_state", "rq", "rk"]

# name: (spec, HK, HV, K, V, l2norm, strong, h0)
CASES = {
    "deep_k128": (rand_spec(random.Random("deep"), "deep"), 1, 2, 128, 128, True, False, "shared"),
    "wide_k16": (rand_spec(random.Random("wide"), "wide"), 2, 4, 16, 16, True, False, "shared"),
    "one_token": ([(-1, 1), (0, 1), (1, 1), (1, 1), (0, 1), (4, 3)], 2, 4, 128, 128, True, False, "shared"),
    "around_chunk_strong": ([(-1, 63), (0, 64), (0, 65), (2, 1), (1, 129)], 2, 4, 128, 128, True, True, "shared"),
    "forest_no_l2": ([(-1, 30), (-1, 64), (0, 20), (-1, 1), (1, 70), (1, 3)], 2, 4, 64, 64, False, False, "per_root"),
    "odd_dims_none": ([(-1, 200), (0, 70), (0, 1)], 1, 3, 40, 72, True, True, "none"),
    "long_8k_strong": ([(-1, 8192), (0, 100)], 1, 2, 128, 128, True, True, "shared"),
    # V in (64, 128) not a multiple of 16 (the out kernel's second column half partly used), 3 groups
    "k24_v88_groups3": ([(-1, 100), (0, 64), (0, 30), (2, 5)], 2, 6, 24, 88, True, False, "shared"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# local (one kernel) and exact (chain) relative RMS bounds per stage
LOCAL_TOL = dict(o=1e-2, G=1e-5, Ainv=1e-2, w=1e-2, u=1e-2, kd=1e-2, decay=1e-4, h=1e-2, v_new=1e-2, final_state=1e-2,
                 rq=1e-5, rk=1e-5)
EXACT_TOL = dict(LOCAL_TOL, o=5e-3, h=2e-2, v_new=2e-2, final_state=2e-2)


def make_case(name, dtype, device="cuda", seed=0):
    spec, HK, HV, K, V, l2norm, strong, h0 = CASES[name]
    seg_offsets, parents = trie(spec)
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], HK=HK, HV=HV, K=K, V=V, roots=roots, strong=strong, l2norm=l2norm, seed=seed)
    x = {n: t.to(device=device, dtype=torch.float32 if n in ("g", "h0") else dtype) for n, t in ins.items()}
    init = None if h0 == "none" else (x["h0"][0] if h0 == "shared" else x["h0"])
    tabs = chunk_tables(seg_offsets, parents, device=device)
    return dict(x=x, init=init, tabs=tabs, seg_offsets=seg_offsets, parents=parents, l2norm=l2norm, scale=0.0)


def call_stages(c):
    x = c["x"]
    out = _ops().gdn_fused_stages(x["q"], x["k"], x["v"], x["g"], x["beta"], *c["tabs"], c["init"], c["scale"], c["l2norm"])
    return dict(zip(STAGES, out))


def call_op(c, x=None):
    x = c["x"] if x is None else x
    return _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], *c["tabs"], c["init"], c["scale"], c["l2norm"])


def oracle(c):
    x = {n: t.detach().double().cpu() for n, t in c["x"].items()}
    init = None if c["init"] is None else c["init"].detach().double().cpu()
    so = torch.tensor(c["seg_offsets"], dtype=torch.int64)
    par = torch.tensor(c["parents"], dtype=torch.int64)
    return _ops().gdn_token_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], so, par, init, c["scale"], c["l2norm"])


def stage_report(got, c, dtype):
    """{stage: (exact, local)} relative RMS of the kernel's stages (see the module docstring)."""
    x = {n: t.detach().double() for n, t in c["x"].items()}
    init = None if c["init"] is None else c["init"].detach().double()
    tabs = c["tabs"]
    want = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, init, c["scale"], c["l2norm"])
    g64 = {n: t.double() for n, t in got.items()}
    h_l, vn_l, fin_l = ref.state_pass(g64["w"], g64["u"], g64["kd"], g64["decay"], tabs, init, round_to=dtype)
    o_l = ref.outputs(x["q"], x["k"], g64["G"], g64["h"], g64["v_new"], tabs, c["scale"], c["l2norm"])
    local = dict(h=h_l, v_new=vn_l, final_state=fin_l, o=o_l)
    report = {}
    for n in STAGES:
        w = want[n]
        report[n] = (rel_rms(g64[n], w), rel_rms(g64[n], local.get(n, w)))
    return report


def print_report(title, report):
    print(f"\n{title}: stage   exact rel RMS   local rel RMS")
    for n, (e, l) in report.items():
        flag = "" if e <= EXACT_TOL[n] and l <= LOCAL_TOL[n] else "   <-- over"
        print(f"  {n:12s} {e:12.3e}   {l:12.3e}{flag}")


# ------------------------------------------------------------------------------------------------
# CPU: the report machinery itself, fed the reference's own stages rounded like the kernels' output
# ------------------------------------------------------------------------------------------------


def test_stage_report_on_rounded_reference_cpu():
    c = make_case("around_chunk_strong", torch.bfloat16, device="cpu")
    x = {n: t.double() for n, t in c["x"].items()}
    st = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], c["tabs"], c["init"].double(), 0.0, True,
                    round_to=torch.bfloat16)
    got = {n: st[n].float() if n in ("G", "decay", "final_state", "rq", "rk") else st[n].to(torch.bfloat16)
           for n in STAGES}
    report = stage_report(got, c, torch.bfloat16)
    print_report("CPU self-check (reference rounded to bf16)", report)
    for n, (e, l) in report.items():
        assert e <= EXACT_TOL[n] and l <= LOCAL_TOL[n], (n, e, l)


def test_stage_ops_bind_every_argument_cpu():
    """The stage ops' kernels read their arguments by schema name (ops.cpp): on CPU inputs both bind every
    argument and then refuse the device by name, so a misspelt name would fail here, on every CI run."""
    c = make_case("around_chunk_strong", torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="inputs must be on CUDA"):
        call_stages(c)
    x, t = c["x"], torch.zeros(1)
    with pytest.raises(ValueError, match="inputs must be on CUDA"):
        _ops().gdn_fused_backward_stages(x["v"], x["q"], x["k"], x["v"], x["g"], x["beta"], *c["tabs"], c["init"],
                                         c["scale"], c["l2norm"], t, t, t, t, t, t, t, t)


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_stages_against_float64(name, dtype_name):
    _stages_against_float64(name, dtype_name, seed=0, token_oracle=True)


def _stages_against_float64(name, dtype_name, seed, token_oracle):
    dtype = DTYPES[dtype_name]
    c = make_case(name, dtype, seed=seed)
    got = call_stages(c)
    torch.cuda.synchronize()
    report = stage_report(got, c, dtype)
    print_report(f"{name} {dtype_name} seed {seed}", report)
    bad = {n: r for n, r in report.items() if r[0] > EXACT_TOL[n] or r[1] > LOCAL_TOL[n]}
    assert not bad, f"{name} {dtype_name}: stages over tolerance (exact, local): {bad}"
    if token_oracle:
        o_oracle = rel_rms(got["o"], oracle(c))
        print(f"  o vs token oracle: {o_oracle:.3e}")
        assert o_oracle <= 5e-3, f"{name} {dtype_name}: o vs token oracle {o_oracle:.3e}"


@cuda
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_op_against_token_oracle(name, dtype_name, monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)
    c = make_case(name, DTYPES[dtype_name], seed=1)
    with torch.no_grad():
        o = call_op(c)
    assert o.dtype == DTYPES[dtype_name] and o.shape == c["x"]["v"].shape
    err = rel_rms(o, oracle(c))
    print(f"\n{name} {dtype_name}: gdn_tree_scan (fused) vs token oracle rel RMS {err:.3e}")
    assert err <= 5e-3
    # the op took the fused path: its stages op gives the same bits
    assert torch.equal(o, call_stages(c)["o"])


@cuda
@pytest.mark.parametrize("name", ["around_chunk_strong", "wide_k16", "odd_dims_none"])
def test_bitwise_repeatable(name):
    c = make_case(name, torch.bfloat16, seed=2)
    a, b = call_stages(c), call_stages(c)
    diff = [n for n in STAGES if not torch.equal(a[n], b[n])]
    assert not diff, f"{name}: stages differ between two runs: {diff}"


@cuda
def test_kill_switch_keeps_the_composite(monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)
    c = make_case("around_chunk_strong", torch.bfloat16, seed=3)
    with torch.no_grad():
        fused = call_op(c)
        monkeypatch.setenv("TREE_RECURRENCE_FUSED", "0")
        composite = call_op(c)
    want = oracle(c)
    print(f"\nfused {rel_rms(fused, want):.3e}, composite {rel_rms(composite, want):.3e} vs token oracle")
    assert not torch.equal(fused, composite), "TREE_RECURRENCE_FUSED=0 did not change the route"
    assert rel_rms(composite, want) <= 5e-3 and rel_rms(fused, want) <= 5e-3


# ------------------------------------------------------------------------------------------------
# CUDA: every stage (prep_fwd's block inverse first) against float64 on more seeds and dtypes, exact
# and local
# ------------------------------------------------------------------------------------------------

PREP_CASES = ["around_chunk_strong:bf16", "long_8k_strong:bf16", "k24_v88_groups3:fp16", "wide_k16:bf16",
              "odd_dims_none:fp16", "deep_k128:fp16"]


@cuda
@pytest.mark.parametrize("key", PREP_CASES)
def test_stages_against_float64_seed5(key):
    name, dtype_name = key.split(":")
    _stages_against_float64(name, dtype_name, seed=5, token_oracle=False)


@cuda
def test_chunks_past_the_grid_y_limit():
    # tile_grid puts chunks >= 65535 in blockIdx.z: a small root packed after a root of 65536 chunks
    # gives, in every per-chunk stage and in o, the bits it gives alone (roots are independent)
    big, small = 64 * 65536, 100
    HK, HV, D = 1, 2, 16
    gen = torch.Generator(device="cuda").manual_seed(11)

    def inputs(T):
        r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
        return dict(q=r(T, HK, D).bfloat16(), k=r(T, HK, D).bfloat16(), v=r(T, HV, D).bfloat16(),
                    g=-torch.nn.functional.softplus(r(T, HV)) * 0.5, beta=torch.sigmoid(r(T, HV)))

    xb, xs = inputs(big), inputs(small)
    both = {n: torch.cat([xb[n], xs[n]]) for n in xb}

    def stages(x, spec):
        seg_offsets, parents = trie(spec)
        tabs = chunk_tables(seg_offsets, parents, device="cuda")
        out = _ops().gdn_fused_stages(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, None, 0.0, True)
        return dict(zip(STAGES, out)), tabs.gather.shape[0]

    alone, nc_small = stages(xs, [(-1, small)])
    packed, nc = stages(both, [(-1, big), (-1, small)])
    assert nc - nc_small >= 65536
    bad = []
    for n in ("G", "Ainv", "w", "u", "kd", "decay", "h", "v_new"):  # per chunk: the small root's are last
        if not torch.equal(packed[n][nc - nc_small:], alone[n]):
            bad.append(n)
    for n in ("o", "rq", "rk"):  # per token: the small root's are last
        if not torch.equal(packed[n][big:], alone[n]):
            bad.append(n)
    if not torch.equal(packed["final_state"][1:], alone["final_state"]):
        bad.append("final_state")
    assert not bad, f"the small root's stages differ when its chunks sit past 65535: {bad}"
    assert rel_rms(alone["o"], oracle(dict(x=xs, init=None, seg_offsets=[0, small], parents=[-1], scale=0.0,
                                           l2norm=True))) <= 5e-3
