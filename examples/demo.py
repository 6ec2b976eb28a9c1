"""Demo: a tiny real Qwen3.5 (random weights, built from a transformers config) trains on one
tree-packed row made by TRL's own packer, and is checked against every sample run alone.

Run with `bash scripts/demo.sh` (installs what it needs), or `python3 examples/demo.py` once
tree-recurrence, transformers 5.17 and trl 1.16 are installed.
"""

from __future__ import annotations

import argparse
import importlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tree_recurrence
from tree_recurrence import driver  # noqa: F401  (decisions)
from tree_recurrence.attention import register_tree_attention
from tree_recurrence.stand_ins import bind_stand_ins


def tiny_qwen3_5(attn_implementation: str, dtype: torch.dtype):
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(dtype)


def rollouts(generator: torch.Generator) -> list[dict]:
    """Two GRPO groups (a prompt, four completions each) and a three-turn conversation."""
    def tokens(n):
        return torch.randint(0, 256, (n,), generator=generator)

    samples = []
    for group in range(2):
        prompt = tokens(40)
        for _ in range(4):
            completion = tokens(int(torch.randint(1, 24, (1,), generator=generator)))
            samples.append((group, torch.cat([prompt, completion]), len(prompt)))
    history = tokens(30)
    for turn in range(3):
        history = torch.cat([history, tokens(12)])
        samples.append((2, history.clone(), len(history) - 12))
    return [
        {"input_ids": ids, "completion_mask": (torch.arange(len(ids)) >= start).long(),
         "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": group}
        for group, ids, start in samples
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto", choices=["auto", "native", "fork", "rescan"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                        help="float64 (default) makes gradient comparisons sharp: the A_log/dt_bias gradients are "
                             "sums of many cancelling terms, so fp32 rounding alone moves them by ~1e-5 absolute")
    parser.add_argument("--installed-kernels", action="store_true",
                        help="keep whatever kernels transformers bound (FLA, causal-conv1d) instead of the stand-ins")
    args = parser.parse_args()
    from trl.experimental.async_grpo.packing import TreeRow

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = tiny_qwen3_5(register_tree_attention(), dtype).to(args.device).train()
    modeling = importlib.import_module(type(model).__module__)
    if not args.installed_kernels:
        # The comparison must be exact, so the families' library stand-ins replace FLA and
        # causal-conv1d, bound exactly as transformers binds the libraries (varlen, per-sequence
        # states, float64-capable, and a backward on every GPU).
        bind_stand_ins(modeling)
        print("kernels: tree_recurrence.stand_ins replace FLA / causal-conv1d (--installed-kernels to keep them)")
    backends = None if args.strategy in ("auto", "native") else {"gated_delta_net": "kernel"}
    support = tree_recurrence.install(model, policy=tree_recurrence.Policy(strategy=args.strategy), backends=backends)
    print(f"install: mode={support.mode} families={support.families} layers={len(support.layers)}")

    samples = rollouts(torch.Generator().manual_seed(1))
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    packed = row.pack()
    tree_kwargs = {k: packed[k].to(args.device) for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    plan = tree_recurrence.tree_plan(tree_kwargs)
    print(f"packed row: {plan}")

    # Tree-packed forward + backward of a per-sample loss (each sample's tokens weighted alike).
    weights = torch.randn(plan.max_path_length, 256, generator=torch.Generator().manual_seed(2)).to(args.device, dtype)
    logits = model(input_ids=packed["input_ids"][None].to(args.device), position_ids=packed["position_ids"][None].to(args.device),
                   use_cache=False, **tree_kwargs).logits[0]
    paths = [plan.array("path_tokens")[a:b].to(args.device) for a, b in
             zip(plan.array("path_offsets")[:-1].tolist(), plan.array("path_offsets")[1:].tolist())]
    loss = sum((logits[p] * weights[: len(p)]).sum() for p in paths)
    loss.backward()
    tree_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # The reference: every sample alone.
    worst_logit, scale = 0.0, 0.0
    for p in paths:
        alone = model(input_ids=packed["input_ids"][None].to(args.device)[:, p], use_cache=False).logits[0]
        worst_logit = max(worst_logit, (alone - logits[p]).abs().max().item())
        scale = max(scale, alone.abs().max().item())
        (alone * weights[: len(p)]).sum().backward()
    worst_grad, worst_name = 0.0, ""
    for n, p in model.named_parameters():
        err = ((p.grad - tree_grads[n]).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
        if err > worst_grad:
            worst_grad, worst_name = err, n
    a_log = max(((p.grad - tree_grads[n]).abs().max() / p.grad.abs().max()).item()
                for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias")))
    strategies = sorted({d[2] for d in driver.decisions})

    print(f"strategies used: {strategies}")
    print(f"logits: max abs error {worst_logit:.3e} (output scale {scale:.3f}, relative {worst_logit / scale:.3e})")
    print(f"gradients: max relative error {worst_grad:.3e} ({worst_name}); A_log/dt_bias {a_log:.3e}")
    print(f"tokens: {plan.num_tokens} forwarded instead of {plan.path_token_total} "
          f"({plan.saved_tokens} saved, {plan.path_token_total / plan.num_tokens:.2f}x packing ratio) "
          f"for {plan.num_leaves} samples")
    ok = worst_logit <= 1e-4 * max(1.0, scale) and worst_grad <= (1e-6 if dtype == torch.float64 else 1e-3)
    print("MATCH: tree-packed row equals the samples run alone" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
