"""``python -m tree_recurrence tune`` on the CPU, end to end: it times every route of the GDN seam over
the family's stand-in on a tiny trie, writes a record into the user's cache folder, and the router
and ``doctor`` then use it. No test here asserts which route is faster: the CPU's timings are whatever
they are, the tests check that the fastest recorded route is the one taken."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import tree_recurrence as tr
from tree_recurrence import _routes, components, driver, plugins, stand_ins, tune

GDN = "gated_delta_net"
SEAM = "torch_chunk_gated_delta_rule"
TUNE = ["--tiny", "--families", GDN, "--shapes", "tree", "--phase", "fwd_bwd", "--repeats", "1", "--warmup", "0",
        "--peer", "stand_in"]


def command(*args: str, cache) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tree_recurrence", *args], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The cache folder after one ``tune --tiny`` of the GDN trie, forward + backward, and its output."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, command("tune", *TUNE, cache=cache).stdout


def test_tune_prints_progress_and_writes_a_record(tuned):
    cache, out = tuned
    path = cache / "tree_recurrence" / "routes.json"
    for route in ("native", "fork", "rescan"):
        assert f"{GDN} {route:<6} tree       224 tokens fwd_bwd float32: " in out, out
    assert f"tune: 1 records written to {path}" in out
    (entry,) = json.loads(path.read_text())["records"]
    torch_version, ours = _routes.versions()
    assert {k: entry[k] for k in _routes.KEY_FIELDS} == {
        "device": "cpu", "torch": torch_version, "tree_recurrence": ours, "family": GDN, "seam": SEAM,
        "shape": "tree", "dtype": "float32", "phase": "fwd_bwd"}
    assert entry["tokens"] == 224 and entry["kernel"] == {"package": stand_ins.stand_in(GDN, SEAM).__module__.split(".")[0],
                                                          "version": "", "backend": ""}
    assert set(entry["ms"]) == {"native", "fork", "rescan"} and entry["failed"] == {}


def test_the_router_takes_the_fastest_recorded_route(tuned, monkeypatch):
    cache, _ = tuned
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    (entry,) = _routes.records()
    fastest = min(entry["ms"], key=lambda r: (entry["ms"][r], list(_routes.VERIFIERS).index(r)))
    lengths, parents = tune.layouts(2, 3, 64, 16)["tree"]
    plan = tune._plan(lengths, parents, torch.device("cpu"))
    positional, keywords = tune.Inputs.of(plugins.families()[GDN]).make(plan.num_tokens, True, torch.float32,
                                                                        torch.device("cpu"), torch.Generator().manual_seed(1))
    for t in positional:
        t.requires_grad_()
    driver.decisions.clear()
    out = components.tree_scan(stand_ins.stand_in(GDN, SEAM), *positional, plan=plan, family=GDN, seam=SEAM,
                               policy=tr.Policy(), **keywords)[0]
    out.sum().backward()
    (decision,) = [d for d in driver.decisions if d[0] == GDN]
    assert decision[2] == fastest, decision
    assert decision[3].startswith("measured by tune on cpu (tree, 224 tokens, fwd_bwd, float32, ")
    assert decision[3].endswith(f"[{cache / 'tree_recurrence' / 'routes.json'}]")


def test_without_a_record_for_the_models_kernel_doctor_says_default_order(tuned, monkeypatch):
    """The record above is over the stand-in; doctor's typical call binds what the model's seam calls
    (transformers' PyTorch fallback here): no record for it, the default order."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tuned[0]))
    (row,) = tune.route_report(plugins.families()[GDN])
    assert row["route"] == "native" and row["reason"].startswith("default order (no tune record for cpu, transformers")


def test_tune_of_the_models_kernel_keeps_other_records_and_doctor_shows_it(tuned, tmp_path):
    """tune over what the model's seam calls (``--peer model``) into a cache holding another GPU's record:
    both are kept, and doctor shows the recorded route, the numbers and the record's path."""
    cache = tmp_path / "cache"
    path = cache / "tree_recurrence" / "routes.json"
    path.parent.mkdir(parents=True)
    other = {**json.loads((tuned[0] / "tree_recurrence" / "routes.json").read_text())["records"][0], "device": "Other GPU"}
    path.write_text(json.dumps({"schema": 1, "records": [other]}))
    command("tune", *TUNE[:-2], "--peer", "model", cache=cache)
    assert sorted(r["device"] for r in json.loads(path.read_text())["records"]) == ["Other GPU", "cpu"]
    text = command("doctor", cache=cache).stdout
    line = next(line for line in text.splitlines() if "tree       224 tokens fwd_bwd float32 ->" in line)
    assert "measured by tune on cpu (tree, 224 tokens, fwd_bwd, float32, transformers" in line
    assert line.endswith(f"[{path}]") and " ms < " in line


def test_doctor_says_a_corrupt_record_is_ignored(tmp_path):
    path = tmp_path / "tree_recurrence" / "routes.json"
    path.parent.mkdir(parents=True)
    path.write_text("[1, 2")
    text = command("doctor", cache=tmp_path).stdout
    assert f"route records: {path}: not a tune record (JSONDecodeError" in text and "ignored" in text
    assert "typical call -> native: default order (no tune record for cpu" in text


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("seam"), "tune.seam: None is not a seam of the manifest"),
    (lambda t: t["tensors"].pop("beta"), "tune.tensors: the seam's arguments ['beta'] are missing"),
    (lambda t: t["tensors"]["g"].update(shape=[1, "n", "Q"]), "tune.tensors.g: expected {shape: [...]}"),
    (lambda t: t["tensors"]["g"].update(fill="zeros"), "tune.tensors.g.fill: expected one of"),
])
def test_a_bad_tune_section_is_named(change, message):
    family = plugins.families()[GDN]
    section = json.loads(json.dumps(family.manifest["tune"]))
    change(section)
    with pytest.raises(tune.TuneError, match=message.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{")):
        tune.Inputs.of(dataclasses.replace(family, manifest={**family.manifest, "tune": section}))
    assert isinstance(tune.tunable()[GDN], tune.Inputs) and "short_conv" not in tune.tunable()
