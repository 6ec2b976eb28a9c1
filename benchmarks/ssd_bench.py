"""Benchmark of the Mamba2 SSD tree core (op ``ssd_tree_scan``, issues 10 and 20) beside mamba-ssm, in one
process: forward and forward + backward of each case (CUDA events, median of up to --repeats timed runs
after --warmup untimed ones, fewer for slow cases; peak memory above the inputs per run).

Dims (Nemotron-H-like): H 128, P 64, N 128, G 8, bf16 x, dt, B, C, z; fp32 A (H), D (H), dt_bias (H);
softplus of dt + dt_bias in the kernel, the z gate, gradients of x, dt, B, C, z, D, dt_bias, A. GRPO
shape: 8 prompts x 8 completions, prompt 2048, completion 512 (49,152 unique tokens, 163,840 sample
tokens). Cases (--cases picks by name or glob):
  tree               ours on the trie (8 roots, 64 children), as the model's seam calls the op
  flat               ours on one row of the 49,152 unique tokens (one segment)
  mamba_fork         mamba-ssm forked level by level on the trie: the 8 prompts as a batch of 8 x 2048
                     (return_final_states=True), then the 64 completions as a batch of 64 x 512 from
                     their prompt's final state (initial_states); the backward goes through both levels
  mamba_chains_seq   mamba-ssm on the 64 samples packed in one row with seq_idx (batch 1, 163,840 tokens)
  mamba_chains_batch mamba-ssm on the 64 samples as a batch of 64 x 2,560
  mamba_flat         mamba-ssm on the flat row of 49,152 tokens (batch 1)
  chains             ours on the 64 samples as chains (64 roots of 2,560: 163,840 tokens)
  forest             ours on the no-sharing forest: each sample a prompt root with its one completion
                     child (128 segments, nothing shared)
  flat_all           ours on one row of the 163,840 tokens (the chains without resets)
mamba-ssm runs its Triton mamba_chunk_scan_combined at --mamba-chunk (default 128, the models' configs);
ours at --chunk (the plan's chunk tables' width; the seam's default 64).

  python benchmarks/ssd_bench.py [--out benchmarks/results/ssd_bench.json] [--cases tree,mamba_*]
                                 [--repeats 10] [--small] [--peers auto|on|off] [--chunk 64]
``--small``: tiny sizes, peers off (a CPU smoke run of the script; its numbers mean nothing). mamba-ssm
imports from the environment (PYTHONPATH), else from the checkout's .peers/mamba or /tmp/peers
(peers.py).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from timing import (Runner, Shape, bench_arguments, bench_result, parse_bench_arguments, peak_ratio, peer_modes,  # noqa: E402
                    peer_skipped, modes, plan_of, print_table, ratio, save, target, tokens_per_ms)

from tree_recurrence import plugins  # noqa: E402

FAMILY = "mamba2"
TOKEN = ("x", "dt", "B", "C", "z")
PARAMS = ("D", "dt_bias", "A")


def inputs(T, H, P, G, N, dtype, device, seed=0):
    """Random inputs of T tokens: x, z (T, H, P), dt (T, H), B, C (T, G, N) in dtype; A < 0, D, dt_bias (H) fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return dict(x=r(T, H, P), dt=r(T, H), B=r(T, G, N) * N ** -0.5, C=r(T, G, N) * N ** -0.5, z=r(T, H, P),
                A=-torch.rand(H, generator=g).to(device) * 4 - 0.5, D=torch.rand(H, generator=g).to(device),
                dt_bias=torch.randn(H, generator=g).to(device) * 0.5 - 2.0)


