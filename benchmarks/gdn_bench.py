"""Benchmark of the Gated DeltaNet tree scan (op ``gdn_tree_scan``, issue 9): the chunked composite
(chunk 64, segment-aligned chunks, batched ATen stages around the SDK's chunk_state_pass) over the
plan's chunk tables, forward and forward+backward (CUDA events, median of >= 10 timed runs after
warm-up, peak memory above the inputs per run).

Workloads (Qwen3.5 / Qwen3-Next dims by default: HK 16, HV 32, dk = dv = 128, bf16, l2norm in the
kernel, gradients of q, k, v, g, beta):
  grpo       8 prompts x 8 completions, prompt 2048, completion 512 (49,152 unique tokens):
             tree   the trie (8 roots, 64 children)
             flat   one row of the 49,152 unique tokens (one segment): the same op, no tree
             chains the 64 samples as chains (64 roots x 2,560 = 163,840 tokens: a forest of chains)
  nosharing  64 x 2,560 tokens, no prefix shared:
             tree   the trie of 64 unrelated samples (a forest of 64 chains)
             flat   one row of the 163,840 tokens (one segment): the same tokens without resets
FLA's chunk_gated_delta_rule forward (on the grpo flat row, varlen) is timed for comparison when
``import fla`` works (its backward is not timed: FLA refuses it on Hopper with Triton >= 3.4).

  python benchmarks/gdn_bench.py [--out benchmarks/results/gdn_bench.json] [--small] [--repeats 10]
``--small`` shrinks every size (a CPU smoke run of the script itself; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import device_name, plan_of, save, time_it

from tree_recurrence import plugins

FAMILY = "gated_delta_net"
CHUNK = 64


def workloads(small: bool):
    prompt, completion, prompts, per_prompt = (128, 32, 2, 4) if small else (2048, 512, 8, 8)
    samples = prompts * per_prompt
    lengths, parents = [], []
    for _ in range(prompts):
        root = len(lengths)
        lengths.append(prompt)
        parents.append(-1)
        lengths += [completion] * per_prompt
        parents += [root] * per_prompt
    path = prompt + completion
    chains = ([path] * samples, [-1] * samples)
    return {
        "grpo": {"tree": (lengths, parents), "flat": ([sum(lengths)], [-1]), "chains": chains},
        "nosharing": {"tree": chains, "flat": ([path * samples], [-1])},
    }


def inputs(T, HK, HV, K, V, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    A = torch.rand(HV, generator=g) * 15 + 1  # Qwen3.5's A = exp(A_log) range
    gate = -A * torch.nn.functional.softplus(r(T, HV) - 4.0)
    return dict(q=r(T, HK, K).to(device, dtype), k=r(T, HK, K).to(device, dtype), v=r(T, HV, V).to(device, dtype),
                g=gate.to(device, torch.float32), beta=torch.sigmoid(r(T, HV)).to(device, dtype))


def run_op(ins, tables):
    return plugins.ops(FAMILY).gdn_tree_scan(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], tables.gather,
                                             tables.scatter, *tables.state_args(), None, 0.0, True)


def bench_case(lengths, parents, dims, dtype, device, repeats):
    HK, HV, K, V = dims
    T = sum(lengths)
    tables = plan_of(lengths, parents, device).chunk_tables(CHUNK, device)
    ins = inputs(T, HK, HV, K, V, dtype, device)
    leaves = [ins[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    w = torch.randn(T, HV, V, device=device, dtype=dtype)

    def fwd():
        with torch.no_grad():
            run_op(ins, tables)

    def fwd_bwd():
        o = run_op(ins, tables)
        torch.autograd.grad(o, leaves, w)

    out = {"tokens": T, "segments": len(lengths), "chunks": int(tables.num_chunks)}
    out["fwd"] = time_it(fwd, repeats, device)
    out["fwd_bwd"] = time_it(fwd_bwd, repeats, device)
    out["fwd_tokens_per_ms"] = T / out["fwd"]["median_ms"]
    out["fwd_bwd_tokens_per_ms"] = T / out["fwd_bwd"]["median_ms"]
    return out


def bench_fla(lengths, dims, dtype, device, repeats):
    """FLA's chunk_gated_delta_rule forward on the same tokens as varlen sequences, if importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        import fla
    except Exception as e:  # noqa: BLE001  (any import failure: report it, do not fail the benchmark)
        return {"skipped": f"import fla failed: {type(e).__name__}: {e}"}
    HK, HV, K, V = dims
    T = sum(lengths)
    ins = inputs(T, HK, HV, K, V, dtype, device)
    groups = HV // HK
    q, k = (ins[n].repeat_interleave(groups, 1).unsqueeze(0) for n in ("q", "k"))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(device=device, dtype=torch.long)

    def fwd():
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, ins["v"].unsqueeze(0), ins["g"].unsqueeze(0), ins["beta"].unsqueeze(0),
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    try:
        return {"fla": getattr(fla, "__version__", "?"), "tokens": T, "fwd": time_it(fwd, repeats, device),
                "note": "q and k repeated to HV heads for FLA"}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gdn_bench.json")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = (2, 4, 16, 16) if args.small else (16, 32, 128, 128)
    dtype = getattr(torch, args.dtype)
    result = {"device": device_name(device),
              "torch": torch.__version__, "dims": dict(zip(("HK", "HV", "dk", "dv"), dims)), "dtype": args.dtype,
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
            save(result, args.out)  # after every case: a run cut short keeps what it measured
    grpo_flat = result["workloads"]["grpo"]["flat"]
    result["fla_forward_grpo_flat"] = bench_fla([grpo_flat["tokens"]] if "tokens" in grpo_flat else [0], dims, dtype,
                                                device, args.repeats) if device.type == "cuda" else {"skipped": "no CUDA"}
    print("fla", json.dumps(result["fla_forward_grpo_flat"]), flush=True)
    g, n = result["workloads"]["grpo"], result["workloads"]["nosharing"]

    def ratio(a, b, what="fwd_bwd"):
        return a[what]["median_ms"] / b[what]["median_ms"] if what in a and what in b else None

    fla = result["fla_forward_grpo_flat"]
    result["summary"] = {
        "grpo_tree_over_flat_fwd_bwd": ratio(g["tree"], g["flat"]),        # target <= 1.10
        "grpo_chains_over_tree_fwd_bwd": ratio(g["chains"], g["tree"]),    # target >= 3.0
        "nosharing_tree_over_flat_fwd_bwd": ratio(n["tree"], n["flat"]),   # chains vs no resets (target <= 1.03)
        "grpo_flat_fwd_bwd_tokens_per_ms": g["flat"].get("fwd_bwd_tokens_per_ms"),  # target >= 2000
        "fla_fwd_over_flat_fwd": ratio(fla, g["flat"], "fwd") if "fwd" in fla else None,  # target >= 0.8
    }
    print(json.dumps(result["summary"]))
    save(result, args.out)


if __name__ == "__main__":
    main()
