"""Micro-benchmark of chunk_state_pass (the inter-chunk state pass of chunked GDN / SSD) on CUDA.

Workloads: GRPO = 8 prompts of 2048 tokens, each with 8 completions of 512 (49,152
unique tokens); the same tokens as one flat row; 64 unrelated chains of 2,560 tokens. H=32,
K=V=128, C=64, bf16 and fp32 inputs. Forward and backward op times (CUDA events, medians after
warm-up), bytes moved and FLOPs counted by hand, and the fraction of 4.3 TB/s and of ~60 TFLOP/s
fp32 FMA peak they reach. JSON to --out (default benchmarks/results/chunk_state_pass_h200.json).

  python3 benchmarks/chunk_state_pass_bench.py [--out FILE] [--repeat 20] [--small]
  --small: one tiny case, one iteration (for compute-sanitizer).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import tree_recurrence as tr
from tree_recurrence import plugins

from timing import median_ms  # benchmarks/ is the script's folder, first on sys.path

HBM_BYTES_PER_S = 4.3e12
FP32_FLOPS = 60e12


def plan_of(lengths, parents):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    return tr.tree_plan({"tree_cu_seqlens_q": cu, "tree_segment_parents": torch.tensor(parents, dtype=torch.int64)})


def workloads(small):
    if small:
        return {"small": ([70, 5, 64, 130], [-1, 0, 0, 2])}
    grpo_l, grpo_p = [], []
    for _ in range(8):
        root = len(grpo_l)
        grpo_l.append(2048)
        grpo_p.append(-1)
        for _ in range(8):
            grpo_l.append(512)
            grpo_p.append(root)
    return {
        "grpo_tree": (grpo_l, grpo_p),
        "flat_row": ([49152], [-1]),
        "chains_64x2560": ([2560] * 64, [-1] * 64),
    }




def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/chunk_state_pass_h200.json")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    plugins.families()
    ops = plugins.shared_ops()  # torch.ops.tree_recurrence (the shared ops library)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    H, K, V, C = (2, 100, 70, 16) if args.small else (32, 128, 128, 64)
    repeat = 1 if args.small else args.repeat
    results = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "heads": H, "k": K, "v": V,
               "chunk": C, "peaks": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "fp32_flops": FP32_FLOPS}, "cases": []}
    for name, (lengths, parents) in workloads(args.small).items():
        plan = plan_of(lengths, parents)
        tables = plan.chunk_tables(C, dev)
        NC = tables.num_chunks
        for dtype in ([torch.float32] if args.small else [torch.bfloat16, torch.float32]):
            gen = torch.Generator(device=dev).manual_seed(0)
            scale = 0.6 / (C**0.5 + K**0.5)
            w = (torch.randn(NC, H, C, K, device=dev, generator=gen) * scale).to(dtype)
            kd = (torch.randn(NC, H, C, K, device=dev, generator=gen) * scale).to(dtype)
            u = torch.randn(NC, H, C, V, device=dev, generator=gen).to(dtype)
            decay = torch.rand(NC, H, device=dev, generator=gen) * 0.5 + 0.5
            h0 = torch.randn(H, K, V, device=dev, generator=gen)
            args_t = tables.state_args()
            fwd = lambda: ops.chunk_state_pass(w, u, kd, decay, h0, *args_t)  # noqa: E731
            h, v_new = fwd()
            gh, gv = torch.randn_like(h), torch.randn_like(v_new)
            bwd = lambda: ops.chunk_state_pass_backward(gh, gv, w, kd, decay, h, v_new, h0, *args_t)  # noqa: E731
            sync()
            t0 = time.perf_counter()
            fwd_ms, fwd_min = median_ms(fwd, repeat)
            bwd_ms, bwd_min = median_ms(bwd, repeat)
            # The backward's ATen part alone (grad_w, grad_kd, grad_decay from the kernel's fp32 outputs).
            gu32 = torch.randn(NC, H, C, V, device=dev)
            ds32 = torch.randn_like(h)
            mm = torch.float32 if dtype == torch.float32 else dtype  # as chunk_state_op.h
            post = lambda: (torch.matmul(gu32.to(mm), h.to(mm).transpose(-1, -2)).neg_().to(dtype),  # noqa: E731
                            torch.matmul(v_new.to(mm), ds32.to(mm).transpose(-1, -2)).to(dtype), gu32.to(dtype))
            post_ms, _ = median_ms(post, repeat)
            del gu32, ds32
            bwd_peak = 0
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                bwd()
                torch.cuda.synchronize()
                bwd_peak = torch.cuda.max_memory_allocated() - base
            e = torch.tensor([], dtype=dtype).element_size()
            chunk_rows = NC * H * C
            state = NC * H * K * V
            tiles = (V + 31) // 32
            # Forward: w, kd read once per V tile (L2 serves the repeats), u read, v_new written (in
            # dtype), h written (fp32). Two C x K x V products per chunk and head.
            fwd_bytes = chunk_rows * (2 * K * e + 2 * V * e) + state * 4
            fwd_flops = 2 * 2 * chunk_rows * K * V
            # Backward kernel: reads kd, w, grad_v_new, grad_h; writes grad_u, grad_state (fp32).
            # Then grad_w = -grad_u h^T, grad_kd = v_new dS^T, grad_decay = <h, dS>, casts.
            bwd_kernel_bytes = chunk_rows * (2 * K * e + V * e + V * 4) + state * (4 + 4)
            bwd_post_bytes = state * 4 * 4 + chunk_rows * (V * 4 + V * e + 2 * K * e + V * 4 + V * e)
            bwd_flops = 4 * 2 * chunk_rows * K * V + 2 * state
            case = {
                "workload": name, "dtype": str(dtype).replace("torch.", ""), "tokens": sum(lengths),
                "segments": len(lengths), "levels": len(tables.level_offsets) - 1, "chunks": NC,
                "blocks_per_level": [(b - a) * H * tiles for a, b in zip(tables.level_offsets, tables.level_offsets[1:])],
                "fwd_ms": fwd_ms, "fwd_min_ms": fwd_min, "bwd_ms": bwd_ms, "bwd_min_ms": bwd_min,
                "bwd_aten_post_ms": post_ms, "bwd_kernel_ms_estimate": bwd_ms - post_ms,
                "fwd_bytes": fwd_bytes, "fwd_flops": fwd_flops,
                "bwd_bytes": bwd_kernel_bytes + bwd_post_bytes, "bwd_flops": bwd_flops,
                "fwd_hbm_fraction": fwd_bytes / (fwd_ms * 1e-3) / HBM_BYTES_PER_S,
                "fwd_fp32_fma_fraction": fwd_flops / (fwd_ms * 1e-3) / FP32_FLOPS,
                "bwd_hbm_fraction": (bwd_kernel_bytes + bwd_post_bytes) / (bwd_ms * 1e-3) / HBM_BYTES_PER_S,
                "bwd_fp32_fma_fraction": bwd_flops / (bwd_ms * 1e-3) / FP32_FLOPS,
                "bwd_peak_extra_bytes": bwd_peak,
                "wall_s": time.perf_counter() - t0,
            }
            results["cases"].append(case)
            print(f"{name:16s} {case['dtype']:8s} chunks {NC:5d} levels {case['levels']} fwd {fwd_ms:7.3f} ms "
                  f"({case['fwd_hbm_fraction']:.2f} HBM, {case['fwd_fp32_fma_fraction']:.2f} FMA)  bwd {bwd_ms:7.3f} ms "
                  f"({case['bwd_hbm_fraction']:.2f} HBM, {case['bwd_fp32_fma_fraction']:.2f} FMA; ATen part {post_ms:.3f} ms)",
                  flush=True)
            del w, kd, u, h, v_new, gh, gv
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if args.small:
        return
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, os.path.basename(args.out)), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
