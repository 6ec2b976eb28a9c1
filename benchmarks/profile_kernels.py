"""Where the time of the fused GDN / SSD cores goes, kernel by kernel (torch.profiler, CUDA time per
kernel name over a few forward + backward passes of the GRPO trie), and a single pass for ncu.

  python benchmarks/profile_kernels.py [--family gdn|ssd|both] [--layout trie|flat|both] [--repeats 3] [--once] [--small]
  ncu --clock-control none --section SpeedOfLight -k 'regex:...' python benchmarks/profile_kernels.py --once

--once: one untimed warm-up and one forward + backward per family, no profiler (for ncu).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn_bench  # noqa: E402
import ssd_bench  # noqa: E402
from timing import Shape  # noqa: E402


def kernel_times(fn, repeats: int):
    """``fn()`` run ``repeats`` times under torch.profiler: the kernels that took CUDA time, longest
    first, and the kernel time of one run in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return events, sum(e.device_time_total for e in events) / repeats / 1e3


def cases(small: bool, family: str, layout_name: str):
    """(label, forward / backward closures) per family and layout: the GRPO trie, or its unique tokens
    as one flat row (one segment: the long serial state pass)."""
    shape = Shape(small)
    layouts = shape.layouts()
    out = []
    for lname in (("trie", "flat") if layout_name == "both" else (layout_name,)):
        layout = layouts[lname]
        if family in ("gdn", "both"):
            dims = (2, 4, 16, 16) if small else (16, 32, 128, 128)
            out.append((f"gdn {lname}", gdn_bench.ours(layout, dims, torch.bfloat16, "cuda")[1]))
        if family in ("ssd", "both"):
            dims = (8, 16, 2, 16) if small else (128, 64, 8, 128)
            out.append((f"ssd {lname}", ssd_bench.ours(layout, dims, torch.bfloat16, "cuda", 64)[1]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="both")
    ap.add_argument("--layout", default="trie", choices=["trie", "flat", "both"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    for name, fns in cases(args.small, args.family, args.layout):
        try:
            fns["fwd_bwd"]()  # warm-up (allocator, cudaFuncSetAttribute, ...)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken family must not hide the other one's profile
            import traceback
            print(f"\n== {name}: forward + backward FAILED")
            traceback.print_exc()
            continue
        if args.once:
            fns["fwd_bwd"]()
            torch.cuda.synchronize()
            continue
        events, total = kernel_times(fns["fwd_bwd"], args.repeats)
        print(f"\n== {name}: forward + backward, {total:.2f} ms of kernel time per pass "
              f"(mean of {args.repeats})")
        print(f"{'ms/pass':>8} {'calls':>6} {'%':>5}  kernel")
        for e in events[: args.rows]:
            t = e.device_time_total / args.repeats / 1e3
            print(f"{t:8.3f} {e.count // args.repeats:6d} {100 * t / total:5.1f}  {e.key[:150]}")


if __name__ == "__main__":
    main()
