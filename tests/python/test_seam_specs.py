"""Seam specs parsed once at load: every loaded manifest's seams parse into frozen
SeamSpec / NativeSpec dataclasses; a bad key refuses the plugin with a reason naming the manifest file,
the seam and the key; register_family checks its seams the same way."""

from __future__ import annotations

import dataclasses

import pytest

from plugin_records import discover_only

import tree_recurrence as tr
from tree_recurrence import plugins
from tree_recurrence._specs import Family, NativeSpec, SeamSpec, SpecError, parse_seam

GDN_SCAN = {"adapter": "scan", "args": ["q", "k", "v", "g", "beta"], "sequence": ["q", "k", "v", "g", "beta"],
            "returns": 2, "native": {"op": "gdn_tree_scan", "chunk": 64, "kwargs": {"scale": ["scale", 0.0]}},
            "state_args": {"initial_state": "initial_state", "output_final_state": "output_final_state"},
            "neutral": {"k": 0.0, "g": 0.0, "beta": 0.0}, "varlen": {"cu_seqlens": "cu_seqlens"}}


def test_every_loaded_manifest_parses_once():
    for name, record in plugins.families().items():
        if record.python:
            continue
        assert isinstance(record, Family) and record.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.seams = {}  # type: ignore[misc]
        specs = record.seams
        assert set(specs) == set(record.manifest["seams"]), name
        for seam, spec in specs.items():
            assert isinstance(spec, SeamSpec) and spec.name == seam and spec.adapter == record.manifest["seams"][seam]["adapter"]
            with pytest.raises(dataclasses.FrozenInstanceError):
                spec.adapter = "other"  # type: ignore[misc]


def test_a_scan_spec_parses_into_its_parts():
    spec = parse_seam("m.yaml", "rule", GDN_SCAN)
    assert spec.args == ("q", "k", "v", "g", "beta") and spec.returns == 2
    assert spec.native == NativeSpec("gdn_tree_scan", 64, {"scale": ("scale", 0.0)})
    assert spec.state_args == {"initial_state": "initial_state", "output_final_state": "output_final_state"}
    assert spec.varlen == {"cu_seqlens": "cu_seqlens"} and spec.neutral == {"k": 0.0, "g": 0.0, "beta": 0.0}


@pytest.mark.parametrize("change, key, problem", [
    ({"nativ": {}}, "nativ", "not a key of adapter 'scan'"),
    ({"args": "q"}, "args", "expected a list of names"),
    ({"sequence": ["q", "z"]}, "sequence", "must be some of the args"),
    ({"returns": 0}, "returns", "expected a positive int"),
    ({"native": {"op": "x", "chunk": 0}}, "native", "'chunk' must be a positive int"),
    ({"native": {"op": "x", "kwargs": {"a": "b"}}}, "native", "kwargs 'a' must be \\[source, default\\]"),
    ({"state_args": {"initial_state": "h0"}}, "state_args", "expected the keys"),
    ({"neutral": {"z": 0}}, "neutral", r"names \['z'\], which are not sequence args"),
    ({"neutral": {"g": "zero"}}, "neutral", "entry 'g' has 'zero'"),
    ({"varlen": {"cu_seqlens": 1}}, "varlen", "entry 'cu_seqlens' has 1"),
    ({"library": {"package": "fla", "kernel": 3}}, "library", "expected \\{package, kernel, stand_in\\}"),
])
def test_a_bad_key_names_file_seam_and_key(change, key, problem):
    with pytest.raises(SpecError, match=rf"^m\.yaml: seam 'rule': key '{key}': {problem}"):
        parse_seam("m.yaml", "rule", {**GDN_SCAN, **change})


def test_other_adapters():
    with pytest.raises(SpecError, match=r"seam 'conv': key 'args': a conv seam names x, weight, bias and activation"):
        parse_seam("m.yaml", "conv", {"adapter": "conv", "args": ["x", "w"]})
    with pytest.raises(SpecError, match=r"seam 'conv': key 'args': missing"):
        parse_seam("m.yaml", "conv", {"adapter": "conv"})
    with pytest.raises(SpecError, match=r"seam 'fused': key 'function': missing"):
        parse_seam("m.yaml", "fused", {"adapter": "family", "args": ["x"]})
    family = parse_seam("m.yaml", "fused", {"adapter": "family", "args": ["x"], "function": "run", "chunk": 64})
    assert family.function == "run" and family.extra == {"chunk": 64}  # the family function's own keys
    assert parse_seam("m.yaml", "off", {"adapter": "decline", "args": ["x"], "declined": 0}).declined == 0
    newer = parse_seam("m.yaml", "s", {"adapter": "teleport", "anything": 1})  # a newer version's: kept as is
    assert newer.adapter == "teleport" and newer.extra["anything"] == 1
    with pytest.raises(SpecError, match=r"seam 's': key 'adapter': missing"):
        parse_seam("m.yaml", "s", {"args": ["x"]})


