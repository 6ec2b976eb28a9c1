"""What a whole-model forward keeps for backward, per token (what decides whether a chains row fits).

    python benchmarks/saved_memory_probe.py --model qwen3_5 [--mode tree|chains|flat] [--groups 2 --rollouts 2]

Builds a model of bench's table (tree_recurrence/bench_models.json) at its realistic width (random
init), hooks it with tree_recurrence.install, runs one forward of a GRPO-shaped row under torch.autograd's
saved_tensors_hooks and sums the storage bytes of every distinct tensor saved for backward
(parameters left out), grouped by shape and dtype: the largest groups name the activations that
make the peak. Also prints the CUDA peak of forward + backward when on the GPU.
"""

from __future__ import annotations

import argparse
import collections

import torch

import tree_recurrence as tr
from tree_recurrence.bench import build_model, grpo_rows, load_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_5")
    ap.add_argument("--mode", default="tree", choices=["tree", "chains", "flat"])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = load_table()  # the package's own table
    model = build_model(table[args.model], False, dtype, device, "tree_flex" if device.type == "cuda" else "tree_sdpa")
    tr.install(model)
    row, weights, _ = grpo_rows(args.groups, args.rollouts, args.prompt, args.completion,
                                model.config.get_text_config().vocab_size, 0, device)[args.mode]
    tokens = row["input_ids"].shape[1]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    groups: collections.Counter = collections.Counter()
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in params and ptr not in seen:
            seen.add(ptr)
            groups[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += storage.nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**row, use_cache=False).logits[0]
    loss = (torch.logsumexp(logits.float(), dim=-1) * weights).sum()
    total = sum(groups.values())
    print(f"{args.model} {args.mode}: {tokens} tokens, saved for backward {total / 2**30:.2f} GiB "
          f"= {total / tokens / 1024:.1f} KiB per token")
    for (shape, dt), nbytes in groups.most_common(args.top):
        print(f"  {nbytes / tokens / 1024:8.1f} KiB/token  {nbytes / 2**20:9.1f} MiB  {shape} {dt}")
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        print(f"  CUDA peak above the model: {peak / 2**30:.2f} GiB = {peak / tokens / 1024:.1f} KiB per token")


if __name__ == "__main__":
    main()
