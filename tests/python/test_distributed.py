"""Two ranks of FSDP2 (torch.distributed, gloo on the CPU) training tiny Qwen3.5 and Nemotron-H
models, each rank on its own tree-packed row: benchmarks/fsdp2_tree.py run under torchrun in a
subprocess. The script checks, and this test asserts from its JSON, that loss and every gathered
gradient after the step equal one process running both ranks' samples alone (tree rows and chain
rows), that its packer gives TRL's exact TreeRow fields, that uninstall restores the modeling
modules on every rank, and that the same comparison fails once uninstalled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fsdp2_tree.py"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_fsdp2_two_ranks_tree_rows_equal_samples_alone(tmp_path):
    out = tmp_path / "fsdp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--size", "tiny", "--device", "cpu", "--check-trl", "--warmup", "0", "--repeat", "1", "--timeout", "120",
           "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:  # a hung rank
        pytest.fail(f"two-rank FSDP2 run did not finish in {e.timeout} s:\n{(e.stderr or b'')[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["errors"] == []
    assert (doc["world_size"], doc["backend"], doc["dtype"]) == (2, "gloo", "float32")
    assert [m["model_type"] for m in doc["models"]] == ["qwen3_5_text", "nemotron_h"]
    for m in doc["models"]:
        what = m["model_type"]
        assert m["packing_checked_against_trl"], what
        assert m["install"]["mode"] == "tree" and m["install"]["layers"], what
        assert m["gradient_checkpointing"], what
        # each rank its own row, shared prefixes folded: fewer tokens than the same samples as chains
        tree, chains = m["row_tokens_per_rank"]["tree"], m["row_tokens_per_rank"]["chains"]
        assert tree[0] != tree[1] and all(t < c for t, c in zip(tree, chains)), what
        for kind in ("tree", "chains"):
            check = m["checks"][kind]
            assert check["loss_rel_err"] <= 1e-5, (what, kind, check)
            assert check["worst_grad_err_over_tol"][0] <= 1.0, (what, kind, check)
        # the uninstalled model on the same tree row is far off: the comparison can fail
        assert m["control_uninstalled_loss_rel_err"] > 1e-4, what
        assert all(t > 0 for t in m["step_ms_per_rank"]["tree"] + m["step_ms_per_rank"]["chains"]), what
