"""What the op benchmarks (gdn_bench.py, ssd_bench.py) share: the plan of a workload, the timing loop
(CUDA events, warm-up, median of the timed runs, peak memory above what was allocated before each run;
wall clock on the CPU, where only the script itself is checked), the device's name and JSON writing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from tree_recurrence._plan import tree_plan


def plan_of(lengths, parents, device):
    """The tree plan of segments of ``lengths`` whose parents are ``parents`` (-1: a root)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return tree_plan({"tree_cu_seqlens_q": cu.to(device),
                      "tree_segment_parents": torch.tensor(parents, dtype=torch.int32, device=device)})


def time_it(fn, repeats, device, warmup=3):
    """{median_ms, min_ms, runs, peak_gib} of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times),
            "peak_gib": max(peaks) if peaks else None}


def device_name(device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"


def save(result, path):
    """Writes ``result`` as JSON to ``path`` (creating its folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
