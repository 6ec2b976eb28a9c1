"""``python -m tree_recurrence bench --tiny`` on CPU: the command runs every model of the
repository's table, writes a complete JSON and a PNG, and the tree row gives the same loss as the
same samples packed as chains (the benchmark measures equal work)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "bindings" / "python" / "tree_recurrence" / "bench_models.json"


def test_bench_tiny_writes_json_and_plot_and_tree_loss_equals_chains(tmp_path):
    cmd = [sys.executable, "-m", "tree_recurrence", "bench", "--tiny", "--device", "cpu", "--models", str(TABLE),
           "--prompts", "0,6", "--checkpointing", "on", "--warmup", "0", "--repeat", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bench: 100%" in proc.stderr  # the progress bar ran to the end
    report = json.loads((tmp_path / "bench.json").read_text())
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000

    table = {k for k in json.loads(TABLE.read_text()) if not k.startswith("_")}
    assert set(report["models"]) == table
    for name, info in report["models"].items():
        assert info["support"] == "tree", (name, info["reason"])
        assert info["kernels"], f"{name}: no kernel decision recorded"
        assert all(strategies for seams in info["kernels"].values() for strategies in seams.values())
    assert report["tiny"] and report["dtype"] == "float32"
    assert len(report["results"]) == len(table) * 2
    for r in report["results"]:
        what = f"{r['model']} prompt {r['prompt']}"
        shape = report["shape"]
        n_samples = shape["groups"] * shape["rollouts"]
        assert r["sample_tokens"] == n_samples * (r["prompt"] + shape["completion"]), what
        assert r["unique_tokens"] == shape["groups"] * r["prompt"] + n_samples * shape["completion"], what
        assert math.isclose(r["token_ratio"], r["sample_tokens"] / r["unique_tokens"]), what
        for mode in ("tree", "chains", "flat"):
            assert r[mode]["ms"] > 0 and r[mode]["tokens_per_s"] > 0 and math.isfinite(r[mode]["loss"]), (what, mode)
        assert math.isclose(r["speedup_vs_chains"], r["chains"]["ms"] / r["tree"]["ms"]), what
        assert math.isclose(r["tree_over_flat"], r["tree"]["ms"] / r["flat"]["ms"]), what
        # same samples, same loss: tree row vs chains (fp32)
        assert math.isclose(r["tree"]["loss"], r["chains"]["loss"], rel_tol=1e-5), (what, r["tree"]["loss"], r["chains"]["loss"])
        if r["prompt"] == 0:
            assert r["token_ratio"] == 1.0
        else:  # a shared prompt: the flat row computes other outputs (no tree), so its loss differs
            assert r["token_ratio"] > 1.0
            assert not math.isclose(r["tree"]["loss"], r["flat"]["loss"], rel_tol=1e-5), what


def test_bench_refuses_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tree_recurrence", "bench", "--tiny", "--models", str(TABLE),
                           "--model", "no_such", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--model 'no_such': not in" in proc.stderr


def test_grpo_rows_score_completions_only_by_default_and_every_sample_token_with_loss_all():
    import torch

    from tree_recurrence.bench import grpo_rows

    groups, rollouts, prompt, completion = 2, 3, 5, 4
    for loss in ("completions", "all"):
        rows = grpo_rows(groups, rollouts, prompt, completion, 50, 0, torch.device("cpu"), loss)
        for mode, (row, weights, sample_tokens) in rows.items():
            assert sample_tokens == groups * rollouts * (prompt + completion)
            if loss == "all":
                # every token weighs the samples through it: the weights sum to the sample tokens
                assert "logits_to_keep" not in row and int(weights.sum()) == sample_tokens, mode
                continue
            keep = row["logits_to_keep"]
            # one logit row per completion token, each weighing 1, and those positions are the completions' tokens
            assert keep.numel() == weights.numel() == groups * rollouts * completion, mode
            assert bool((weights == 1).all()), mode
            assert torch.equal(keep, torch.sort(keep).values) and int(keep[-1]) < row["input_ids"].shape[1], mode
    # rollouts 1: a prompt token is in one sample, still not scored under "completions"
    row, weights, _ = grpo_rows(1, 1, 3, 2, 50, 0, torch.device("cpu"))["tree"]
    assert row["logits_to_keep"].tolist() == [3, 4] and weights.tolist() == [1, 1]
