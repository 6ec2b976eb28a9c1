"""The float64 per-stage SSD reference (ssd_chunk_reference.py, what the fused kernels' GPU tests
compare each stage against) checked on the CPU against the exact float64 token oracle
(op ``ssd_token_scan``): outputs and gradients, chunk 64 / 128 / 256, tries deep and wide, 1-token
segments, per-root initial states; and its stages against their definitions."""

from __future__ import annotations

import pytest
import torch

import ssd_chunk_reference as ref
from test_ssd_chunked import MIXED, as_oracle, chunk_tables, make_inputs, rel, run_oracle

USE = ("D", "dt_bias", "z", "h0")


def run_ref(ins, seg_offsets, parents, chunk, dt_limit=(0.0, float("inf")), use=USE):
    tabs = chunk_tables(seg_offsets, parents, chunk)
    return ref.stages(ins["x"], ins["dt"], ins["B"], ins["C"], ins["A"], tabs, D=ins["D"] if "D" in use else None,
                      dt_bias=ins["dt_bias"] if "dt_bias" in use else None, dt_softplus=True, dt_limit=dt_limit,
                      z=ins["z"] if "z" in use else None, initial_state=ins["h0"] if "h0" in use else None)


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


DEEP = (_offsets([5, 17, 40, 1, 33, 8, 2, 29, 11, 64, 3, 21, 130, 255, 257]), [-1] + list(range(14)))
WIDE = (_offsets([70] + [1 + 5 * i for i in range(12)] + [9, 127, 128, 129, 1]), [-1] + [0] * 12 + [-1, 13, 13, 13, 16])


@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("trie", [MIXED, DEEP, WIDE], ids=["mixed", "deep", "wide"])
def test_reference_matches_token_oracle(trie, chunk):
    roots = sum(p < 0 for p in trie[1])
    ins = as_oracle(make_inputs(trie[0][-1], H=4, P=6, G=2, N=5, roots=roots, D_per_channel=chunk == 128))
    got = run_ref(ins, *trie, chunk, dt_limit=(0.05, 3.0))["out"]
    want = run_oracle(ins, *trie, dt_limit=(0.05, 3.0))
    assert rel(got, want) <= 1e-12
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "z", "h0"]
    g1 = torch.autograd.grad((got * w).sum(), [ins[n] for n in names])
    g2 = torch.autograd.grad((want * w).sum(), [ins[n] for n in names])
    for n, a, b in zip(names, g1, g2):
        assert rel(a, b) <= 1e-10, n


def test_without_optionals_and_shared_state():
    ins = as_oracle(make_inputs(MIXED[0][-1], roots=1))
    for use in ((), ("h0",)):
        shared = dict(ins, h0=ins["h0"][0])
        got = run_ref(shared, *MIXED, 64, use=use)["out"]
        want = run_oracle(shared, *MIXED, use=use)
        assert rel(got, want) <= 1e-12, use


def test_stages_are_their_definitions():
    ins = as_oracle(make_inputs(MIXED[0][-1], roots=2))
    st = run_ref(ins, *MIXED, 64)
    tabs = chunk_tables(*MIXED, 64)
    g = tabs["gather"]
    pad = g < 0
    assert (st["dt"].permute(0, 2, 1)[pad] == 0).all()
    assert (st["Lam"] <= 0).all()
    # a root's first chunk starts from its initial state, a child's first chunk from its parent's final state
    sco, par = tabs["seg_chunk_offsets"].tolist(), MIXED[1]
    for s, p in enumerate(par):
        first = st["states"][sco[s]]
        want = ins["h0"][tabs["root_index"][s]] if p < 0 else st["final"][p]
        assert torch.equal(first, want.to(first.dtype)), s
    # the final state of segment 0 by the token recurrence
    d = ref.prepare_dt(ins["dt"], ins["dt_bias"], True)
    H, P, N = 4, 6, 5
    s = ins["h0"][0].detach().clone()
    for t in range(MIXED[0][1]):
        Bh = ins["B"][t].detach().repeat_interleave(2, 0)  # (H, N)
        s = torch.exp(d[t] * ins["A"]).view(H, 1, 1) * s + (d[t].view(H, 1) * ins["x"][t]).unsqueeze(-1) * Bh.view(H, 1, N)
    assert rel(st["final"][0], s) <= 1e-12
