"""The chunked Gated DeltaNet tree scan (op ``gdn_tree_scan``, the seam's native route) against its
float64 token-by-token oracle (op ``gdn_token_scan``, the recurrence S <- exp(g) S;
S <- S + k (beta (v - S^T k))^T; o = S^T q run one token at a time, every segment starting from its
parent's final state).

Checked: outputs and the gradients of q, k, v, g, beta and the initial states, on tries with
1-token segments, segments of 63/64/65 tokens, one long segment, deep (20 levels) and wide (64
children) tries, grouped value heads, l2norm on and off, shared and per-root initial states and
strong decays (g = -A softplus(a) with A up to 16, the Qwen3.5-MoE init). fp32 runs are judged by
max|got - want| / max|want| per tensor (<= 1e-5) against the oracle on float64 copies of the same
inputs. The chunk tables come from an independent Python builder here and from TreePlan once.
A CUDA class (skipped without a GPU) checks the device path, bf16 and an 8k-token segment.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from tries import chunk_tables, rand_spec, rel_err, rel_rms, trie  # noqa: F401 (the fused tests import them from here)
from tries import gdn_inputs as make_inputs

from tree_recurrence import plugins

FAMILY = "gated_delta_net"
CHUNK = 64


def _ops():
    return plugins.ops(FAMILY)


# ------------------------------------------------------------------------------------------------
# inputs, the two ops, the comparison (tries and their chunk tables: tries.py, whose names the fused
# kernels' tests import from here)
# ------------------------------------------------------------------------------------------------


def leaves(ins, dtype, device="cpu"):
    return {n: t.detach().to(device=device, dtype=dtype if n != "g" or dtype == torch.float64 else torch.float32)
            .requires_grad_(n != "grad") for n, t in ins.items()}


def run_chunked(x, seg_offsets, parents, h0="none", l2norm=True, scale=0.0, chunk=CHUNK):
    tabs = chunk_tables(seg_offsets, parents, chunk, x["q"].device)
    init = None if h0 == "none" else (x["h0"][0] if h0 == "shared" else x["h0"])
    return _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, init, scale, l2norm)


def run_oracle(x, seg_offsets, parents, h0="none", l2norm=True, scale=0.0):
    init = None if h0 == "none" else (x["h0"][0] if h0 == "shared" else x["h0"])
    so, par = torch.tensor(seg_offsets, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64)
    return _ops().gdn_token_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], so, par, init, scale, l2norm)


GRADS = ("q", "k", "v", "g", "beta")


def outputs_and_grads(run, x, *args, h0="none", **kw):
    out = run(x, *args, h0=h0, **kw)
    names = list(GRADS) + (["h0"] if h0 != "none" else [])
    grads = torch.autograd.grad((out.to(x["grad"].dtype) * x["grad"]).sum(), [x[n] for n in names])
    return {"o": out.detach(), **{f"d{n}": g for n, g in zip(names, grads)}}


def check(spec, device="cpu", dtype=torch.float32, tol=1e-5, h0="none", l2norm=True, strong=False, measure=rel_err,
          grad_tol=None, seed=0, **dims):
    seg_offsets, parents = trie(spec)
    roots = sum(p < 0 for p in parents)
    ins = make_inputs(seg_offsets[-1], roots=roots, strong=strong, l2norm=l2norm, seed=seed, **dims)
    want = outputs_and_grads(run_oracle, leaves(ins, torch.float64), seg_offsets, parents, h0=h0, l2norm=l2norm)
    got = outputs_and_grads(run_chunked, leaves(ins, dtype, device), seg_offsets, parents, h0=h0, l2norm=l2norm)
    errors = {n: measure(got[n], want[n]) for n in want}
    bad = {n: e for n, e in errors.items() if e > (tol if n == "o" or grad_tol is None else grad_tol)}
    assert not bad, f"relative errors over tolerance: {bad} (all: {errors})"
    return errors


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


class TestChunkedCPU:
    def test_one_token_segments(self):
        # a chain and a fan of 1-token segments (each is its own chunk, mostly padding)
        check([(-1, 1), (0, 1), (1, 1), (1, 1), (0, 1), (4, 3)], h0="shared")

    @pytest.mark.parametrize("length", [63, 64, 65, 129])
    def test_around_the_chunk(self, length):
        check([(-1, length), (0, length), (0, 1), (1, 64)], h0="per_root", strong=length == 65)

    def test_long_segment(self):
        errors = check([(-1, 2048), (0, 130)], h0="shared", K=16, V=16, HK=1, HV=2)
        assert max(errors.values()) > 0  # the comparison saw two different computations

    @pytest.mark.parametrize("shape", ["deep", "wide"])
    def test_deep_and_wide(self, shape):
        check(rand_spec(random.Random(shape), shape), h0="shared", seed=1)

    @pytest.mark.parametrize("l2norm", [True, False])
    def test_grouped_heads_and_l2norm(self, l2norm):
        check([(-1, 70), (0, 40), (0, 90), (2, 5)], l2norm=l2norm, HK=2, HV=6, K=5, V=7, h0="shared")

    def test_per_root_initial_states(self):
        # a forest: three roots with their own states, children under two of them
        check([(-1, 30), (-1, 64), (0, 20), (-1, 1), (1, 70), (1, 3)], h0="per_root")

    def test_strong_decays(self):
        # A up to 16 (every head decays by up to e^-40 per token): nothing overflows, gradients stay exact
        errors = check([(-1, 150), (0, 65), (0, 64), (2, 1)], strong=True, h0="shared", l2norm=False)
        assert all(math.isfinite(e) for e in errors.values())

    def test_no_initial_state_and_scale(self):
        seg_offsets, parents = trie([(-1, 40), (0, 30)])
        ins = make_inputs(70)
        want = {}
        for scale in (0.0, 0.37):
            want[scale] = run_oracle(leaves(ins, torch.float64), seg_offsets, parents, scale=scale)
            got = run_chunked(leaves(ins, torch.float32), seg_offsets, parents, scale=scale)
            assert rel_err(got, want[scale]) <= 1e-5
        assert rel_err(want[0.37], want[0.0]) > 1e-3  # the scale reached the kernel

    def test_tree_equals_samples_alone(self):
        # each root-to-leaf path run as its own single-segment row gives the tree's tokens
        spec = [(-1, 50), (0, 70), (0, 9), (2, 66)]
        seg_offsets, parents = trie(spec)
        ins = leaves(make_inputs(seg_offsets[-1]), torch.float32)
        with torch.no_grad():
            tree = run_chunked(ins, seg_offsets, parents)
            for path in ([0, 1], [0, 2, 3]):
                idx = torch.cat([torch.arange(seg_offsets[s], seg_offsets[s + 1]) for s in path])
                alone = run_chunked({n: t[idx] if n != "h0" else t for n, t in ins.items()}, [0, len(idx)], [-1])
                assert rel_err(tree[idx], alone) <= 1e-5

    def test_plan_tables(self):
        # TreePlan.chunk_tables (the driver's route) gives what the builder here gives, and the oracle's values
        import tree_recurrence as tr

        spec = [(-1, 70), (0, 64), (0, 1), (2, 130), (-1, 5)]
        seg_offsets, parents = trie(spec)
        plan = tr.tree_plan({"tree_cu_seqlens_q": torch.tensor(seg_offsets, dtype=torch.int64),
                             "tree_segment_parents": torch.tensor(parents, dtype=torch.int64)})
        tabs = plan.chunk_tables(CHUNK, "cpu")
        mine = chunk_tables(seg_offsets, parents)
        for name, a, b in zip(("gather", "scatter", "seg_chunk_offsets", "parents", "root_index"), tabs, mine):
            assert torch.equal(a, b), name
        ins = make_inputs(seg_offsets[-1], roots=2)
        x = leaves(ins, torch.float32)
        got = _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs.gather, tabs.scatter,
                                   *tabs.state_args(), x["h0"], 0.0, True)
        want = run_oracle(leaves(ins, torch.float64), seg_offsets, parents, h0="per_root")
        assert rel_err(got, want) <= 1e-5

    def test_bf16_inputs_cpu(self):
        check([(-1, 70), (0, 65)], dtype=torch.bfloat16, tol=1e-2, grad_tol=3e-2, measure=rel_rms)

    def test_errors(self):
        seg_offsets, parents = trie([(-1, 10)])
        x = leaves(make_inputs(10), torch.float32)
        tabs = list(chunk_tables(seg_offsets, parents))
        with pytest.raises(ValueError, match="multiple of key heads"):
            _ops().gdn_tree_scan(x["q"], x["k"], x["v"][:, :3], x["g"][:, :3], x["beta"][:, :3], *tabs, None, 0.0, True)
        with pytest.raises(ValueError, match="scatter"):
            _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], tabs[0], tabs[1][:5], *tabs[2:], None, 0.0, True)
        with pytest.raises(ValueError, match="initial_state"):
            _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"], x["beta"], *tabs, torch.zeros(3, 3), 0.0, True)
        with pytest.raises(ValueError, match="g must be"):
            _ops().gdn_tree_scan(x["q"], x["k"], x["v"], x["g"][:, :1], x["beta"], *tabs, None, 0.0, True)


# ------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestChunkedCUDA:
    def test_fp32_tries(self):
        rng = random.Random(7)
        for spec in (rand_spec(rng, "deep"), rand_spec(rng, "wide"), [(-1, 1), (0, 63), (0, 64), (2, 65)]):
            check(spec, device="cuda", h0="shared", K=32, V=32)

    def test_fp32_strong_and_per_root(self):
        check([(-1, 150), (-1, 65), (0, 64), (1, 1)], device="cuda", strong=True, h0="per_root", K=64, V=64, HK=2, HV=4)

    def test_8k_segment(self):
        check([(-1, 8192), (0, 100)], device="cuda", h0="shared", K=64, V=64, HK=1, HV=2)

    def test_bf16(self):
        rng = random.Random(3)
        check(rand_spec(rng, "wide"), device="cuda", dtype=torch.bfloat16, tol=5e-3, grad_tol=2e-2, measure=rel_rms,
              h0="shared", K=128, V=128, HK=1, HV=2)
        check([(-1, 8192), (0, 70)], device="cuda", dtype=torch.bfloat16, tol=5e-3, grad_tol=2e-2, measure=rel_rms,
              K=128, V=128, HK=1, HV=2, strong=True)
