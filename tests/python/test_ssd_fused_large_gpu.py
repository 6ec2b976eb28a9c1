"""The fused SSD (Mamba2) path on a row whose tokens x heads x dim pass 2^31
elements (300,700 tokens at H 128, P 64, N 128, G 8, bf16, chunk 64: x / z / y hold 2.46e9 elements,
the chunk states 4.9e9).

The big row is a forest laid out so its LAST segments sit past 2^31 elements and start from a state
that comes through the tree (same layout as test_gdn_fused_large_gpu.py):
  seg 0  A   root (root index 0)  150,007 tokens
  seg 1  B1  child of A            75,003
  seg 2  B2  child of B1           74,990
  seg 3  B3  child of A               100
  seg 4  P   root (root index 1)      130     <- from token 300,100 on: past 2^31 elements
  seg 5  P2  child of P                70
  seg 6  C   child of P2              200     (its start state: P -> P2 -> C, two levels of the tree)
  seg 7  X   child of A               200     (its start state: A's end state, 150,007 tokens back)
The op returns outputs only, so the references are the same op on small rows (all offsets < 2^31)
holding the segment's whole path, from the same initial state:
  R1 = [P, P2, C] alone (init h0[1]): its outputs must match the big row's; R1 is also checked
       against the float64 token oracle (ssd_token_scan on the CPU);
  R2 = [A, X] alone (init h0[0], 150,207 tokens = 1.23e9 elements): X's and A's outputs must match.
D, dt_bias (softplus) and z are on. The fused kernels compute each chunk the same way whatever the
row, so the matches are expected to be bitwise (printed); asserted at the fused bf16 bound (1.5e-2
rel RMS, test_ssd_fused_gpu's TOL). Backward smoke: the big row's gradients are finite, and the
P-chain's per-token gradients and d h0[1] equal R1's under the same output gradient (dA, dD,
d dt_bias sum over every token: finite only).

Runs only with TREE_RECURRENCE_LARGE_TESTS=1 on a GPU with >= 75 GiB free (the device run sets it; 75 so that
an H100's 79 GiB take it). Peaks on an H100: forward 24.6 GiB, forward + backward 68.9 GiB; the backward test
prints its peak, and skips with it when the card runs out of memory:
  TREE_RECURRENCE_LARGE_TESTS=1 python3 -m pytest tests/python/test_ssd_fused_large_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

from large_rows import check_last_segments, check_p_chain_gradients, large_mark, make_big, spec
from test_ssd_chunked import _ops, chunk_tables

H, P, N, G = 128, 64, 128, 8
CHUNK = 64
SPEC = spec(150_007, 75_003, 74_990)
TOL = 1.5e-2  # test_ssd_fused_gpu.TOL[bf16]: the fused op vs the float64 token oracle
SAME_TOL = 5e-3  # the big row vs the same path alone (the same kernels: expected bitwise)
GRAD_TOL = 1e-2
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU dry run of the logic swaps these)
TOKEN = ("x", "dt", "B", "C", "z")
PARAMS = ("A", "D", "dt_bias")

pytestmark = large_mark(__name__, min_free_gib=75)


def make_inputs(T, roots, seed=0, device=None, dtype=None):
    device, dtype = device or DEVICE, dtype or DTYPE
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=gen, device=device, dtype=dt)  # noqa: E731
    x = dict(x=r(T, H, P), dt=r(T, H) * 0.5 - 1.0, B=r(T, G, N), C=r(T, G, N), z=r(T, H, P), h0=r(roots, H, P, N))
    # A, D, dt_bias in fp32 as the models keep them
    x["A"] = -(torch.rand(H, generator=gen, device=device) * 2.0 + 0.1)
    x["D"] = r(H, dt=torch.float32)
    x["dt_bias"] = r(H, dt=torch.float32) * 0.5
    return x


def run(x, seg_offsets, parents, init, op=None):
    t = chunk_tables(seg_offsets, parents, CHUNK, x["x"].device)
    op = op or _ops().ssd_tree_scan
    return op(x["x"], x["dt"], x["B"], x["C"], t["gather"], t["scatter"], t["seg_chunk_offsets"], t["parents"],
              t["root_index"], t["level_segments"], t["level_offsets"], t["child_offsets"], t["children"], init,
              A=x["A"], dt_limit=[0.0, float("inf")], D=x["D"], dt_bias=x["dt_bias"], dt_softplus=True, z=x["z"])


def oracle(r1, so1, par1, h0):
    """The float64 token oracle (ssd_token_scan on the CPU)."""
    c = {n: t.double().cpu() for n, t in r1.items()}
    return _ops().ssd_token_scan(c["x"], c["dt"], c["B"], c["C"], torch.tensor(so1), torch.tensor(par1),
                                 h0.double().cpu(), A=c["A"], dt_limit=[0.0, float("inf")], D=c["D"],
                                 dt_bias=c["dt_bias"], dt_softplus=True, z=c["z"])


def check_fused(r1, so1, par1, h0, y1):
    """The fused path ran: the op's output is the stages op's out, widened."""
    st = run(r1, so1, par1, h0, op=_ops().ssd_fused_stages)
    assert torch.equal(y1, st[0].float()), "ssd_tree_scan did not take the fused path on R1"


@pytest.fixture(scope="module")
def big():
    return make_big(SPEC, make_inputs, H * P, DEVICE)


def test_last_segments_match_their_paths_alone(big, monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)

    def check_out(y):
        assert y.shape == big["x"]["x"].shape

    check_last_segments(big, run, TOKEN, PARAMS, oracle, same_tol=SAME_TOL, oracle_tol=TOL, check_out=check_out,
                        check_fused=check_fused)


def test_backward_smoke_and_p_chain_gradients(big, monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dY = torch.randn(big["T"], H, P, generator=gen, device=DEVICE, dtype=torch.float32)
    check_p_chain_gradients(big, run, TOKEN, PARAMS, dY, GRAD_TOL)
