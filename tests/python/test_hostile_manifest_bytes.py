"""Plugin folders holding bytes that are not UTF-8, through discovery, ``install`` and
``doctor`` in subprocesses.

Every string that crosses from the C++ core to Python (paths, YAML errors, family names, reasons, manifest
values, exception messages) can carry such bytes: yaml-cpp quotes the offending byte in its errors, file
names are bytes, a manifest's values are whatever its file holds. Each hostile folder below must end as
refused plugins whose reasons are ``str`` (bytes shown as ``\\xNN`` escapes), with the in-tree families
still loaded, ``install`` working and ``doctor`` exiting 0 with the refusals printed. The folders are:
(a) the one-line manifest ``a: "\\<0xF8>"`` (yaml-cpp's "unknown escape character" message carries the byte),
(b) manifests of random bytes (several seeds, up to the 1 MiB limit), (c) file and folder names that are
not UTF-8, (d) valid manifests naming a library of random bytes, or a library path that is not UTF-8.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tree_recurrence import _core

HERE = Path(__file__).parent
IN_TREE = ("gated_delta_net", "mamba2", "short_conv")
BAD_ESCAPE = b'a: "\\\xf8"\n'
MODELS = b"[{model_type: hostile, module: hostile.modeling, mixers: [HostileMixer], layer_types: [hostile]}]"


def manifest(family: bytes, library: bytes) -> bytes:
    return (b"schema: 1\nfamily: " + family + b"\nversion: 1.0.0\nlibrary: " + library + b"\nmodels: " + MODELS +
            b"\nseams: {causal_conv1d_fn: {adapter: conv}}\n")


def random_name(rng: random.Random, length: int = 24) -> bytes:
    """Random bytes but '/' and NUL (which a file name cannot hold), the first one not UTF-8."""
    allowed = [b for b in range(1, 256) if b not in b"/:"]  # ':' too: TREE_RECURRENCE_PLUGIN_PATH's separator
    return b"\xf8" + bytes(rng.choice(allowed) for _ in range(length))


def shown(path: bytes) -> str:
    """A path as the registry's reasons show it: the canonical path, bytes that are not UTF-8 as \\xNN."""
    return os.path.realpath(path).decode("utf-8", "backslashreplace")