def ours(layout, dims, dtype, device, chunk):
    lengths, parents = layout
    H, P, G, N = dims
    T = sum(lengths)
    tables = plan_of(lengths, parents, device).chunk_tables(chunk, device)
    ins = inputs(T, H, P, G, N, dtype, device)
    leaves = [ins[k].requires_grad_() for k in TOKEN + PARAMS]
    w = torch.randn(T, H, P, device=device, dtype=dtype)
    op = plugins.ops(FAMILY).ssd_tree_scan

    def run():
        return op(ins["x"], ins["dt"], ins["B"], ins["C"], tables.gather, tables.scatter, *tables.state_args(), None,
                  A=ins["A"], dt_limit=[0.0, float("inf")], D=ins["D"], dt_bias=ins["dt_bias"], dt_softplus=True,
                  z=ins["z"])

    info = {"tokens": T, "segments": len(lengths), "chunks": int(tables.num_chunks), "chunk": chunk,
            "impl": "ours (ssd_tree_scan)"}
    return info, modes(run, leaves, w)


class Mamba:
    """mamba-ssm's mamba_chunk_scan_combined on (batch, seqlen, ...) tensors."""

    def __init__(self, fn, info, chunk):
        self.fn, self.info, self.chunk = fn, info, chunk

    def tensors(self, batch, seqlen, dims, dtype, device, seed):
        H, P, G, N = dims
        flat = inputs(batch * seqlen, H, P, G, N, dtype, device, seed)
        ins = {k: (flat[k].reshape(batch, seqlen, *flat[k].shape[1:]) if k in TOKEN else flat[k]) for k in flat}
        leaves = [ins[k].requires_grad_() for k in TOKEN + PARAMS]
        return ins, leaves, torch.randn(batch, seqlen, H, P, device=device, dtype=dtype)

    def call(self, ins, seq_idx=None, h0=None, final=False):
        return self.fn(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], self.chunk, D=ins["D"], z=ins["z"],
                       dt_bias=ins["dt_bias"], initial_states=h0, seq_idx=seq_idx, dt_softplus=True,
                       dt_limit=(0.0, float("inf")), return_final_states=final)

    def rows(self, batch, seqlen, dims, dtype, device, packed=None):
        """mamba-ssm on ``batch`` rows of ``seqlen`` tokens; with ``packed`` (a list of lengths), one row
        of them told apart by seq_idx."""
        ins, leaves, w = self.tensors(batch, seqlen, dims, dtype, device, 0)
        seq_idx = None
        if packed is not None:
            seq_idx = torch.repeat_interleave(torch.arange(len(packed), dtype=torch.int32),
                                              torch.tensor(packed)).unsqueeze(0).to(device)

        info = {"tokens": batch * seqlen, "segments": len(packed) if packed else batch, "chunk": self.chunk,
                "impl": f"mamba-ssm {self.info.get('mamba_ssm')} " + ("seq_idx" if packed else f"batch {batch} x {seqlen}")}
        return info, peer_modes(lambda: self.call(ins, seq_idx), leaves, w)

    def fork(self, shape: Shape, dims, dtype, device):
        """Level by level on the GRPO trie: the prompts as one batch, their final states the initial
        states of the completions' batch (every level one length: the GRPO trie's are)."""
        r_ins, r_leaves, r_w = self.tensors(shape.prompts, shape.prompt, dims, dtype, device, 0)
        c_ins, c_leaves, c_w = self.tensors(shape.samples, shape.completion, dims, dtype, device, 1)
        for k in PARAMS:  # one set of layer parameters for both levels (its gradient sums over them)
            c_ins[k] = r_ins[k]
        c_leaves = [c_ins[k] for k in TOKEN]
        parent = torch.arange(shape.prompts, device=device).repeat_interleave(shape.per_prompt)

        def run():
            y_r, h_r = self.call(r_ins, final=True)
            y_c = self.call(c_ins, h0=h_r.index_select(0, parent))
            return y_r, y_c

        info = {"tokens": shape.unique(), "segments": shape.prompts + shape.samples, "chunk": self.chunk,
                "impl": f"mamba-ssm {self.info.get('mamba_ssm')}, 2 launches of the whole pipeline (one per trie level)"}
        return info, peer_modes(run, r_leaves + c_leaves, (r_w, c_w))


