"""doctor, plugin discovery from Python (broken plugins on TREE_RECURRENCE_PLUGIN_PATH, a torch
mismatch), and the policy's sources and precedence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import tree_recurrence
from tree_recurrence import Policy


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def doctor(env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-m", "tree_recurrence", "doctor", "--json"], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_doctor_lists_the_three_families_with_fingerprints_and_models():
    report = doctor()
    families = {p["family"]: p for p in report["plugins"]}
    assert {"gated_delta_net", "mamba2", "short_conv"} <= set(families)
    for plugin in families.values():
        assert plugin["fingerprint"] == report["core_fingerprint"]
        assert any(k["name"] == "tree_conv" and k["device"] == "cpu" and k["available"] for k in plugin["kernels"])
    types = {m["model_type"] for p in families.values() for m in p["models"] if m["installed"]}
    assert {"qwen3_5_text", "qwen3_next", "mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2",
            "lfm2", "lfm2_moe"} <= types
    assert report["refused"] == []


def test_doctor_text_output():
    done = subprocess.run([sys.executable, "-m", "tree_recurrence", "doctor"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0
    assert "plugins loaded: " in done.stdout and "gated_delta_net" in done.stdout and "plugins refused: 0" in done.stdout


def test_broken_plugins_on_the_plugin_path_are_refused_and_reported(tmp_path):
    (tmp_path / "bad_yaml.yaml").write_text("schema: 1\nfamily: [unclosed\n")
    for file, family, library in (("no_library", "ghost", "libghost.so"), ("not_a_library", "fake", "fake.so")):
        mixer = family.capitalize() + "Mixer"
        (tmp_path / f"{file}.yaml").write_text(textwrap.dedent(f"""\
            schema: 1
            family: {family}
            version: 1.0.0
            library: {library}
            models: [{{model_type: {family}, module: {family}.modeling, mixers: [{mixer}], layer_types: [{family}]}}]
            seams: {{causal_conv1d_fn: {{adapter: conv}}}}
            """))
    (tmp_path / "fake.so").write_bytes(b"this is not an ELF file")
    report = doctor({"TREE_RECURRENCE_PLUGIN_PATH": str(tmp_path)})
    assert {p["family"] for p in report["plugins"]} >= {"gated_delta_net", "mamba2", "short_conv"}
    reasons = {r["family"]: r["reason"] for r in report["refused"]}
    assert "invalid YAML" in reasons["bad_yaml"]
    assert "libghost.so named by the manifest does not exist" in reasons["ghost"]
    assert "cannot be loaded" in reasons["fake"]


def test_plugins_are_refused_under_another_torch():
    done = run_python("""
        import torch
        torch.__version__ = "2.99.0"
        from tree_recurrence import plugins
        records = plugins.discover()
        assert not plugins.families(), records
        print(records[0]["error"])
        """)
    assert done.returncode == 0, done.stderr
    assert "is for torch 2.11.0, but torch 2.99.0 is running" in done.stdout


def test_policy_precedence(tmp_path, monkeypatch):
    env_file = tmp_path / "env.yaml"
    env_file.write_text("fork_min_saved_tokens: 11\nstrategy: fork\nprefer_native: false\n")
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text("fork_min_saved_tokens: 22\n")
    for var in ("TREE_RECURRENCE_POLICY_FILE", "TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", "TREE_RECURRENCE_STRATEGY",
                "TREE_RECURRENCE_PREFER_NATIVE"):
        monkeypatch.delenv(var, raising=False)
    assert (Policy().fork_min_saved_tokens, Policy().strategy, Policy().prefer_native) == (1024, "auto", True)
    monkeypatch.setenv("TREE_RECURRENCE_POLICY_FILE", str(env_file))
    assert (Policy().fork_min_saved_tokens, Policy().strategy, Policy().prefer_native) == (11, "fork", False)
    assert Policy.from_yaml(explicit).fork_min_saved_tokens == 22  # explicit file over the environment's file
    assert Policy.from_yaml(explicit).strategy == "fork"  # keys it lacks still come from the environment's file
    monkeypatch.setenv("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", "33")
    assert Policy.from_yaml(explicit).fork_min_saved_tokens == 33  # variables over files
    assert Policy(fork_min_saved_tokens=44).fork_min_saved_tokens == 44  # keyword arguments over everything
    assert Policy.from_yaml(explicit, strategy="rescan").strategy == "rescan"


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "sideways"}, "unknown value 'sideways'"),
    ({"fork_min_saved_tokens": -1}, "non-negative int"),
    ({"fork_min_saved_tokens": True}, "non-negative int"),
])
def test_policy_errors_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


def test_policy_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fork_min_saved_tokens: 3\ncolour: blue\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown policy key 'colour'"):
        Policy.from_yaml(bad)
    with pytest.raises(ValueError, match="cannot read the policy file"):
        Policy.from_yaml(tmp_path / "missing.yaml")


def test_policy_choice_follows_the_saved_tokens():
    import torch

    # a 100-token prompt and three 10-token completions: 200 tokens saved over 2 levels
    kw = {"tree_cu_seqlens_q": torch.tensor([0, 100, 110, 120, 130]), "tree_segment_parents": torch.tensor([-1, 0, 0, 0])}
    plan = tree_recurrence.tree_plan(kw)
    assert plan.saved_tokens == 200
    assert Policy(fork_min_saved_tokens=200, prefer_native=False).choose(plan, True, True)[0] == "fork"
    assert Policy(fork_min_saved_tokens=201, prefer_native=False).choose(plan, True, True)[0] == "native"
    assert Policy(fork_min_saved_tokens=201).choose(plan, False, True)[0] == "rescan"
    assert Policy().choose(plan, True, True)[0] == "native"
    with pytest.raises(ValueError, match="fork was forced"):
        Policy(strategy="fork").choose(plan, True, False)
