"""Benchmark of the Mamba2 SSD tree scan (op ``ssd_tree_scan``, issue 10): the chunked composite over
the plan's chunk tables, forward and forward+backward, on the GPU (CUDA events, median of >= 10
timed runs after warm-up, peak memory per run).

Workloads (Nemotron-H-like dims by default: H 128, P 64, N 128, G 8, bf16):
  grpo       8 prompts x 8 completions, prompt 2048, completion 512 (49,152 unique tokens):
             tree   the trie (8 roots, 64 children)
             flat   one row of the 49,152 unique tokens (one segment)
             chains the 64 samples as chains (64 roots x 2,560 tokens: the same kernel with sequence
                    resets; also what rescanning every path costs)
  nosharing  64 x 2,560 tokens, no prefix shared: tree (64 roots) vs chains (the same rows as chains)

  python benchmarks/ssd_bench.py [--out benchmarks/results/ssd_bench.json] [--small] [--repeats 10]
``--small`` shrinks every size (a CPU smoke run of the script itself; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import device_name, plan_of, save, time_it

from tree_recurrence import plugins

FAMILY = "mamba2"
CHUNK = 64


def workloads(small: bool):
    prompt, completion, prompts, per_prompt = (128, 32, 2, 4) if small else (2048, 512, 8, 8)
    samples = prompts * per_prompt
    tree_lengths, tree_parents = [], []
    for _ in range(prompts):
        root = len(tree_lengths)
        tree_lengths.append(prompt)
        tree_parents.append(-1)
        tree_lengths += [completion] * per_prompt
        tree_parents += [root] * per_prompt
    unique = sum(tree_lengths)
    path = prompt + completion
    chains = ([path] * samples, [-1] * samples)
    return {
        "grpo": {"tree": (tree_lengths, tree_parents), "flat": ([unique], [-1]), "chains": chains},
        "nosharing": {"tree": chains, "chains": chains},
    }


def inputs(T, H, P, G, N, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return dict(x=r(T, H, P), dt=r(T, H), B=r(T, G, N) * N ** -0.5, C=r(T, G, N) * N ** -0.5, z=r(T, H, P),
                A=-torch.rand(H, generator=g).to(device) * 4 - 0.5, D=torch.rand(H, generator=g).to(device),
                dt_bias=torch.randn(H, generator=g).to(device) * 0.5 - 2.0)


def run_op(ins, tables):
    return plugins.ops(FAMILY).ssd_tree_scan(
        ins["x"], ins["dt"], ins["B"], ins["C"], tables.gather, tables.scatter, *tables.state_args(), None, A=ins["A"],
        dt_limit=[0.0, float("inf")], D=ins["D"], dt_bias=ins["dt_bias"], dt_softplus=True, z=ins["z"])


def bench_case(lengths, parents, dims, dtype, device, repeats):
    H, P, G, N = dims
    T = sum(lengths)
    plan = plan_of(lengths, parents, device)
    tables = plan.chunk_tables(CHUNK, device)
    ins = inputs(T, H, P, G, N, dtype, device)
    grads = [ins[k].requires_grad_() for k in ("x", "dt", "B", "C", "z", "D", "dt_bias", "A")]

    def fwd():
        with torch.no_grad():
            run_op(ins, tables)

    w = torch.randn(T, H, P, device=device)

    def fwd_bwd():
        y = run_op(ins, tables)
        torch.autograd.grad((y * w).sum(), grads)

    out = {"tokens": T, "segments": len(lengths), "chunks": int(tables.num_chunks)}
    out["fwd"] = time_it(fwd, repeats, device, warmup=2)
    out["fwd_bwd"] = time_it(fwd_bwd, repeats, device, warmup=2)
    out["fwd_bwd_tokens_per_s"] = T / (out["fwd_bwd"]["median_ms"] / 1e3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/ssd_bench.json")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = (8, 16, 2, 16) if args.small else (128, 64, 8, 128)
    dtype = getattr(torch, args.dtype)
    result = {"device": device_name(device),
              "torch": torch.__version__, "dims": dict(zip(("H", "P", "G", "N"), dims)), "dtype": args.dtype,
              "chunk": CHUNK, "small": args.small, "repeats": args.repeats, "workloads": {}}
    for name, cases in workloads(args.small).items():
        result["workloads"][name] = {}
        for case, (lengths, parents) in cases.items():
            try:
                r = bench_case(lengths, parents, dims, dtype, device, args.repeats)
            except torch.OutOfMemoryError as e:  # noqa: PERF203
                r = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                torch.cuda.empty_cache()
            result["workloads"][name][case] = r
            print(name, case, json.dumps(r), flush=True)
    g = result["workloads"]["grpo"]
    ratio = lambda a, b: (a["fwd_bwd"]["median_ms"] / b["fwd_bwd"]["median_ms"]) if "fwd_bwd" in a and "fwd_bwd" in b else None  # noqa: E731
    n = result["workloads"]["nosharing"]
    result["summary"] = {
        "grpo_tree_over_flat_fwd_bwd": ratio(g["tree"], g["flat"]),  # target <= 1.10
        "grpo_chains_over_tree_fwd_bwd": ratio(g["chains"], g["tree"]),  # target >= 3.0
        "nosharing_tree_over_chains_fwd_bwd": ratio(n["tree"], n["chains"]),  # target <= 1.03
    }
    print(json.dumps(result["summary"]))
    save(result, args.out)


if __name__ == "__main__":
    main()