def plant(folder: Path, name: bytes, content: bytes) -> bytes:
    path = os.path.join(os.fsencode(folder), name)
    with open(path, "wb") as f:
        f.write(content)
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Case -> (plugin folder as bytes, expected refusals: (manifest path bytes, family as shown, reason
    prefix, a fragment the reason holds))."""
    root = os.fsencode(tmp_path_factory.mktemp("hostile_bytes"))
    rng = random.Random(38)
    out = {}

    def folder(name: bytes) -> bytes:
        path = os.path.join(root, name)
        os.mkdir(path)
        return path

    # (a)
    a = folder(b"escape")
    path = plant(a, b"bad_escape.yaml", BAD_ESCAPE)
    out["escape"] = (a, [(path, "bad_escape", f"manifest {shown(path)}: invalid YAML", "\\xf8")])
    # (b): random bytes, raw and after a valid start, the largest at the 1 MiB limit (so it is parsed)
    b = folder(b"random")
    expected = []
    for seed, size in [(0, 1000), (1, 20_000), (2, 300_000), (3, 2**20)]:
        path = plant(b, b"random_%d.yaml" % seed, random.Random(seed).randbytes(size))
        expected.append((path, f"random_{seed}", f"manifest {shown(path)}", ""))
    path = plant(b, b"random_tail.yaml", b"schema: 1\nfamily: " + random.Random(4).randbytes(5000))
    expected.append((path, "random_tail", f"manifest {shown(path)}", ""))
    out["random"] = (b, expected)
    # (c): file names that are not UTF-8, and a plugin folder whose name is not UTF-8
    c = folder(b"names")
    name = random_name(rng)
    path = plant(c, name + b".yaml", BAD_ESCAPE)
    expected = [(path, name.decode("utf-8", "backslashreplace"), f"manifest {shown(path)}: invalid YAML", "\\xf8")]
    path = plant(c, b"bad\xf8\xfename.yaml", manifest(b"bad_name", b"libmissing.so"))
    expected.append((path, "bad_name", f"library {shown(os.path.join(c, b'libmissing.so'))} named by the manifest "
                     "does not exist", ""))
    # a 121-byte name, cut to 84 bytes as the family shown, before the character that cut would split
    path = plant(c, ("a" + "\u00e9" * 60).encode() + b".yaml", BAD_ESCAPE)
    expected.append((path, "a" + "\u00e9" * 41 + "... (121 bytes)", f"manifest {shown(path)}: invalid YAML", ""))
    out["names"] = (c, expected)
    d_name = folder(b"plugins\xf8\xfe" + random_name(rng, 12))
    path = plant(d_name, b"in_bytes_folder.yaml", manifest(b"in_bytes_folder", b"libmissing.so"))
    expected = [(path, "in_bytes_folder", f"library {shown(os.path.join(d_name, b'libmissing.so'))} named by the "
                 "manifest does not exist", "\\xf8\\xfe")]
    path = plant(d_name, b"\xff.yaml", random.Random(5).randbytes(4096))
    expected.append((path, "\\xff", f"manifest {shown(path)}", "\\xf8\\xfe"))
    out["folder_name"] = (d_name, expected)
    # (d): valid manifests naming a binary of random bytes, paths and values that are not UTF-8
    d = folder(b"library")
    random_library = plant(d, b"librandom.so", random.Random(6).randbytes(65536))
    bytes_library = plant(d, b"librandom\xf8.so", random.Random(7).randbytes(65536))
    missing_library = os.path.join(d, b"lib\xf8\xfe\xff.so")
    path = plant(d, b"random_library.yaml", manifest(b"random_library", b"librandom.so"))
    expected = [(path, "random_library", f"library {shown(random_library)} cannot be loaded", "")]
    path = plant(d, b"bytes_library.yaml", manifest(b"bytes_library", b"librandom\xf8.so"))
    expected.append((path, "bytes_library", f"library {shown(bytes_library)} cannot be loaded",
                     "librandom\\xf8.so"))
    path = plant(d, b"missing_library.yaml", manifest(b"missing_library", b"lib\xf8\xfe\xff.so"))
    expected.append((path, "missing_library", f"library {shown(missing_library)} named by the "
                     "manifest does not exist", ""))
    path = plant(d, b"bytes_family.yaml", manifest(b"fam\xf8ily", b"librandom.so"))
    expected.append((path, "bytes_family", f"manifest {shown(path)}: family 'fam\\xf8ily' must be lower-case", ""))
    out["library"] = (d, expected)
    return out


SCRIPT = textwrap.dedent("""\
    import json, os, sys, torch
    sys.path.insert(0, %r)
    import models as M
    import tree_recurrence as tr
    from tree_recurrence import plugins
    for folder in os.environ.get("TR_TEST_REGISTER", "").split(os.pathsep):
        if folder:
            assert all(isinstance(r["error"], str) for r in plugins.add_plugin_path(folder))
    records = plugins.discover(rescan=True)
    fields = ("family", "version", "manifest_path", "library_path", "error", "fingerprint")
    model = M.make_model("qwen3_5_text")
    support = tr.install(model)
    tree = M.pack_forest("fan")
    out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
    assert torch.isfinite(out.logits).all()
    print(json.dumps({"mode": support.mode, "reason": support.reason, "records": [
        {**{k: r[k] for k in fields}, "loaded": r["loaded"], "all_str": all(isinstance(r[k], str) for k in fields)}
        for r in records]}))
    """) % str(HERE)


def run(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, env={**os.environ, **env}, timeout=timeout)


def check_records(report: dict, expected: list) -> None:
    by_path = {os.fsencode(r["manifest_path"]): r for r in report["records"]}
    for family in IN_TREE:
        assert any(r["family"] == family and r["loaded"] for r in report["records"]), \
            [r for r in report["records"] if r["family"] == family]
    assert report["mode"] == "tree", report["reason"]
    for path, family, prefix, fragment in expected:
        record = by_path.get(os.path.realpath(path))
        assert record is not None, (path, sorted(by_path))
        assert record["all_str"] and not record["loaded"], record
        assert record["family"] == family, record
        assert record["error"].startswith(prefix), (prefix, record["error"][:500])
        assert fragment in record["error"], (fragment, record["error"][:500])
        assert len(record["error"]) <= 2100


CASES = ["escape", "random", "names", "folder_name", "library"]


@pytest.mark.parametrize("case", CASES)
def test_discovery_and_install_refuse_each_hostile_manifest(cases, case):
    """The folder on TREE_RECURRENCE_PLUGIN_PATH: discovery does not raise, each hostile manifest is
    refused with its reason as str, the in-tree families load and install works."""
    folder, expected = cases[case]
    done = run(["-c", SCRIPT], {"TREE_RECURRENCE_PLUGIN_PATH": folder})
    assert done.returncode == 0, done.stderr.decode("utf-8", "backslashreplace")[-3000:]
    check_records(json.loads(done.stdout.decode().splitlines()[-1]), expected)


def test_folders_registered_from_python(cases):
    """Every folder at once, registered with plugins.add_plugin_path (names as os.fsdecode gives them)."""
    register = os.pathsep.join(os.fsdecode(folder) for folder, _ in cases.values())
    done = run(["-c", SCRIPT], {"TR_TEST_REGISTER": register})
    assert done.returncode == 0, done.stderr.decode("utf-8", "backslashreplace")[-3000:]
    check_records(json.loads(done.stdout.decode().splitlines()[-1]), [e for _, exp in cases.values() for e in exp])


def test_doctor_prints_each_refusal(cases):
    """``doctor`` with every folder on TREE_RECURRENCE_PLUGIN_PATH: exit 0, the in-tree families loaded, each
    hostile manifest refused with its reason, bytes that are not UTF-8 printed as \\xNN escapes."""
    folders = [folder for folder, _ in cases.values()]
    done = run(["-m", "tree_recurrence", "doctor"], {"TREE_RECURRENCE_PLUGIN_PATH": b":".join(folders)})
    assert done.returncode == 0, done.stderr.decode("utf-8", "backslashreplace")[-3000:]
    stdout = done.stdout.decode("utf-8")  # strict: doctor prints UTF-8 whatever the files held
    loaded, refused = stdout.split("\nplugins refused: ")
    for family in IN_TREE:
        assert f"\n  {family} " in loaded, family
    (folders_line,) = [line for line in stdout.split("\n") if line.startswith("  plugin folders: ")]
    assert cases["folder_name"][0].decode("utf-8", "backslashreplace") in folders_line
    for _, expected in cases.values():
        for _, family, prefix, fragment in expected:
            assert f"\n  {family}: {prefix}" in refused, (family, prefix, refused[:3000])
            assert fragment in refused


def test_doctor_json_keeps_paths_that_name_the_files(cases):
    """``doctor --json``: manifest paths and plugin folders as os.fsdecode makes them (json escapes the
    surrogates), so os.fsencode gives back the bytes of each file."""
    folders = [folder for folder, _ in cases.values()]
    done = run(["-m", "tree_recurrence", "doctor", "--json"], {"TREE_RECURRENCE_PLUGIN_PATH": b":".join(folders)})
    assert done.returncode == 0, done.stderr.decode("utf-8", "backslashreplace")[-3000:]
    report = json.loads(done.stdout)
    assert [os.fsencode(f) for f in report["plugin_folders"][1:]] == folders
    reasons = {os.fsencode(r["manifest"]): r["reason"] for r in report["refused"]}
    for _, expected in cases.values():
        for path, _, prefix, _ in expected:
            assert reasons[os.path.realpath(path)].startswith(prefix)


GOOD_LIBRARY = HERE.parents[1] / "build" / "py" / "test_plugins" / "libtest_good.so"


def test_loaded_manifest_values_that_are_not_utf8(tmp_path):
    """A plugin that loads (the test library libtest_good.so) whose manifest holds values that are not UTF-8
    and keys that are not scalars: its record's manifest is str all through."""
    if not GOOD_LIBRARY.is_file():
        pytest.skip(f"{GOOD_LIBRARY} is not built")
    folder = tmp_path / "good"
    folder.mkdir()
    (folder / GOOD_LIBRARY.name).write_bytes(GOOD_LIBRARY.read_bytes())
    (folder / "test_good.yaml").write_bytes(
        b"schema: 1\nfamily: test_good\nversion: 1.0.0\nlibrary: libtest_good.so\nnotes: caf\xe9 \xf8\n"
        b"? [a, b]\n: 1\n~: null key\nmodels: [{model_type: test_model, module: tests.fake_modeling, "
        b"mixers: [Mixer\xf8], layer_types: [test_layer]}]\nseams: {fake_seam: {adapter: conv}}\n")
    code = textwrap.dedent("""\
        import json, os
        from tree_recurrence import _core
        records = [r for r in _core.discover_plugins([os.environ["TR_TEST_FOLDER"]]) if r["family"] == "test_good"]
        print(json.dumps([{"loaded": r["loaded"], "error": r["error"], "manifest": r["manifest"]} for r in records]))
        """)
    done = run(["-c", code], {"TR_TEST_FOLDER": str(folder)})
    assert done.returncode == 0, done.stderr.decode("utf-8", "backslashreplace")[-3000:]
    (record,) = json.loads(done.stdout.decode().splitlines()[-1])
    assert record["loaded"], record["error"]
    manifest = record["manifest"]
    assert manifest["notes"] == "caf\\xe9 \\xf8"
    assert manifest["models"][0]["mixers"] == ["Mixer\\xf8"]
    assert manifest["[a, b]"] == 1 and manifest["~"] == "null key"


