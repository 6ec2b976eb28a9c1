"""CPU check of the fused GDN backward's stage decomposition (tests/python/gdn_bwd_reference.py):
the float64 stages, chained, against torch.autograd through the float64 token oracle
(a plain Python token loop here, so the check runs without the built package), on the tries of
the GPU test (small dims). Exact float64 on both sides, so
the tolerance is tight (1e-9 relative max error): a wrong formula shows as O(1)."""

from __future__ import annotations

import random

import pytest
import torch
from tries import chunk_tables, rand_spec, rel_err, trie
from tries import gdn_inputs as make_inputs

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref

def token_oracle(q, k, v, g, beta, seg_offsets, parents, init, scale, l2norm):
    """S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q), every segment from its
    parent's final state (float64, differentiable)."""
    T, HK, K = q.shape
    HV = v.shape[1]
    grp = HV // HK
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    sc = scale if scale > 0 else K ** -0.5
    q = (q * sc).repeat_interleave(grp, 1)
    k = k.repeat_interleave(grp, 1)
    outs, finals, root = [None] * T, [], 0
    for s, p in enumerate(parents):
        if p >= 0:
            S = finals[p]
        elif init is None:
            S = torch.zeros(HV, K, v.shape[2], dtype=v.dtype)
        else:
            S = init if init.dim() == 3 else init[root]
            root += 1
        for t in range(seg_offsets[s], seg_offsets[s + 1]):
            S = S * torch.exp(g[t]).view(HV, 1, 1)
            pred = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + torch.einsum("hk,hv->hkv", k[t], beta[t].unsqueeze(-1) * (v[t] - pred))
            outs[t] = torch.einsum("hkv,hk->hv", S, q[t])
        finals.append(S)
    return torch.stack(outs)


CASES = {
    "one_token": dict(spec=[(-1, 1), (0, 1), (1, 1), (1, 1), (0, 1), (4, 3)], h0="shared"),
    "around_chunk": dict(spec=[(-1, 63), (0, 64), (0, 1), (1, 65), (2, 129)], h0="per_root", strong=True),
    "forest": dict(spec=[(-1, 30), (-1, 64), (0, 20), (-1, 1), (1, 70), (1, 3)], h0="per_root"),
    "grouped_no_l2": dict(spec=[(-1, 70), (0, 40), (0, 90), (2, 5)], l2norm=False, HK=2, HV=6, K=5, V=7, h0="shared"),
    "grouped_l2_scale": dict(spec=[(-1, 70), (0, 40), (0, 90), (2, 5)], HK=1, HV=3, K=16, V=16, h0="none",
                             scale=0.3),
    "deep": dict(spec=rand_spec(random.Random("deep"), "deep"), h0="shared", K=4, V=4, HK=1, HV=2),
    "wide": dict(spec=rand_spec(random.Random("wide"), "wide"), h0="shared", K=4, V=4, HK=1, HV=2, strong=True),
}


def run_case(spec, h0="none", l2norm=True, strong=False, scale=0.0, seed=0, **dims):
    seg_offsets, parents = trie(spec)
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], roots=roots, strong=strong, l2norm=l2norm, seed=seed, **dims)
    x = {n: t.detach().clone().requires_grad_(True) for n, t in ins.items() if n != "grad"}
    init = None if h0 == "none" else (x["h0"][0] if h0 == "shared" else x["h0"])
    o = token_oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], seg_offsets, parents, init, scale, l2norm)
    names_in = ["q", "k", "v", "g", "beta"] + (["h0"] if h0 != "none" else [])
    grads = torch.autograd.grad((o * ins["grad"]).sum(), [x[n] for n in names_in])
    want = {f"d{n}": gr for n, gr in zip(names_in, grads)}
    tabs = chunk_tables(seg_offsets, parents)
    init = None if h0 == "none" else (ins["h0"][0] if h0 == "shared" else ins["h0"])
    fwd = fref.stages(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], tabs, init, scale, l2norm)
    got = bref.backward(ins["grad"], ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], tabs, fwd, init, scale, l2norm)
    names = {"dq": "dq", "dk": "dk", "dv": "dv", "dg": "dg", "dbeta": "dbeta"}
    errors = {n: rel_err(got[m], want[n]) for n, m in names.items()}
    if h0 != "none":
        errors["dh0"] = rel_err(got["d_initial_state"], want["dh0"][0] if h0 == "shared" else want["dh0"])
    return errors


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage_decomposition_matches_autograd(case):
    errors = run_case(**CASES[case])
    bad = {n: e for n, e in errors.items() if not e <= 1e-9}
    assert not bad, f"{case}: stage decomposition off autograd: {bad} (all: {errors})"
