"""``python -m tree_recurrence bench``: whole-model training steps on tree-packed rows.

For each model of a table (``--models FILE``, JSON: name -> transformers ``model_type``, a config
at realistic width and a tiny one; by default the package's own, ``tree_recurrence/bench_models.json``,
installed with it, so the command runs from any folder), random
init, hooked with :func:`tree_recurrence.install`, it times forward + backward of one GRPO-shaped
batch (``groups`` prompts x ``rollouts`` completions of ``completion`` tokens, the prompt length
swept) in three layouts of the same samples:

* ``tree``: one tree-packed row (each prompt once, its completions as child segments);
* ``chains``: the samples packed padding-free as a forest of chains (one root per sample, every
  sample's prompt repeated), through the same hooks and the same attention;
* ``flat``: the tree's unique tokens, one chain per prompt group (prompt then its completions
  laid end to end): what the unique tokens cost with no branching at all.

The loss is the same function of every sample in each layout (sum over each sample's completion
tokens of the log-sum-exp of their logits, as a GRPO trainer scores completions only and computes
their logits alone, through the models' ``logits_to_keep``; ``--loss all``: over every token of
every sample, a shared prompt token counted once per sample through it), so ``tree`` and
``chains`` give equal losses; ``flat`` computes other outputs (no tree) at the tree's cost
floor. Reports tokens/s (sample tokens: the tokens the samples hold), speed-up against chains,
the ratio to flat, peak memory, and which kernel ran for each recurrent family (the driver's
decisions). Writes ``bench.json`` and ``bench.png`` (speed-up against the token ratio, with the
ideal line speed-up = token ratio; matplotlib draws it, and without matplotlib bench says so in one
line and writes the rest: :func:`check_dependencies`).

The engine names no family: everything model-specific comes from the table.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.resources
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import driver
from ._bench_output import plot, plot_unavailable, print_table
from .attention import register_tree_attention
from .install import install, uninstall

TABLE_NAME = "bench_models.json"  # inside the package (installed with it: wheel.packages takes every file)
MODES = ("tree", "chains", "flat")
LOSSES = ("completions", "all")


# ------------------------------------------------------------------------------------------------
# rows
# ------------------------------------------------------------------------------------------------


def _row(segments: list[tuple[torch.Tensor, int, int]], device) -> dict:
    """segments: (token ids, parent segment or -1, first position), in DFS pre-order."""
    ids = torch.cat([s[0] for s in segments])
    lengths = torch.tensor([len(s[0]) for s in segments])
    offsets = torch.zeros(len(segments) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    parents = torch.tensor([s[1] for s in segments], dtype=torch.int64)
    positions = torch.cat([torch.arange(s[2], s[2] + len(s[0])) for s in segments])
    return {"input_ids": ids[None].to(device), "position_ids": positions[None].to(device),
            "tree_cu_seqlens_q": offsets.to(device), "tree_segment_parents": parents.to(device)}


def grpo_rows(groups: int, rollouts: int, prompt: int, completion: int, vocab: int, seed: int, device,
              loss: str = "completions") -> dict:
    """The three layouts of one GRPO batch: {mode: (row dict, per-token loss weights, sample tokens)}.

    loss "all": every token's weight is the number of samples through it. loss "completions": only
    completion tokens count (weight 1), and the row carries ``logits_to_keep`` (their indices), so
    the model computes no logits for prompt tokens (at GRPO with a 150k-word vocabulary the chains'
    prompt logits alone take ~100 GB). The kept positions are the completion tokens themselves (a
    trainer keeps the positions one before, which predict them: the same count, the same cost)."""
    if loss not in LOSSES:
        raise ValueError(f"bench: loss must be one of {LOSSES}, got {loss!r}")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt,), generator=g) for _ in range(groups)]
    completions = [[torch.randint(0, vocab, (completion,), generator=g) for _ in range(rollouts)] for _ in range(groups)]
    tree, chains, flat = [], [], []
    counts_tree = []
    for p, cs in zip(prompts, completions):
        root = -1
        if prompt:
            root = len(tree)
            tree.append((p, -1, 0))
            counts_tree.append(torch.full((prompt,), rollouts if loss == "all" else 0))
        for c in cs:
            tree.append((c, root, prompt))
            counts_tree.append(torch.ones(completion, dtype=torch.int64))
            chains.append((torch.cat([p, c]), -1, 0))
        flat.append((torch.cat([p, *cs]), -1, 0))
    counts = torch.cat(counts_tree)
    sample_tokens = groups * rollouts * (prompt + completion)
    chain_counts = torch.ones(sample_tokens, dtype=torch.int64)
    if loss == "completions":  # prompt tokens weigh 0 and get no logits
        chain_counts = torch.cat([torch.cat([torch.zeros(prompt, dtype=torch.int64), torch.ones(completion, dtype=torch.int64)])
                                  for _ in range(groups * rollouts)])
    layouts = {"tree": (tree, counts), "chains": (chains, chain_counts), "flat": (flat, counts)}
    out = {}
    for mode, (segments, weights) in layouts.items():
        row = _row(segments, device)
        if loss == "completions":
            keep = weights.nonzero().squeeze(1)
            row["logits_to_keep"] = keep.to(device)
            weights = weights[keep]
        out[mode] = (row, weights.to(device), sample_tokens)
    return out


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def _fresh(row: dict) -> dict:
    """The row with new tree tensors: each step builds its plan (and attention mask) as training does."""
    return {k: (v.clone() if k.startswith("tree_") else v) for k, v in row.items()}


def train_step(model, row: dict, counts: torch.Tensor, sample_tokens: int) -> float:
    model.zero_grad(set_to_none=True)
    logits = model(**_fresh(row), use_cache=False).logits[0]
    loss = (torch.logsumexp(logits.float(), dim=-1) * counts).sum() / sample_tokens
    loss.backward()
    return float(loss.detach())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, row, counts, sample_tokens, device, warmup: int, repeat: int, slow_s: float = 30.0) -> dict:
    """Median of ``repeat`` timed steps after ``warmup`` untimed ones; a step slower than
    ``slow_s`` seconds ends the warm-up and is taken as the measurement (first call included)."""
    losses, times = [], []
    for _ in range(warmup):
        _sync(device)
        start = time.perf_counter()
        losses.append(train_step(model, row, counts, sample_tokens))
        _sync(device)
        if time.perf_counter() - start > slow_s:
            times.append(time.perf_counter() - start)
            break
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeat if not times else 0):
        _sync(device)
        start = time.perf_counter()
        losses.append(train_step(model, row, counts, sample_tokens))
        _sync(device)
        times.append(time.perf_counter() - start)
    ms = 1000 * statistics.median(times)
    return {"ms": ms, "tokens_per_s": sample_tokens / (ms / 1000), "loss": losses[-1], "steps_timed": len(times),
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def default_table() -> Path:
    """The package's own model table, found where the package is installed (any working folder)."""
    return Path(str(importlib.resources.files("tree_recurrence") / TABLE_NAME))


