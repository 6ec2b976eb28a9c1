"""The load check of a manifest's ``native.op``: a plugin whose scan seam names a
native op that is not registered, or not with the schema the driver calls it by, is refused at load
with an error naming the manifest file, the seam and the op (``tree_recurrence/_native_schema.py``)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tree_recurrence as tr
from tree_recurrence import _native_schema, plugins

GDN = "gated_delta_net"
SEAM = "torch_chunk_gated_delta_rule"
NS = "tree_recurrence_gated_delta_net"


def gdn_record_with(change) -> dict:
    """The loaded GDN plugin's registry record (as ``_core.plugin_records`` gives it), its scan seam's spec
    ``change(spec)`` edited."""
    family = plugins.families()[GDN]
    manifest = copy.deepcopy(dict(family.manifest))
    change(manifest["seams"][SEAM])
    return {"family": family.name, "version": family.version, "manifest_path": family.manifest_path,
            "library_path": family.library_path, "loaded": True, "error": "", "fingerprint": family.fingerprint,
            "manifest": manifest, "kernels": [list(k) for k in family.kernels]}


def test_the_shipped_families_pass():
    for family, record in plugins.families().items():
        assert _native_schema.check_record(record) is None, family
    assert not [r for r in plugins.refused() if "native op schema" in (r.get("error") or "")]


def _set_native(**native):
    return lambda spec: spec["native"].update(native)


def _drop_kwarg(name):
    return lambda spec: spec["native"]["kwargs"].pop(name)


def _add_kwarg(name):
    return lambda spec: spec["native"]["kwargs"].update({name: [name, 1.0]})


@pytest.mark.parametrize("change,problem", [
    (_set_native(op="gdn_tree_scann"), f"native op '{NS}::gdn_tree_scann' is not registered"),
    (_set_native(op="gdn_token_scan"), f"native op '{NS}::gdn_token_scan' takes 10 arguments, the driver passes 15 "
                                       "positionally for a chunked (native.chunk given) op"),
    (lambda spec: spec["native"].pop("chunk"),
     f"native op '{NS}::gdn_tree_scan': argument 5 is 'gather', the driver passes the plan table 'seg_offsets' there"),
    # the shared ops (torch.ops.tree_recurrence.tree_conv, ...) are no family's own: a manifest cannot name one
    (_set_native(op="tree_conv", chunk=None), f"native op '{NS}::tree_conv' is not registered"),
    (_set_native(op="gdn_fused_stages"), f"native op '{NS}::gdn_fused_stages' returns (List[Tensor]), the driver "
                                         "expects one Tensor"),
    (_drop_kwarg("scale"), "parameter 'scale' has no default and native.kwargs does not give it"),
    (_add_kwarg("chunk_size"), "native.kwargs names 'chunk_size', which is not a parameter after the driver's 15"),
    (lambda spec: spec.update(sequence=["query", "key", "value", "g"], neutral={"key": 0.0, "g": 0.0}),
     f"native op '{NS}::gdn_tree_scan': argument 4 is 'beta', the driver passes the plan table 'gather' there"),
])
def test_a_manifest_whose_native_op_does_not_fit_is_refused_at_load(change, problem):
    record = gdn_record_with(change)
    ((out, family),) = plugins._confined([record])
    assert family is None
    assert not out["loaded"]
    path = record["manifest_path"]
    assert out["error"].startswith(f"native op schema: {path}: seam '{SEAM}': native op '{NS}::"), out["error"]
    assert problem in out["error"], out["error"]
    assert len(out["error"]) < 2500


def test_register_family_with_ops_checks_the_native_op():
    spec = {"adapter": "scan", "args": ["q", "k", "v", "g", "beta"], "sequence": ["q", "k", "v", "g", "beta"],
            "native": {"op": "gdn_token_scan", "chunk": 64}}
    with pytest.raises(ValueError, match=rf"^register_family\('pyschema'\): seam 'rule': native op '{NS}::gdn_token_scan' "
                                         "takes 10 arguments"):
        tr.register_family("pyschema", "pyschema_model", ["PySchemaMixer"], "linear_attention", seams={"rule": spec},
                           modules=["pyschema.modeling"], ops=GDN)
    assert "pyschema" not in plugins.REGISTRY.python_families
    good = {**spec, "native": {"op": "gdn_tree_scan", "chunk": 64,
                               "kwargs": {"scale": ["scale", 0.0], "use_qk_l2norm": ["use_qk_l2norm_in_kernel", False]}}}
    tr.register_family("pyschema", "pyschema_model", ["PySchemaMixer"], "linear_attention", seams={"rule": good},
                       modules=["pyschema.modeling"], ops=GDN)
    tr.unregister_family("pyschema")


def test_hostile_plugin_folder_with_a_mismatched_native_op(tmp_path):
    """A real plugin folder (the GDN library, its manifest's native op swapped for the token op with the
    chunked convention), the package's own folder emptied: doctor lists it refused with the reason;
    the other plugin folders' families are unaffected."""
    record = plugins.families()[GDN]
    folder = tmp_path / "plugins"
    folder.mkdir()
    library = Path(record.library_path)
    shutil.copy(library, folder / library.name)
    text = Path(record.manifest_path).read_text()
    assert "      op: gdn_tree_scan\n" in text
    (folder / "gated_delta_net.yaml").write_text(text.replace("      op: gdn_tree_scan\n", "      op: gdn_token_scan\n"))
    empty = tmp_path / "empty"
    empty.mkdir()
    script = textwrap.dedent(f"""\
        import json, pathlib
        from tree_recurrence import plugins
        plugins.PACKAGE_PLUGIN_DIR = pathlib.Path({str(empty)!r})
        from tree_recurrence.__main__ import doctor_report
        print(json.dumps(doctor_report()))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TREE_RECURRENCE_PLUGIN_PATH": str(folder)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [p["family"] for p in report["plugins"]] == []
    (refused,) = report["refused"]
    manifest = str(folder / "gated_delta_net.yaml")
    assert refused["family"] == GDN and refused["reason"].startswith(
        f"native op schema: {manifest}: seam '{SEAM}': native op '{NS}::gdn_token_scan' takes 10 arguments"), refused
