"""Names that say one thing each: library stand-ins (``stand_ins``: what imitates a
library's API), the float64 oracles of the tree kernels (C++ ``*_token_oracle``, registered as ops for
tests only), the backend ``"stand_ins"`` (``"reference"`` its deprecated name, tested in
test_backend_stand_ins.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted(ROOT.glob("plugins/*/family.yaml")) + sorted(ROOT.glob("sdk/examples/*/family.yaml"))


def test_families_name_their_stand_ins_and_no_reference():
    assert MANIFESTS
    for path in MANIFESTS:
        manifest = yaml.safe_load(path.read_text())
        python = manifest.get("python") or {}
        assert "reference" not in python, f"{path}: python: reference (the role is stand_ins)"
        for seam, spec in (manifest.get("seams") or {}).items():
            library = spec.get("library") or {}
            assert "reference" not in library, f"{path}: seam {seam}: library: reference (the key is stand_in)"
            if library:
                assert library.get("stand_in"), f"{path}: seam {seam}: library: without stand_in"
        assert not (path.parent / "python" / "reference.py").exists(), path.parent


def test_oracle_ops_are_registered_for_tests_only():
    """Without TREE_RECURRENCE_TEST_OPS=1 (conftest.py sets it) the installed families register their
    seams' ops, not the float64 token oracles nor the fused kernels' stage ops."""
    code = ("import torch, tree_recurrence.plugins as p\n"
            "fams = p.families()\n"
            "names = {'gated_delta_net': ['gdn_tree_scan', 'gdn_token_scan', 'gdn_fused_stages', 'gdn_fused_backward_stages'],\n"
            "         'mamba2': ['ssd_tree_scan', 'ssd_token_scan', 'ssd_fused_stages', 'ssd_fused_backward_stages']}\n"
            "for fam, ops in names.items():\n"
            "    ns = getattr(torch.ops, 'tree_recurrence_' + fam)\n"
            "    print(fam, fam in fams, *[hasattr(ns, op) for op in ops])\n")
    env = {k: v for k, v in os.environ.items() if k != "TREE_RECURRENCE_TEST_OPS"}
    run = lambda env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,  # noqa: E731
                                     timeout=300)
    without = run(env)
    assert without.returncode == 0, without.stderr
    assert without.stdout.split("\n")[:2] == ["gated_delta_net True True False False False",
                                              "mamba2 True True False False False"], without.stdout
    with_ops = run({**env, "TREE_RECURRENCE_TEST_OPS": "1"})
    assert with_ops.returncode == 0, with_ops.stderr
    assert with_ops.stdout.split("\n")[:2] == ["gated_delta_net True True True True True",
                                               "mamba2 True True True True True"], with_ops.stdout
