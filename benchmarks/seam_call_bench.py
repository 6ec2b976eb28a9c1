"""Host time of one seam call on the CPU with tiny tensors: what the engine adds around the kernel.

A seam wrapper is installed (seams.patch_module, as install does) on a stand-in modeling module whose
seam is a library-like delta-rule kernel (q, k, v, g, beta, initial_state, output_final_state,
cu_seqlens) that returns zeros at once, so that what is timed is the engine: plan lookup, binding,
route, gathers, scatters. Two routes over one small trie (3 levels, 7 segments, 40 tokens):

* native: the gated_delta_net family's native op through the wrapper; ``engine_us`` is the same call
  with the route's op handle replaced by one that returns at once (the op's own time, ``op_us``, is
  the kernel's, not the engine's);
* fork: one kernel call per trie level with the parents' final states (the stand-in kernel). The trie's
  segments are numbered level by level, so the levels' tokens are already in token order (no gathers);
  ``fork_dfs`` is the same trie numbered in DFS pre-order as TRL packs it (one gather per sequence
  tensor and one back to token order).

``reference_op_us`` is one tiny tensor view op (``narrow``) timed the same way: host timings scale with
how loaded the machine is, and a seam call costs about a dozen such ops. Prints median microseconds
per call (and writes JSON with --json). Usage:

    python benchmarks/seam_call_bench.py [--calls 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import types

import torch

import tree_recurrence as tr
from tree_recurrence import driver, plugins, seams

FAMILY, SEAM = "gated_delta_net", "torch_chunk_gated_delta_rule"
# parents of 7 segments (3 levels) and their lengths: 40 tokens
PARENTS = [-1, 0, 0, 1, 1, 2, 2]
LENGTHS = [8, 6, 6, 5, 5, 5, 5]
# the same trie in DFS pre-order (TRL's packing order): 0 -> (1 -> 2, 3), (4 -> 5, 6)
PARENTS_DFS = [-1, 0, 1, 1, 0, 4, 4]


def stand_in_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    use_qk_l2norm_in_kernel=False):
    """A delta-rule kernel with FLA's API that computes nothing (zeros of the right shapes)."""
    rows = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    final = v.new_zeros(rows, v.shape[2], q.shape[3], v.shape[3]) if output_final_state else None
    return v.new_zeros(v.shape), final


def tree_kwargs(parents=PARENTS) -> dict:
    offsets = [0]
    for length in LENGTHS:
        offsets.append(offsets[-1] + length)
    return {"tree_cu_seqlens_q": torch.tensor(offsets, dtype=torch.int32),
            "tree_segment_parents": torch.tensor(parents, dtype=torch.int32)}


def median_us(fn, calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000.0


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    spec = plugins.families()[FAMILY]["manifest"]["seams"][SEAM]
    module = types.ModuleType("seam_call_bench_module")
    module.chunk_rule = stand_in_kernel
    tries = {"native": tree_kwargs(), "fork": tree_kwargs(), "fork_dfs": tree_kwargs(PARENTS_DFS)}
    kwargs = tries["native"]
    n = sum(LENGTHS)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, n, 1, 4, generator=gen) for _ in range(2))
    v = torch.randn(1, n, 1, 4, generator=gen)
    g, beta = -torch.rand(1, n, 1, generator=gen), torch.rand(1, n, 1, generator=gen)
    plan = tr.tree_plan(kwargs)

    results = {}
    with torch.no_grad():
        for case, kwargs in tries.items():
            strategy = case.split("_")[0]
            seams.unpatch_module(module.__name__)
            module.chunk_rule = stand_in_kernel
            seams.patch_module(module, FAMILY, {"chunk_rule": spec}, [], tr.Policy(strategy=strategy), "auto")
            wrapper = module.chunk_rule
            call = lambda kwargs=kwargs: wrapper(q, k, v, g, beta, initial_state=None,  # noqa: E731
                                                 output_final_state=False, use_qk_l2norm_in_kernel=True, **kwargs)
            call()
            assert driver.decisions[-1][2] == strategy, driver.decisions[-1]
            total = median_us(call, args.calls)
            results[case] = {"seam_call_us": round(total, 2)}
            if strategy == "native":
                # The engine alone: the same call with the route's op replaced by one that returns at once.
                op = getattr(plugins.ops(FAMILY), spec["native"]["op"])
                captured = {}

                def stub(*a, **kw):
                    captured.setdefault("call", (a, kw))
                    return out

                out = v[0].new_zeros(v.shape[1:])
                for key, entry in list(plan.cache.items()):
                    if key[:3] == ("route", FAMILY, "chunk_rule"):
                        plan.cache[key] = entry._replace(value=dataclasses.replace(entry.value, op=stub))
                engine = median_us(call, args.calls)
                a, kw = captured["call"]
                op_us = median_us(lambda: op(*a, **kw), max(50, args.calls // 10))
                results[case].update(engine_us=round(engine, 2), op_us=round(op_us, 2))
            else:
                results[case]["engine_us"] = round(total, 2)
            results[case]["reference_op_us"] = round(median_us(lambda: q.narrow(1, 0, 4), args.calls), 2)
        seams.unpatch_module(module.__name__)
    print(json.dumps({"tokens": n, "segments": len(PARENTS), "calls": args.calls, **results}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