def load_table(path: str | os.PathLike | None = None) -> dict:
    """The table at ``path`` (``--models``), by default :func:`default_table`; entries named ``_...`` are notes."""
    if path is None and not default_table().is_file():
        raise SystemExit(f"bench: the package's model table {default_table()} is missing: this copy of tree-recurrence "
                         "was installed without it; reinstall it (pip install --no-build-isolation .) or pass --models FILE")
    path = default_table() if path is None else Path(path)
    if not path.is_file():
        raise SystemExit(f"bench: --models {path}: no such file (without --models bench uses its own table, {default_table()})")
    table = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    for name, entry in table.items():
        for field in ("model_type", "config", "tiny"):
            if field not in entry:
                raise SystemExit(f"bench: --models {path}: entry {name!r} has no {field!r}")
    return table


def build_model(entry: dict, tiny: bool, dtype, device, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(entry["model_type"], **entry["tiny" if tiny else "config"])
    for attr in ("attention_dropout", "hidden_dropout", "dropout"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a 300M-parameter init on the host takes seconds)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_tree_attention(attn))
    return model.to(device=device, dtype=dtype).train()


def kernels_ran(decisions, reasons: dict | None = None) -> dict:
    """family -> {seam: [strategies]} from the driver's decision log; with ``reasons``, also
    fills it with "family/seam" -> [the driver's reasons] (which kernel, and why)."""
    out: dict[str, dict[str, list[str]]] = {}
    for family, seam, strategy, reason in decisions:
        strategies = out.setdefault(family, {}).setdefault(seam, [])
        if strategy not in strategies:
            strategies.append(strategy)
        if reasons is not None:
            why = reasons.setdefault(f"{family}/{seam}", [])
            if reason not in why:
                why.append(reason)
    return out


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------