def test_policy_errors_quoting_bytes_are_text(tmp_path):
    """An exception thrown in C++ whose message carries file content becomes the usual Python error, its
    bytes escaped (pybind11 would decode what() as strict UTF-8)."""
    with pytest.raises(ValueError, match=r"invalid YAML: .*\\xf8"):
        _core.Policy.from_yaml_text(BAD_ESCAPE, _core.Policy())
    folder = os.path.join(os.fsencode(tmp_path), b"policy\xf8")
    os.mkdir(folder)
    bad = os.path.join(folder, b"bad.yaml")
    with open(bad, "wb") as f:
        f.write(BAD_ESCAPE)
    with pytest.raises(ValueError, match=r"policy\\xf8/bad.yaml: invalid YAML: .*\\xf8"):
        _core.Policy.from_yaml_file(os.fsdecode(bad), _core.Policy())
    good = os.path.join(folder, b"good.yaml")
    with open(good, "wb") as f:
        f.write(b"strategy: fork\n")
    assert _core.Policy.from_yaml_file(os.fsdecode(good), _core.Policy()).strategy == "fork"
    assert _core.Policy.from_yaml_file(good, _core.Policy()).strategy == "fork"


def test_paths_given_to_the_core():
    """Folders and policy files reach the core as os.fsencode's bytes: a NUL byte (which would cut the name
    the file system sees) is refused as Python's os functions refuse it, one path is not a list of them."""
    with pytest.raises(ValueError, match=r"embedded null byte in path 'plugins\\xf8\\0\.\.\.'"):
        _core.discover_plugins([os.fsdecode(b"plugins\xf8\0/elsewhere")])
    with pytest.raises(ValueError, match="embedded null byte"):
        _core.Policy.from_yaml_file(b"policy.yaml\0", _core.Policy())
    with pytest.raises(TypeError, match="expected a list of folders"):
        _core.discover_plugins("plugins")
