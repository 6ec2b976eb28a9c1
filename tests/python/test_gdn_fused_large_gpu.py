"""The fused GDN path on a row whose tokens x heads x dim pass 2^31 elements
(600,700 tokens at HV 32, K = V = 128, HK 16, bf16: v / o hold 2.46e9 elements, the chunk states 4.9e9).

The big row is a forest laid out so its LAST segments sit past 2^31 elements and start from a state
that comes through the tree:
  seg 0  A   root (root index 0)  300,007 tokens
  seg 1  B1  child of A           150,003
  seg 2  B2  child of B1          149,990
  seg 3  B3  child of A               100
  seg 4  P   root (root index 1)      130     <- from token 600,100 on: past 2^31 elements (v, o, q x 2)
  seg 5  P2  child of P                70
  seg 6  C   child of P2              200     (its start state: P -> P2 -> C, two levels of the tree)
  seg 7  X   child of A               200     (its start state: A's end state, 300,007 tokens back)
The ops return outputs only, so the references are the same op on small rows (all offsets < 2^31)
that contain the segment's whole path, with the same initial state:
  R1 = [P, P2, C] alone (init h0[1]): C's (and P's, P2's) outputs must match the big row's; R1 is
       also checked against the float64 token oracle (gdn_token_scan on the CPU);
  R2 = [A, X] alone (init h0[0], 300,207 tokens = 1.23e9 elements, under 2^31): X's and A's outputs
       must match the big row's (A's end state reaches X through the big row's tree pass).
The fused kernels compute each chunk the same way whatever the row, so the matches are expected to
be bitwise (printed); they are asserted at the fused forward's bf16 tolerance (rel RMS 5e-3).
Backward smoke: gradients of the big row are finite, and the P-chain's gradients (its tokens and
h0[1]) equal R1's under the same output gradient (the P tree is independent of the rest).

Runs only with TREE_RECURRENCE_LARGE_TESTS=1 on a GPU with >= 80 GB free (the device run sets it):
  TREE_RECURRENCE_LARGE_TESTS=1 python3 -m pytest tests/python/test_gdn_fused_large_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

from large_rows import check_last_segments, check_p_chain_gradients, large_mark, make_big, spec
from test_gdn_chunked import _ops, chunk_tables

HK, HV, K, V = 16, 32, 128, 128
SPEC = spec(300_007, 150_003, 149_990)
TOL = 5e-3  # the fused forward's bf16 bound (test_gdn_fused_gpu: op vs token oracle)
GRAD_TOL = 1e-2
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU dry run of the logic swaps these)
TOKEN = ("q", "k", "v", "g", "beta")

pytestmark = large_mark(__name__)


def make_inputs(T, roots, seed=0, device=None, dtype=None):
    device, dtype = device or DEVICE, dtype or DTYPE
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=gen, device=device, dtype=dt)  # noqa: E731
    A = torch.rand(HV, generator=gen, device=device) * 1.0
    g = -A * torch.nn.functional.softplus(r(T, HV, dt=torch.float32) - 1.0)
    beta = torch.sigmoid(r(T, HV, dt=torch.float32)).to(dtype)
    return dict(q=r(T, HK, K), k=r(T, HK, K), v=r(T, HV, V), g=g, beta=beta,
                h0=r(roots, HV, K, V, dt=torch.float32) * 0.5)


def run(x, seg_offsets, parents, init):
    tabs = chunk_tables(seg_offsets, parents, device=x["q"].device)
    return _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, init, 0.0, True)


def oracle(r1, so1, par1, h0):
    """The float64 token oracle (gdn_token_scan on the CPU)."""
    c = {n: t.double().cpu() for n, t in r1.items()}
    return _ops().gdn_token_scan(c["q"], c["k"], c["v"], c["g"], c["beta"], torch.tensor(so1, dtype=torch.int64),
                                 torch.tensor(par1, dtype=torch.int64), h0.double().cpu(), 0.0, True)


def check_fused(r1, so1, par1, h0, o1):
    """The fused path ran: the stages op gives the same bits on R1."""
    st = _ops().gdn_fused_stages(r1["q"], r1["k"], r1["v"], r1["g"], r1["beta"],
                                 *chunk_tables(so1, par1, device=DEVICE), h0, 0.0, True)
    assert torch.equal(o1, st[0]), "gdn_tree_scan did not take the fused path on R1"


def check_out(o, big):
    assert o.shape == big["x"]["v"].shape and o.dtype == DTYPE


@pytest.fixture(scope="module")
def big():
    return make_big(SPEC, make_inputs, HV * V, DEVICE)


def test_last_segments_match_their_paths_alone(big, monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)
    check_last_segments(big, run, TOKEN, (), oracle, same_tol=TOL, oracle_tol=TOL,
                        check_out=lambda o: check_out(o, big), check_fused=check_fused)


def test_backward_smoke_and_p_chain_gradients(big, monkeypatch):
    monkeypatch.delenv("TREE_RECURRENCE_FUSED", raising=False)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dO = torch.randn(big["T"], HV, V, generator=gen, device=DEVICE, dtype=DTYPE)
    check_p_chain_gradients(big, run, TOKEN, (), dO, GRAD_TOL)
