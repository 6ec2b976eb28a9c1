"""The fused SSD backward's float64 stage decomposition (ssd_bwd_reference.py) against torch.autograd
through the float64 token-by-token recurrence (CPU, fast): every final gradient, on tries with
1-token segments, segments around the chunk, deep and wide tries, groups, D (H) and (H, P), z on/off,
softplus, dt_limit clamping, shared and per-root initial states, chunk 64/128/256 (small shapes)."""

from __future__ import annotations

import pytest
import torch

import ssd_bwd_reference as ref


def make(T, H=4, P=8, G=2, N=8, roots=1, D_per_channel=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(T, H, P), dt=r(T, H), B=r(T, G, N), C=r(T, G, N), z=r(T, H, P),
                D=r(H, P) if D_per_channel else r(H), dt_bias=r(H) * 0.5, h0=r(roots, H, P, N) * 0.5,
                A_log=r(H) * 0.5)


def rel_rms(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def run_case(seg_offsets, parents, chunk, use=("D", "dt_bias", "z", "h0"), dt_softplus=True,
             dt_limit=(0.0, float("inf")), shared_h0=False, tol=1e-10, **kw):
    roots = sum(p < 0 for p in parents)
    ins = make(seg_offsets[-1], roots=1 if shared_h0 else roots, **kw)
    leaves = {k: v.clone().requires_grad_() for k, v in ins.items()}
    A = -torch.exp(leaves["A_log"])
    h0 = None
    if "h0" in use:
        h0 = leaves["h0"][0] if shared_h0 else leaves["h0"]
    opt = dict(D=leaves["D"] if "D" in use else None, dt_bias=leaves["dt_bias"] if "dt_bias" in use else None,
               z=leaves["z"] if "z" in use else None, initial_state=h0, dt_softplus=dt_softplus, dt_limit=dt_limit)
    want = ref.token_scan(leaves["x"], leaves["dt"], leaves["B"], leaves["C"], A, seg_offsets, parents, **opt)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    names = ["x", "dt", "B", "C", "A_log"] + [n for n in ("D", "dt_bias", "z", "h0") if n in use]
    (want * w).sum().backward()
    grads = {n: leaves[n].grad for n in names}

    d = {k: v.detach() for k, v in ins.items()}
    A = -torch.exp(d["A_log"])
    h0 = None if "h0" not in use else (d["h0"][0] if shared_h0 else d["h0"])
    opt = dict(D=d["D"] if "D" in use else None, dt_bias=d["dt_bias"] if "dt_bias" in use else None,
               z=d["z"] if "z" in use else None, initial_state=h0, dt_softplus=dt_softplus, dt_limit=dt_limit)
    tabs = ref.chunk_tables(seg_offsets, parents, chunk)
    saved = ref.forward(d["x"], d["dt"], d["B"], d["C"], A, tabs, **opt)
    assert rel_rms(saved["out"], want.detach()) < tol
    r = ref.backward(w, d["x"], d["dt"], d["B"], d["C"], A, tabs, saved, **opt)
    got = dict(x=r["dx"], dt=r["ddt_raw"], B=r["dB"], C=r["dC"], A_log=r["dA"] * A)
    if "D" in use:
        got["D"] = r["dD"]
    if "dt_bias" in use:
        got["dt_bias"] = r["ddt_bias"]
    if "z" in use:
        got["z"] = r["dz"]
    if "h0" in use:
        got["h0"] = r["d_initial_state"].unsqueeze(0) if shared_h0 else r["d_initial_state"]
    errors = {n: rel_rms(got[n], grads[n]) for n in names}
    assert all(e < tol for e in errors.values()), errors
    return errors


MIXED = ([0, 1, 64, 128, 193, 194, 324, 389], [-1, 0, 1, 0, -1, 4, 4])


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_mixed_trie(chunk):
    run_case(*MIXED, chunk)


def test_small_chunk_deep_trie_many_chunks():
    # chunk 16 exercises several chunks per segment and the pass inside segments on a small trie
    offsets = [0, 40, 41, 73, 90, 91, 150]
    run_case(offsets, [-1, 0, 1, 2, 3, 4], 16)


def test_wide_trie_grouped_per_channel_D():
    offsets = [0, 30] + [30 + 7 * (k + 1) for k in range(10)]
    run_case(offsets, [-1] + [0] * 10, 16, D_per_channel=True, G=1)


def test_no_optionals_no_softplus_and_clamp():
    run_case(*MIXED, 64, use=(), dt_softplus=False, dt_limit=(0.0, 1.5))
    run_case(*MIXED, 64, dt_limit=(0.3, 0.9))


def test_shared_initial_state_and_single_group_heads():
    run_case(*MIXED, 64, shared_h0=True, H=4, G=4)


def test_one_token_segments():
    run_case([0, 1, 2, 3, 4], [-1, 0, 0, 2], 64)
