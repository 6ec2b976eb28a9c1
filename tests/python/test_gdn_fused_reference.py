"""The float64 stage reference of the fused GDN forward (gdn_chunk_reference.py) against the exact
ops on the CPU: its o equals the float64 token oracle (gdn_token_scan) and the composite
(gdn_tree_scan in float64), its final states equal the token recurrence's, and its stages satisfy
their defining identities ((I + A) Ainv = I, v_new = u - w h). Fast, CPU only."""

from __future__ import annotations

import random

import pytest
import torch

import gdn_chunk_reference as ref
from test_gdn_chunked import _ops, chunk_tables, leaves, make_inputs, rand_spec, rel_err, run_oracle, trie

CASES = {
    "one_token": ([(-1, 1), (0, 1), (1, 1), (1, 1), (0, 1), (4, 3)], "shared", True, False, {}),
    "around_chunk": ([(-1, 63), (0, 64), (0, 65), (2, 1), (1, 129)], "per_root", True, True, {}),
    "grouped_no_l2": ([(-1, 70), (0, 40), (0, 90), (2, 5)], "shared", False, False, dict(HK=2, HV=6, K=5, V=7)),
    "forest": ([(-1, 30), (-1, 64), (0, 20), (-1, 1), (1, 70), (1, 3)], "per_root", True, True, {}),
    "none": ([(-1, 40), (0, 30)], "none", True, False, {}),
    "deep": (rand_spec(random.Random("deep"), "deep"), "shared", True, True, {}),
    "wide": (rand_spec(random.Random("wide"), "wide"), "shared", True, False, dict(K=16, V=16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_exact_ops(name):
    spec, h0, l2norm, strong, dims = CASES[name]
    seg_offsets, parents = trie(spec)
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], roots=roots, strong=strong, l2norm=l2norm, seed=3, **dims)
    x = leaves(ins, torch.float64)
    init = None if h0 == "none" else (x["h0"][0] if h0 == "shared" else x["h0"])
    tabs = chunk_tables(seg_offsets, parents)
    st = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, init, 0.0, l2norm)
    want = run_oracle(x, seg_offsets, parents, h0=h0, l2norm=l2norm)
    assert rel_err(st["o"], want) <= 1e-10, "reference o vs token oracle"
    comp = _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, init, 0.0, l2norm)
    assert rel_err(st["o"], comp) <= 1e-10, "reference o vs composite"
    # identities of the stages
    NC, HV, C, _ = st["Ainv"].shape
    eye = torch.eye(C, dtype=torch.float64)
    assert ((eye + st["A"]) @ st["Ainv"] - eye).abs().max() <= 1e-8
    assert torch.allclose(st["v_new"], st["u"] - st["w"] @ st["h"], atol=1e-10)
    assert (st["G"] <= 0).all() and (st["decay"] <= 1).all()
    # pad rows carry nothing
    pad = (tabs[0] < 0).unsqueeze(1).expand(NC, HV, C)
    assert st["w"][pad].abs().max() == 0 and st["u"][pad].abs().max() == 0 and st["kd"][pad].abs().max() == 0 \
        if pad.any() else True


def test_final_state_is_the_token_recurrence():
    # a single segment's final state equals the token recurrence run by hand
    T, HK, HV, K, V = 70, 1, 2, 4, 3
    ins = make_inputs(T, HK=HK, HV=HV, K=K, V=V, seed=5)
    x = leaves(ins, torch.float64)
    st = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_tables([0, T], [-1]), x["h0"][0], 0.0, True)
    q, k = (t.detach() / t.detach().pow(2).sum(-1, keepdim=True).add(1e-6).sqrt() for t in (x["q"], x["k"]))
    S = x["h0"][0].detach().clone()
    for t in range(T):
        for hv in range(HV):
            kt = k[t, hv // (HV // HK)]
            S[hv] = S[hv] * torch.exp(x["g"][t, hv].detach())
            S[hv] = S[hv] + torch.outer(kt, x["beta"][t, hv].detach() * (x["v"][t, hv].detach() - S[hv].T @ kt))
    assert rel_err(st["final_state"][0], S) <= 1e-10


def test_round_to_changes_only_by_rounding():
    seg_offsets, parents = trie([(-1, 100), (0, 30)])
    x = leaves(make_inputs(130, seed=2), torch.float64)
    tabs = chunk_tables(seg_offsets, parents)
    exact = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, x["h0"][0], 0.0, True)
    rounded = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, x["h0"][0], 0.0, True, round_to=torch.bfloat16)
    e = rel_err(rounded["o"], exact["o"])
    assert 0 < e < 5e-2


