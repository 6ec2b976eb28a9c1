"""GPU benchmark: a tree-packed row against the same unique tokens as one flat row, and against
every sample forwarded separately, over a range of sharing ratios (sum of sample lengths divided
by unique tokens).

Measured, bf16, median of CUDA-event timings:
  conv   - the causal depthwise conv (8192 channels, width 4), forward + backward: this project's
           CUDA tree conv vs the same op on a flat chain vs F.conv1d over the samples (padded batch)
  core   - the gated delta rule core (32 value heads x 128, q/k repeated), forward: fork over FLA's
           varlen kernel (one call per trie level) vs one FLA call over the flat row vs one FLA
           varlen call over every sample (rescan)
  layer  - a whole Qwen3.5 GatedDeltaNet mixer (hidden 2048) forward with the hooks installed:
           tree row vs flat row vs the samples as one right-padded batch

Usage: python benchmarks/bench_gpu.py [--out DIR] [--quick]
Writes bench_gpu.json and bench_gpu.png (speed-up against sharing ratio) into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import tree_recurrence
from tree_recurrence import driver, plugins

from timing import median_ms  # benchmarks/ is the script's folder, first on sys.path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn) -> float:
    """Median milliseconds of fn() (timing.median_ms)."""
    return median_ms(fn, 10)[0]


def forest(groups: int, prompt: int, rollouts: int, completion: int, device) -> dict:
    """GRPO-like row: `groups` prompts, each with `rollouts` completions, parents format."""
    offsets, parents = [0], []
    for _ in range(groups):
        root = len(parents)
        if prompt > 0:
            offsets.append(offsets[-1] + prompt)
            parents.append(-1)
        for _ in range(rollouts):
            offsets.append(offsets[-1] + completion)
            parents.append(root if prompt > 0 else -1)
    return {"tree_cu_seqlens_q": torch.tensor(offsets, device=device),
            "tree_segment_parents": torch.tensor(parents, device=device)}


def bench_conv(plan, channels=8192, width=4):
    n = plan.num_tokens
    x = torch.randn(1, channels, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(channels, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1, channels, n, device="cuda", dtype=torch.bfloat16)
    chain = tree_recurrence.tree_plan({"tree_cu_seqlens_q": torch.tensor([0, n], device="cuda"),
                                       "tree_segment_parents": torch.tensor([-1], device="cuda")})

    def tree(p=plan):
        y = driver.tree_conv("gated_delta_net", x, w, None, "silu", p)
        torch.autograd.grad(y, (x, w), gy)

    gather, _ = plan.padded_paths("cuda")
    xs = x.detach()[0][:, gather.clamp(min=0)].permute(1, 0, 2).contiguous().requires_grad_()  # (P, C, Lmax)
    gys = torch.randn_like(xs)

    def separate():
        y = F.silu(F.conv1d(xs, w.unsqueeze(1), padding=width - 1, groups=channels)[..., : xs.shape[-1]])
        torch.autograd.grad(y, (xs, w), gys)

    return {"tree": timed(tree), "flat": timed(lambda: tree(chain)), "separate": timed(separate)}


def gdn_inputs(n, heads=32, dim=128):
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    q, k, v = t(1, n, heads, dim), t(1, n, heads, dim), t(1, n, heads, dim)
    g = F.logsigmoid(torch.randn(1, n, heads, device="cuda")).float() * 0.1
    beta = torch.sigmoid(t(1, n, heads))
    return q, k, v, g, beta


def bench_core(plan, fla_chunk):
    spec = plugins.families()["gated_delta_net"]["manifest"]["seams"]["torch_chunk_gated_delta_rule"]
    q, k, v, g, beta = gdn_inputs(plan.num_tokens)
    kwargs = dict(g=g, beta=beta, output_final_state=False, use_qk_l2norm_in_kernel=True)

    def strategy(name):
        policy = tree_recurrence.Policy(strategy=name)

        def run():
            call = driver.SeamCall.bind("gated_delta_net", "torch_chunk_gated_delta_rule", spec, fla_chunk, plan, (q, k, v),
                                        dict(kwargs))
            return driver.run_scan(call, "kernel", policy)
        return run

    flat_cu = torch.tensor([0, plan.num_tokens], device="cuda", dtype=torch.long)
    with torch.no_grad():
        return {"tree": timed(strategy("fork")), "separate": timed(strategy("rescan")),
                "flat": timed(lambda: fla_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=flat_cu))}


def bench_layer(plan, layer, hidden=2048):
    x = torch.randn(1, plan.num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    kw = {"tree_cu_seqlens_q": plan._tree_kwargs["tree_cu_seqlens_q"], "tree_segment_parents": plan._tree_kwargs["tree_segment_parents"]}
    gather, _ = plan.padded_paths("cuda")
    xs = x[0][gather.clamp(min=0)]  # (P, Lmax, hidden): samples as a right-padded batch
    mask = (gather >= 0).long()
    with torch.no_grad():
        return {"tree": timed(lambda: layer(x, **kw)), "flat": timed(lambda: layer(x)),
                "separate": timed(lambda: layer(xs, attention_mask=mask))}


def gdn_layer():
    from transformers import AutoConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    config = AutoConfig.for_model("qwen3_5_text", hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                  num_hidden_layers=1, layer_types=["linear_attention"])
    layer = modeling.Qwen3_5GatedDeltaNet(config, layer_idx=0).to("cuda", torch.bfloat16).eval()
    holder = torch.nn.Module()
    holder.linear_attn = layer
    holder.config = config
    support = tree_recurrence.install(holder)
    log(f"layer hooks: {support.mode} {support.families}")
    return layer


def main():
    parser = argparse.ArgumentParser(description="tree vs flat vs separate on one GPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="two sharing ratios only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu needs a CUDA GPU")
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        fla_chunk = None
        log("FLA not importable: core and layer benchmarks skipped")
    layer = gdn_layer() if fla_chunk is not None else None

    prompts = [0, 512, 2048, 8192] if args.quick else [0, 256, 1024, 2048, 4096, 8192]
    rows = []
    for prompt in prompts:
        kw = forest(groups=4, prompt=prompt, rollouts=4, completion=512, device="cuda")
        plan = tree_recurrence.tree_plan(kw)
        plan._tree_kwargs = kw
        ratio = plan.path_token_total / plan.num_tokens
        row = {"prompt": prompt, "unique_tokens": plan.num_tokens, "path_tokens": plan.path_token_total,
               "sharing_ratio": round(ratio, 3), "levels": plan.num_levels}
        log(f"row: prompt {prompt}, {plan.num_tokens} unique tokens, {plan.path_token_total} sample tokens, ratio {ratio:.2f}")
        row["conv_fwd_bwd_ms"] = bench_conv(plan)
        log(f"  conv fwd+bwd ms {row['conv_fwd_bwd_ms']}")
        if fla_chunk is not None:
            row["core_fwd_ms"] = bench_core(plan, fla_chunk)
            log(f"  GDN core fwd ms {row['core_fwd_ms']}")
            row["layer_fwd_ms"] = bench_layer(plan, layer)
            log(f"  GDN layer fwd ms {row['layer_fwd_ms']}")
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print("\nratio | what | tree ms | flat ms | separate ms | separate/tree | flat/tree")
    for row in rows:
        for key in ("conv_fwd_bwd_ms", "core_fwd_ms", "layer_fwd_ms"):
            if key in row:
                t = row[key]
                print(f"{row['sharing_ratio']:5.2f} | {key:14s} | {t['tree']:7.3f} | {t['flat']:7.3f} | {t['separate']:8.3f} | "
                      f"{t['separate'] / t['tree']:5.2f}x | {t['flat'] / t['tree']:5.2f}x")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ratios = [r["sharing_ratio"] for r in rows]
        ax.plot(ratios, ratios, "k--", label="token ratio (ideal)")
        for key, label in (("conv_fwd_bwd_ms", "tree conv fwd+bwd"), ("core_fwd_ms", "GDN core fwd (FLA fork)"),
                           ("layer_fwd_ms", "GDN layer fwd")):
            if key in rows[0]:
                ax.plot(ratios, [r[key]["separate"] / r[key]["tree"] for r in rows], "o-", label=label)
        ax.set_xlabel("sharing ratio (sample tokens / unique tokens)")
        ax.set_ylabel("speed-up over samples forwarded separately")
        ax.set_title(torch.cuda.get_device_name())
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_gpu.png"), dpi=120)
    except ImportError:
        log("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