def check_dependencies(want_plot: bool) -> bool:
    """Imports what the run needs before its first point, so a missing package stops it at once (never
    after minutes of measuring, with the table unprinted). transformers and tqdm are required (the
    ``transformers`` extra brings both); matplotlib is optional by choice (:func:`plot_unavailable`):
    without it the run prints one line saying how to get it and writes the table and bench.json all
    the same. Returns whether to draw bench.png."""
    for name in ("transformers", "tqdm"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise SystemExit(f"bench: {name} does not import ({error}): pip install \"tree-recurrence[bench]\"") from None
    why = plot_unavailable() if want_plot else None
    if why:
        print(f"bench: no bench.png ({why}); the table and bench.json are written all the same", file=sys.stderr)
    return want_plot and not why


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None, help=f"model table, JSON (default: the package's own, tree_recurrence/{TABLE_NAME})")
    parser.add_argument("--model", action="append", help="a name of the table (repeatable; default all)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny configs and shape (the default on CPU): seconds, for CI")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on GPU, fp32 on CPU")
    parser.add_argument("--attn", default="tree_flex", choices=["tree_flex", "tree_sdpa"], help="tree attention")
    parser.add_argument("--groups", type=int, default=None, help="prompts per batch (default 8; tiny 2)")
    parser.add_argument("--rollouts", type=int, default=None, help="completions per prompt (default 8; tiny 3)")
    parser.add_argument("--completion", type=int, default=None, help="completion length (default 512; tiny 6)")
    parser.add_argument("--prompts", default=None, help="prompt lengths swept, comma-separated (default 0,512,2048,4096; tiny 0,4,16)")
    parser.add_argument("--checkpointing", default="off,on", help="gradient checkpointing settings: off,on / off / on")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per point (default 2; tiny 1)")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps per point, median taken (default 3; tiny 1)")
    parser.add_argument("--loss", default="completions", choices=list(LOSSES),
                        help="tokens the loss scores: completions (default, as GRPO: no prompt logits) or all")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def run(args: argparse.Namespace) -> int:
    draw = check_dependencies(not args.no_plot)
    from tqdm import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = args.tiny or device.type == "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    pick = lambda value, full, small: value if value is not None else (small if tiny else full)  # noqa: E731
    groups, rollouts = pick(args.groups, 8, 2), pick(args.rollouts, 8, 3)
    completion = pick(args.completion, 512, 6)
    prompts = [int(p) for p in pick(args.prompts, "0,512,2048,4096", "0,4,16").split(",")]
    warmup, repeat = pick(args.warmup, 2, 1), pick(args.repeat, 3, 1)
    settings = {"off": False, "on": True}
    try:
        checkpointing = [settings[s.strip()] for s in args.checkpointing.split(",")]
    except KeyError as error:
        raise SystemExit(f"bench: --checkpointing: expected off and/or on, got {error.args[0]!r}")
    table = load_table(args.models)
    names = args.model or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"bench: --model {unknown[0]!r}: not in {args.models or default_table()} (has {', '.join(table)})")

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "tiny": tiny, "attention": args.attn,
        "shape": {"groups": groups, "rollouts": rollouts, "completion": completion, "prompts": prompts},
        "loss": args.loss,
        "warmup": warmup, "repeat": repeat, "models": {}, "results": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():  # after every point: a run cut short still leaves what it measured
        (out / "bench.json").write_text(json.dumps(report, indent=2))

    total = len(names) * len(prompts) * len(checkpointing) * len(MODES)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    # prompt lengths outer, models inner: a run cut short has every model at the first prompt length
    for prompt in prompts:
        for name in names:
            entry = table[name]
            model = build_model(entry, tiny, dtype, device, args.attn)
            support = install(model)
            info = report["models"].setdefault(name, {
                "model_type": entry["model_type"], "kind": entry.get("kind", ""), "support": support.mode,
                "reason": support.reason, "families": dict(support.families),
                "parameters": sum(p.numel() for p in model.parameters()), "kernels": {}, "kernel_reasons": {}})
            try:
                loss = args.loss
                if loss == "completions" and "logits_to_keep" not in inspect.signature(model.forward).parameters:
                    loss = "all"  # a model without logits_to_keep computes every token's logits anyway
                info["loss"] = loss
                rows = grpo_rows(groups, rollouts, prompt, completion, model.config.get_text_config().vocab_size, prompt, device,
                                 loss)
                unique = rows["tree"][0]["input_ids"].shape[1]
                for ckpt in checkpointing:
                    if ckpt:
                        model.gradient_checkpointing_enable()
                    else:
                        model.gradient_checkpointing_disable()
                    point = {"model": name, "prompt": prompt, "checkpointing": ckpt, "unique_tokens": unique,
                             "sample_tokens": rows["tree"][2], "token_ratio": rows["tree"][2] / unique}
                    for mode in MODES:
                        bar.set_postfix_str(f"{name} prompt {prompt} ckpt {'on' if ckpt else 'off'} {mode}")
                        row, counts, sample_tokens = rows[mode]
                        driver.decisions.clear()
                        try:
                            point[mode] = time_steps(model, row, counts, sample_tokens, device, warmup, repeat)
                        except torch.cuda.OutOfMemoryError as error:
                            point[mode] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
                        except Exception as error:  # noqa: BLE001 -- one failing layout must not lose the others
                            if device.type == "cpu":
                                raise
                            point[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
                        if mode == "tree":
                            info["kernels"] = kernels_ran(driver.decisions, info["kernel_reasons"]) or info["kernels"]
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        bar.update()
                    t, c, f = (point[m].get("ms") for m in MODES)
                    point["speedup_vs_chains"] = c / t if t and c else None
                    point["tree_over_flat"] = t / f if t and f else None
                    report["results"].append(point)
                    save()
            finally:
                uninstall(model)
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if draw:
            plot(report, out / "bench.png")
    bar.close()
    save()
    print_table(report)
    if draw:
        plot(report, out / "bench.png")
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if draw else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tree_recurrence bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
