"""Tries and their chunk tables, built by plain loops: the chunked-kernel tests' independent check of
TreePlan.chunk_tables, shared by test_gdn_chunked.py, test_ssd_chunked.py, test_gdn_bwd_reference.py
(and, through those, the fused kernels' tests). Imports only torch: usable without the built package.

* ``trie(spec)``: seg_offsets, parents from ``[(parent, length), ...]`` (parents first).
* ``chunk_tables(seg_offsets, parents, chunk, device)``: ``ChunkTables`` (a named tuple in the
  native ops' argument order; ``["gather"]`` works too, ``._asdict()`` gives the mapping).
* ``rand_spec(rng, shape)``: the deep (20 levels) and wide (64 children) tries.
* ``random_forest(rng)``: random (segment lengths, parents) in DFS pre-order (the plan fuzz and chunk tests).
* ``gdn_inputs(T, ...)``: float64 Gated DeltaNet leaf tensors; ``rel_err`` / ``rel_rms``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def trie(spec):
    """seg_offsets, parents from [(parent, length), ...] in segment order (parents first)."""
    offsets, parents = [0], []
    for parent, length in spec:
        parents.append(parent)
        offsets.append(offsets[-1] + length)
    return offsets, parents


def levels(parents) -> list[int]:
    level: list[int] = []
    for p in parents:
        level.append(0 if p < 0 else level[p] + 1)
    return level


class ChunkTables(NamedTuple):
    """TreePlan.chunk_tables' fields, in the order the native ops take them."""

    gather: torch.Tensor
    scatter: torch.Tensor
    seg_chunk_offsets: torch.Tensor
    parents: torch.Tensor
    root_index: torch.Tensor
    level_segments: torch.Tensor
    level_offsets: list
    child_offsets: torch.Tensor
    children: torch.Tensor

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


def chunk_tables(seg_offsets, parents, chunk=64, device="cpu") -> ChunkTables:
    """TreePlan.chunk_tables' contract, built by a plain loop (an independent check of the plan's)."""
    so, par = [int(v) for v in seg_offsets], [int(v) for v in parents]
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
    level = levels(par)
    order = sorted(range(S), key=lambda s: (level[s], s))
    level_offsets = [0] * (max(level, default=-1) + 2)
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
    return ChunkTables(gather.to(device), scatter.to(device), t(sco), t(par), t(root_index), t(order), level_offsets,
                       t(child_offsets), t([c for k in kids for c in k]))


def random_forest(rng):
    """(segment lengths, parents) in DFS pre-order: 1-12 segments of 1-6 tokens, a new root or a child of
    one of the open path's segments (``rng`` a random.Random; the same draws in the same order always)."""
    lengths, parents, stack = [], [], []
    for s in range(rng.randint(1, 12)):
        if stack and rng.random() < 0.7:
            stack = stack[: rng.randint(1, len(stack))]
            parent = stack[-1]
        else:
            stack, parent = [], -1
        lengths.append(rng.randint(1, 6))
        parents.append(parent)
        stack.append(s)
    return lengths, parents


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


def gdn_inputs(T, HK=2, HV=4, K=8, V=6, roots=1, strong=False, l2norm=True, seed=0):
    """float64 Gated DeltaNet leaf tensors; keys are kept at norm <= 1 without l2norm (the recurrence
    is stable)."""
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


def rel_err(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def rel_rms(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()
