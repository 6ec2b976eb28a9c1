"""CPU check of the fused GDN backward's stage decomposition (tests/python/gdn_bwd_reference.py):
the float64 stages, chained, against torch.autograd through the float64 token oracle
(a plain Python token loop here, so the check runs without the built package), on the tries of
the GPU test (small dims). Exact float64 on both sides, so
the tolerance is tight (1e-9 relative max error): a wrong formula shows as O(1)."""

from __future__ import annotations

import math
import random

import pytest
import torch

import gdn_bwd_reference as bref
import gdn_chunk_reference as fref

# copies of tests/python/test_gdn_chunked.py helpers (that file imports the built package)
CHUNK = 64


def trie(spec):
    """seg_offsets, parents from [(parent, length), ...] in segment order (parents first)."""
    offsets, parents = [0], []
    for parent, length in spec:
        parents.append(parent)
        offsets.append(offsets[-1] + length)
    return offsets, parents


def chunk_tables(seg_offsets, parents, chunk=CHUNK, device="cpu"):
    """TreePlan.chunk_tables' contract, built by a plain loop (an independent check of the plan's)."""
    so, par = list(seg_offsets), list(parents)
    S, T = len(par), so[-1]
    counts = [max(1, math.ceil((so[s + 1] - so[s]) / chunk)) for s in range(S)]
    sco = [0]
    for n in counts:
        sco.append(sco[-1] + n)
    gather = torch.full((sco[-1], chunk), -1, dtype=torch.int64)
    scatter = torch.empty(T, dtype=torch.int64)
    for s in range(S):
        for i in range(counts[s]):
            c, lo = sco[s] + i, so[s] + i * chunk
            hi = min(so[s + 1], lo + chunk)
            gather[c, : hi - lo] = torch.arange(lo, hi)
            scatter[lo:hi] = c * chunk + torch.arange(hi - lo)
    level = []
    for p in par:
        level.append(0 if p < 0 else level[p] + 1)
    order = sorted(range(S), key=lambda s: (level[s], s))
    level_offsets = [0] * (max(level) + 2)
    for lv in level:
        level_offsets[lv + 1] += 1
    for i in range(1, len(level_offsets)):
        level_offsets[i] += level_offsets[i - 1]
    roots = [s for s in range(S) if par[s] < 0]
    root_index = [roots.index(s) if par[s] < 0 else -1 for s in range(S)]
    kids = [[c for c in range(S) if par[c] == s] for s in range(S)]
    child_offsets = [0]
    for k in kids:
        child_offsets.append(child_offsets[-1] + len(k))
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return (gather.to(device), scatter.to(device), t(sco), t(par), t(root_index), t(order), level_offsets,
            t(child_offsets), t([c for k in kids for c in k]))


def make_inputs(T, HK=2, HV=4, K=8, V=6, roots=1, strong=False, l2norm=True, seed=0):
    """float64 leaf tensors; keys are kept at norm <= 1 without l2norm (the recurrence is stable)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(T, HK, K), r(T, HK, K)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1.0) * torch.rand(T, HK, 1, generator=gen, dtype=torch.float64)
    A = torch.rand(HV, generator=gen, dtype=torch.float64) * (16.0 if strong else 1.0)
    if strong:
        A[0] = 16.0
    g = -A * torch.nn.functional.softplus(r(T, HV) + (1.0 if strong else -1.0))
    return dict(q=q, k=k, v=r(T, HV, V), g=g, beta=torch.sigmoid(r(T, HV)), h0=r(roots, HV, K, V) * 0.5,
                grad=r(T, HV, V))


def rand_spec(rng, shape):
    """Tries used below. shape: 'deep' (20 levels, a branch at each), 'wide' (64 children)."""
    if shape == "deep":
        spec = [(-1, rng.randint(1, 70))]
        for level in range(1, 20):
            parent = len(spec) - 1
            spec.append((parent, rng.randint(1, 70)))
            if level % 3 == 0:
                spec.append((parent, rng.choice([1, 63, 64, 65])))
        # the spine must stay parents-first: the side branches hang off the previous spine node
        return spec
    return [(-1, 100)] + [(0, rng.choice([1, 2, 17, 63, 64, 65, 66])) for _ in range(64)]


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


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

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