def summarize(result):
    c = result["cases"]
    tok = lambda name, mode: tokens_per_ms(c, name, mode)  # noqa: E731
    pr = lambda a, b: peak_ratio(c, a, b)  # noqa: E731
    chains = [n for n in ("mamba_chains_batch", "mamba_chains_seq") if ratio(c, n, n) is not None]
    best = min(chains, key=lambda n: c[n]["fwd_bwd"]["median_ms"]) if chains else "mamba_chains_batch"
    result["summary"] = {
        f"tree / mamba chains ({best.split('_')[-1]})": target(ratio(c, "tree", best), round(1 / 3, 3), "<="),
        "flat tokens/ms": target(tok("flat", "fwd_bwd"), 3100, ">="),
        "tree / flat": target(ratio(c, "tree", "flat"), 1.05, "<="),
        "forest / chains": target(ratio(c, "forest", "chains"), 1.03, "<="),
        "chains / flat_all (resets' cost)": target(ratio(c, "chains", "flat_all"), 1.03, "<="),
        "peak: flat / mamba flat": target(pr("flat", "mamba_flat"), 1.0, "<="),
        "peak: chains / mamba chains": target(pr("chains", best), 1.0, "<="),
        "tree / mamba fork": target(ratio(c, "tree", "mamba_fork"), 1.0, "<="),
        "mamba chains / tree (speed-up)": target(ratio(c, best, "tree"), 3.0, ">="),
        "flat tokens/ms, forward": target(tok("flat", "fwd"), None, ">="),
        "mamba flat tokens/ms": target(tok("mamba_flat", "fwd_bwd"), None, ">="),
    }


def main():
    ap = bench_arguments(__doc__, "benchmarks/results/ssd_bench.json", 2, "time mamba-ssm (auto: on CUDA unless --small)")
    ap.add_argument("--chunk", type=int, default=64, help="our chunk tables' width (64, 128 or 256)")
    ap.add_argument("--mamba-chunk", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args, device, shape, use_peers = parse_bench_arguments(ap)
    dims = (8, 16, 2, 16) if args.small else (128, 64, 8, 128)
    dtype = getattr(torch, args.dtype)
    result = bench_result("SSD core (ssd_tree_scan) beside mamba-ssm", device, args, shape,
                          dict(zip(("H", "P", "G", "N"), dims)), chunk=args.chunk, mamba_chunk=args.mamba_chunk,
                          z_gate=True, dt_softplus=True, D="(H,)")
    mamba = None
    if use_peers:
        fn, info = peers.mamba_ssd()
        result["mamba_ssm"] = info
        mamba = Mamba(fn, info, args.mamba_chunk) if fn is not None else None
    else:
        result["mamba_ssm"] = peer_skipped(args)
    print("mamba-ssm:", result["mamba_ssm"], flush=True)
    runner = Runner(result, args.out, args.cases, args.budget_s, device)
    L = shape.layouts()
    runner.run("tree", lambda: ours(L["trie"], dims, dtype, device, args.chunk))
    runner.run("flat", lambda: ours(L["flat"], dims, dtype, device, args.chunk))
    if mamba is not None:
        runner.run("mamba_fork", lambda: mamba.fork(shape, dims, dtype, device))
        runner.run("mamba_chains_batch", lambda: mamba.rows(shape.samples, shape.path, dims, dtype, device))
        runner.run("mamba_chains_seq", lambda: mamba.rows(1, shape.samples * shape.path, dims, dtype, device,
                                                          packed=L["chains"][0]))
        runner.run("mamba_flat", lambda: mamba.rows(1, shape.unique(), dims, dtype, device))
    runner.run("chains", lambda: ours(L["chains"], dims, dtype, device, args.chunk))
    runner.run("forest", lambda: ours(L["forest"], dims, dtype, device, args.chunk))
    runner.run("flat_all", lambda: ours(L["flat_all"], dims, dtype, device, args.chunk))
    summarize(result)
    save(result, args.out)
    print_table(result)


if __name__ == "__main__":
    main()