def test_a_loaded_plugin_with_a_bad_seam_is_refused_naming_file_seam_and_key(monkeypatch, tmp_path):
    manifest = tmp_path / "bad.yaml"
    record = {"family": "badspec", "version": "1.0.0", "manifest_path": str(manifest), "library_path": "",
              "loaded": True, "error": "", "fingerprint": "", "kernels": [],
              "manifest": {"seams": {"chunk_rule": {**GDN_SCAN, "sequense": ["q"]}}}}
    monkeypatch.setattr(plugins._core, "discover_plugins", lambda folders: [])
    monkeypatch.setattr(plugins._core, "plugin_records", lambda: [record])
    monkeypatch.setattr(plugins, "runtime_mismatch", lambda: None)
    monkeypatch.setattr(plugins.REGISTRY, "scan", None)
    monkeypatch.setattr(plugins.REGISTRY, "python_families", {})
    refused = plugins.refused()
    assert [r["family"] for r in refused] == ["badspec"] and "badspec" not in plugins.families()
    assert refused[0]["error"].startswith(f"invalid seam spec: {manifest}: seam 'chunk_rule': key 'sequense': not "
                                          "a key of adapter 'scan'"), refused[0]["error"]


def test_register_family_checks_its_seams_like_a_manifest():
    with pytest.raises(SpecError, match=r"^register_family\('pyspec'\): seam 'rule': key 'returns': expected a positive int"):
        tr.register_family("pyspec", "pyspec_model", ["PySpecMixer"], "linear_attention",
                           seams={"rule": {**GDN_SCAN, "returns": -1}}, modules=["pyspec.modeling"])
    assert "pyspec" not in plugins.REGISTRY.python_families
    record = tr.register_family("pyspec", "pyspec_model", ["PySpecMixer"], "linear_attention",
                                seams={"rule": GDN_SCAN}, modules=["pyspec.modeling"])
    try:
        assert isinstance(record, Family) and record.python and record.seams["rule"] == parse_seam("register_family('pyspec')", "rule", GDN_SCAN)
    finally:
        tr.unregister_family("pyspec")


def test_a_mapping_spec_is_parsed_once_while_unchanged():
    """components.tree_scan / SeamCall.bind given a manifest-style mapping: the same mapping gives the same
    SeamSpec on every call (the driver's route cache is keyed on it), a changed mapping a new one."""
    import copy

    from tree_recurrence._specs import seam_spec_of

    spec = copy.deepcopy(GDN_SCAN)
    first = seam_spec_of("test", "scan", spec)
    assert seam_spec_of("test", "scan", spec) is first
    assert seam_spec_of("test", "scan", first) is first
    assert first == parse_seam("test", "scan", GDN_SCAN)
    spec["native"]["chunk"] = 32  # changed in place: parsed again
    second = seam_spec_of("test", "scan", spec)
    assert second is not first and second.native.chunk == 32
    with pytest.raises(SpecError, match="key 'returns'"):
        seam_spec_of("test", "scan", {**GDN_SCAN, "returns": "two"})


# ------------------------------------------------------------------------------------------------
# families as frozen Family records
# ------------------------------------------------------------------------------------------------

def test_families_are_built_once_at_load():
    first, again = plugins.families(), plugins.families()
    assert first and all(isinstance(f, Family) and again[name] is f for name, f in first.items())
    for name, family in first.items():
        assert family.name == name and family.op_namespace and family.seams is plugins.seam_specs(family)
        assert family.models is family.manifest.get("models", family.models)
        with pytest.raises(dataclasses.FrozenInstanceError):
            family.kernels = ()  # type: ignore[misc]
        assert family["family"] == name and family["manifest"] is family.manifest  # the record's keys, for scripts


def _refused_record(monkeypatch, record: dict) -> dict:
    refused = discover_only(monkeypatch, record)
    assert not refused["loaded"] and record["family"] not in plugins.families()
    return refused


def test_a_family_record_with_a_bad_key_is_refused_naming_file_and_key(tmp_path, monkeypatch):
    manifest = tmp_path / "badmodels.yaml"
    record = {"family": "badmodels", "version": "1.0.0", "manifest_path": str(manifest), "library_path": "",
              "loaded": True, "error": "", "fingerprint": "", "kernels": [],
              "manifest": {"models": [{"model_type": "m", "mixers": ["M"], "layer_types": ["x"]}], "seams": {}}}
    refused = _refused_record(monkeypatch, record)
    assert refused["error"] == f"invalid family record: {manifest}: key 'models[0].module': missing", refused["error"]
    record = {**record, "manifest": {"seams": {}}, "kernels": [("tree_conv",)]}
    refused = _refused_record(monkeypatch, record)
    assert refused["error"].startswith(f"invalid family record: {manifest}: key 'kernels': expected (kernel, device, "
                                       "available) triples"), refused["error"]


def test_the_engine_reads_family_fields():
    """Outside plugins / _specs (which build a Family from the registry's dicts), families are read by field,
    not as a record's keys (``record["manifest"]``, ``families()[name].get(...)``)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    engine = root / "bindings" / "python" / "tree_recurrence"
    builders = {engine / "plugins.py", engine / "_specs.py", engine / "bench.py"}
    as_dict = re.compile(r"""(\brecord|\bfamilies\(\)\[[^\]]+\]|\bfamilies\[[^\]]+\]|\bfound\[[^\]]+\])"""
                         r"""\s*(\[\s*["']|\.get\()""")
    files = [*engine.rglob("*.py"), *root.glob("plugins/*/python/**/*.py")]
    hits = [f"{path.relative_to(root)}:{number}: {line.strip()}" for path in files
            if path not in builders and "build" not in path.parts
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if as_dict.search(line)]
    assert not hits, "family records read as dicts (read the Family's fields):\n" + "\n".join(hits)
    assert as_dict.search('record["manifest"]') and as_dict.search("families()[f].get('x')")
    assert not as_dict.search("record.manifest.get('routes')")
