"""The fused SSD forward's kernels under each forward switch, on the GRPO trie and the flat row (bf16, H 128,
P 64, G 8, N 128, chunk 64): torch.profiler CUDA time per kernel over a few no_grad forwards, in one process
(the SSD forward switches are read per call), and whether the outputs equal the default's bitwise.

  python benchmarks/ssd_fwd_variants.py [--repeats 5] [--small]

Variants: default (chunk scan v3, state pass 4 chunks ahead), TREE_RECURRENCE_SSD_FWD_SCAN=v2, and on the flat
row (three-kernel path) TREE_RECURRENCE_SSD_FWD_STATE_PASS=v1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssd_bench  # noqa: E402
from profile_kernels import kernel_times  # noqa: E402
from timing import Shape  # noqa: E402

SWITCHES = ("TREE_RECURRENCE_SSD_FWD_SCAN", "TREE_RECURRENCE_SSD_FWD_STATE_PASS")
VARIANTS = {"default": {}, "scan v2": {"TREE_RECURRENCE_SSD_FWD_SCAN": "v2"},
            "state pass v1": {"TREE_RECURRENCE_SSD_FWD_STATE_PASS": "v1"}}


def set_env(env):
    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    shape = Shape(args.small)
    dims = (8, 16, 2, 16) if args.small else (128, 64, 8, 128)
    layouts = shape.layouts()
    for name in ("trie", "flat"):
        info, fns = ssd_bench.ours(layouts[name], dims, torch.bfloat16, "cuda", 64)
        ref = None
        for variant, env in VARIANTS.items():
            if name == "trie" and variant == "state pass v1":
                continue  # the trie takes the fused chunk-state pass (no separate state pass)
            set_env(env)
            fns["fwd"]()  # warm-up
            torch.cuda.synchronize()
            events, total = kernel_times(fns["fwd"], args.repeats)
            print(f"\n== {name} ({info['tokens']} tokens, {info['chunks']} chunks), {variant}: {total:.3f} ms of "
                  f"kernel time per forward (mean of {args.repeats})")
            for e in events[:8]:
                t = e.device_time_total / args.repeats / 1e3
                print(f"{t:8.3f} {e.count // args.repeats:4d}  {e.key[:130]}")
            with torch.no_grad():
                out = ssd_bench_output(fns)
            if ref is None:
                ref = out
            else:
                print(f"   output bitwise equal to the default's: {torch.equal(out, ref)}")
    set_env({})


def ssd_bench_output(fns):
    """The forward's output (the no_grad closure returns nothing; its run() does)."""
    fwd = fns["fwd"]
    for cell in fwd.__closure__ or ():
        f = cell.cell_contents
        if callable(f) and getattr(f, "__name__", "") == "run":
            return f()
    raise RuntimeError("ssd_bench.ours's fwd closure has no run()")


if __name__ == "__main__":
    main()