def test_output_stage_alone_matches():
    # outputs() (the output stage alone, from G, h, v_new) gives the full reference's o
    seg_offsets, parents = trie([(-1, 100), (0, 30), (0, 64)])
    x = leaves(make_inputs(194, seed=4), torch.float64)
    tabs = chunk_tables(seg_offsets, parents)
    st = ref.stages(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs, x["h0"][0], 0.3, True)
    o = ref.outputs(x["q"], x["k"], st["G"], st["h"], st["v_new"], tabs, 0.3, True)
    assert rel_err(o, st["o"]) <= 1e-12


def _block_inverse_emulated(A, garbage):
    """prep_fwd.cu's block_inverse index for index on one 64 x 64 strictly lower A: the
    buffer M holds A^T in its strict upper triangle and garbage below; returns M's lower triangle
    (with the diagonal), the kernel's Ainv."""
    M = garbage.clone()
    r, c = torch.tril_indices(64, 64, -1)
    M[c, r] = A[r, c]
    for b in range(4):  # 4a
        o = 16 * b
        for cc in range(16):
            x = [0.0] * 16
            for rr in range(16):
                acc = 1.0 if rr == cc else 0.0
                for m in range(rr):
                    acc -= M[o + m, o + rr].item() * x[m]
                x[rr] = acc if rr >= cc else 0.0
            for rr in range(cc, 16):
                M[o + rr, o + cc] = x[rr]
    for d in range(1, 4):  # 4b
        for j in range(4 - d):
            i = j + d
            Y = torch.zeros(16, 16, dtype=A.dtype)
            for k in range(j, i):
                At = M[16 * k:16 * k + 16, 16 * i:16 * i + 16].T  # A(16i + r, 16k + m) = M[16k + m, 16i + r]
                X = M[16 * k:16 * k + 16, 16 * j:16 * j + 16].clone()
                if k == j:
                    X = torch.tril(X)  # columns past m masked
                Y += At @ X
            M[16 * i:16 * i + 16, 16 * j:16 * j + 16] = Y
            D = torch.tril(M[16 * i:16 * i + 16, 16 * i:16 * i + 16], -1) + torch.eye(16, dtype=A.dtype)
            M[16 * i:16 * i + 16, 16 * j:16 * j + 16] = -(D @ Y)
    return torch.tril(M)


@pytest.mark.parametrize("strong", [False, True])
def test_prep_block_inverse_algorithm(strong):
    # the CUDA prep kernel's 16 x 16 block inverse, emulated in float64 on the CPU
    g = torch.Generator().manual_seed(7 + strong)
    kk = torch.nn.functional.normalize(torch.randn(64, 32, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(64, generator=g, dtype=torch.float64)
    G = torch.cumsum(-torch.rand(64, generator=g, dtype=torch.float64) * (4.0 if strong else 0.3), 0)
    A = torch.tril(beta[:, None] * torch.exp(G[:, None] - G[None, :]) * (kk @ kk.T), -1)
    garbage = torch.randn(64, 64, generator=g, dtype=torch.float64) * 1e3
    got = _block_inverse_emulated(A, garbage)
    want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
    assert rel_err(got, want) <= 1e-12
