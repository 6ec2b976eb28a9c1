"""Tree conv at the bandwidth limit: the CUDA tree conv (forward, backward) on a GRPO tree row and
on a flat chain of the same length, against depthwise F.conv1d + SiLU on a flat row.

Qwen3.5 mixer width: conv channels 2*16*128 + 32*128 = 8192, width 4, bf16, 49,152 tokens
(8 prompts of 2048 + 64 completions of 512). Achieved GB/s = the bytes the op must move / time:
forward reads x and writes y (4 N C bytes in bf16); backward reads x and grad_y and writes grad_x
(6 N C); weights, ancestors' taps (cache hits) and the weight-gradient partials are not counted.
Target: >= 70% of the H200's ~4.3 TB/s copy rate, never slower than F.conv1d + SiLU.

Usage: python benchmarks/tree_conv_bench.py [--out DIR] [--tokens-check]
Writes tree_conv_bench.json into DIR (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import tree_recurrence
from tree_recurrence import driver

from timing import median_ms  # benchmarks/ is the script's folder, first on sys.path

FAMILY = "gated_delta_net"  # any family that ships the shared tree conv op
COPY_RATE = 4.3e12  # H200 copy bandwidth, bytes/s


def grpo_tree(groups=8, rollouts=8, prompt=2048, completion=512, device="cuda") -> dict:
    offsets, parents = [0], []
    for _ in range(groups):
        root = len(parents)
        offsets.append(offsets[-1] + prompt)
        parents.append(-1)
        for _ in range(rollouts):
            offsets.append(offsets[-1] + completion)
            parents.append(root)
    return {"tree_cu_seqlens_q": torch.tensor(offsets, device=device), "tree_segment_parents": torch.tensor(parents, device=device)}


def chain(n, device="cuda") -> dict:
    return {"tree_cu_seqlens_q": torch.tensor([0, n], device=device), "tree_segment_parents": torch.tensor([-1], device=device)}


def timed(fn) -> float:
    """Median milliseconds of fn() (timing.median_ms)."""
    return median_ms(fn, 20)[0]


def measure(name, forward, x, w, gy, n, c, elem) -> dict:
    """forward(x, w) -> y; times forward, and backward (grad of x and w) alone."""
    with torch.no_grad():
        fwd_ms = timed(lambda: forward(x, w))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = forward(xr, wr)
    bwd_ms = timed(lambda: torch.autograd.grad(y, (xr, wr), gy, retain_graph=True))
    fwd_bytes, bwd_bytes = 2 * n * c * elem, 3 * n * c * elem
    return {"name": name, "forward_ms": fwd_ms, "backward_ms": bwd_ms,
            "forward_GBps": fwd_bytes / (fwd_ms / 1e3) / 1e9, "backward_GBps": bwd_bytes / (bwd_ms / 1e3) / 1e9,
            "forward_pct_of_copy": 100 * fwd_bytes / (fwd_ms / 1e3) / COPY_RATE,
            "backward_pct_of_copy": 100 * bwd_bytes / (bwd_ms / 1e3) / COPY_RATE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--once", action="store_true", help="one launch of each (for ncu), no timing")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, c, width = torch.bfloat16, args.channels, args.width
    tree_kw = grpo_tree()
    tree_plan = tree_recurrence.tree_plan(tree_kw)
    n = tree_plan.num_tokens
    flat_plan = tree_recurrence.tree_plan(chain(n))
    x = torch.randn(n, c, device="cuda", dtype=dtype).t()[None]  # (1, C, N) over an (N, C) buffer, as in the models
    w = torch.randn(c, width, device="cuda", dtype=dtype) * 0.3
    gy = torch.randn(n, c, device="cuda", dtype=dtype).t()[None]

    def tree_fn(plan):
        return lambda xx, ww: driver.tree_conv(FAMILY, xx, ww, None, "silu", plan)

    def conv1d(xx, ww):  # causal depthwise conv on a flat row, channels-first contiguous as F.conv1d wants
        return F.silu(F.conv1d(xx, ww.unsqueeze(1), padding=width - 1, groups=c)[..., :n])

    if args.once:
        for f in (tree_fn(tree_plan), tree_fn(flat_plan)):
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            torch.autograd.grad(f(xr, wr), (xr, wr), gy)
        torch.cuda.synchronize()
        return
    rows = [measure("tree conv, GRPO tree row", tree_fn(tree_plan), x, w, gy, n, c, 2),
            measure("tree conv, flat chain", tree_fn(flat_plan), x, w, gy, n, c, 2),
            measure("F.conv1d + SiLU, flat row", conv1d, x.contiguous(), w, gy.contiguous(), n, c, 2)]
    print(f"tree conv, {n} tokens x {c} channels, width {width}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'':<30}{'fwd ms':>9}{'fwd GB/s':>10}{'% copy':>8}{'bwd ms':>9}{'bwd GB/s':>10}{'% copy':>8}")
    for r in rows:
        print(f"{r['name']:<30}{r['forward_ms']:>9.3f}{r['forward_GBps']:>10.0f}{r['forward_pct_of_copy']:>8.1f}"
              f"{r['backward_ms']:>9.3f}{r['backward_GBps']:>10.0f}{r['backward_pct_of_copy']:>8.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_conv_bench.json").write_text(json.dumps({"tokens": n, "channels": c, "width": width, "dtype": "bfloat16",
                                                          "device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
