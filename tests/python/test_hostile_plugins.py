"""Hostile plugin folders through ``doctor`` and ``install`` in subprocesses.

A plugin folder is input: whoever can write into a folder on TREE_RECURRENCE_PLUGIN_PATH chooses
what this process loads (docs/plugins.md, "Trust"). These folders try to load libraries from
outside their folder, trip the filesystem (symlink loops, over-long names and paths), blow up the
YAML reader and smuggle NULs and megabytes into reasons. Each must end as one refused plugin with a
true, bounded reason: doctor exits 0, install works, the real families still load, and no library
outside its folder is ever opened (a constructor there would create a marker file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MODELS = "[{model_type: hostile, module: hostile.modeling, mixers: [HostileMixer], layer_types: [hostile]}]"


def manifest(family: str, library: str) -> str:
    return (f"schema: 1\nfamily: {family}\nversion: 1.0.0\nlibrary: {library}\nmodels: {MODELS}\n"
            "seams: {causal_conv1d_fn: {adapter: conv}}\n")


@pytest.fixture(scope="module")
def marker_library(tmp_path_factory) -> Path:
    """A shared library whose constructor creates $TR_MARKER (proof that it was opened)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("marker")
    source = folder / "marker.c"
    source.write_text(textwrap.dedent("""\
        #include <fcntl.h>
        #include <stdlib.h>
        #include <unistd.h>
        __attribute__((constructor)) static void opened(void) {
          const char* path = getenv("TR_MARKER");
          if (path) { int fd = open(path, O_CREAT | O_WRONLY, 0644); if (fd >= 0) close(fd); }
        }
        """))
    library = folder / "libmarker.so"
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True)
    return library


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, marker_library) -> dict:
    """Plugin folders, each holding hostile manifests; returns folders and the expected reasons."""
    root = tmp_path_factory.mktemp("hostile")
    outside = root / "outside"
    outside.mkdir()
    shutil.copy(marker_library, outside / "libmarker.so")
    plugins = root / "plugins"
    (plugins / "sub").mkdir(parents=True)
    # 4: libraries outside the manifest's folder (relative, deep, absolute, through a symlink)
    (plugins / "up.yaml").write_text(manifest("up", "../outside/libmarker.so"))
    (plugins / "deep.yaml").write_text(manifest("deep", "sub/../" + "../" * 40 + str(outside / "libmarker.so").lstrip("/")))
    (plugins / "absolute.yaml").write_text(manifest("absolute", str(outside / "libmarker.so")))
    (plugins / "libsneaky.so").symlink_to(outside / "libmarker.so")
    (plugins / "sneaky.yaml").write_text(manifest("sneaky", "libsneaky.so"))
    (plugins / "libzero.so").symlink_to("/dev/zero")
    (plugins / "zero.yaml").write_text(manifest("zero", "libzero.so"))
    # 5: symlink loops (manifest self, manifest pair, library, directory), over-long names and paths
    (plugins / "self_loop.yaml").symlink_to(plugins / "self_loop.yaml")
    (plugins / "pair_a.yaml").symlink_to(plugins / "pair_b.yaml")
    (plugins / "pair_b.yaml").symlink_to(plugins / "pair_a.yaml")
    (plugins / "libloop.so").symlink_to(plugins / "libloop.so")
    (plugins / "library_loop.yaml").write_text(manifest("library_loop", "libloop.so"))
    (plugins / "dir_loop").symlink_to(plugins)
    (plugins / "dir_loop_lib.yaml").write_text(manifest("dir_loop_lib", "dir_loop/" * 50 + "libnothing.so"))
    (plugins / "long_name.yaml").write_text(manifest("long_name", "l" * 300 + ".so"))
    (plugins / "long_path.yaml").write_text(manifest("long_path", "/".join(["p" * 99] * 60) + "/lib.so"))
    # 6: a YAML bomb (billion laughs) in an otherwise valid manifest
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    (plugins / "bomb.yaml").write_text("\n".join(lines) + "\n" + manifest("bomb", "libmarker_missing.so"))
    # 7: reasons true and bounded
    (plugins / "text.so").write_text("this is a text file, not a shared library\n" * 20)
    (plugins / "text.yaml").write_text(manifest("text", "text.so"))
    (plugins / "adir.so").mkdir()
    (plugins / "directory.yaml").write_text(manifest("directory", "adir.so"))
    shutil.copy(marker_library, plugins / "libtestgood.so")
    (plugins / "nul.yaml").write_text(manifest("nul", '"libtestgood.so\\0../outside/libmarker.so"'))
    (plugins / "huge_family.yaml").write_text(manifest("f" * (10 * 2**20), "lib.so"))  # 10 MB
    (plugins / "long_family.yaml").write_text(manifest("g" * 5000, "lib.so"))
    (plugins / "long_version.yaml").write_text(manifest("long_version", "lib.so").replace("1.0.0", "9" * 100000))
    expected = {
        "up": "outside the plugin folder", "deep": "outside the plugin folder", "absolute": "outside the plugin folder",
        "sneaky": "outside the plugin folder", "zero": "outside the plugin folder",
        "self_loop": "Too many levels of symbolic links", "pair_a": "Too many levels of symbolic links",
        "pair_b": "Too many levels of symbolic links", "library_loop": "Too many levels of symbolic links",
        "dir_loop_lib": "Too many levels of symbolic links",
        "long_name": "File name too long", "long_path": "File name too long",
        "bomb": "once aliases are expanded",
        "text": "invalid ELF header", "directory": "is not a regular file (a directory)", "nul": "contains a NUL character",
        "huge_family": "bytes, at most 1048576", "long_family": "family name is 5000 characters long, at most 64",
        "long_version": "named by the manifest does not exist",  # a 100 kB version, cut where it is shown
    }
    # a plugin folder that is itself a symlink loop, and one named by a 6000-character path
    (root / "folder_loop").symlink_to(root / "folder_loop")
    path = os.pathsep.join([str(plugins), str(root / "folder_loop"), "/" + "/".join(["q" * 99] * 60)])
    return {"root": root, "path": path, "expected": expected, "marker": root / "opened"}


def run(args: list[str], hostile: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "TREE_RECURRENCE_PLUGIN_PATH": hostile["path"], "TR_MARKER": str(hostile["marker"])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_doctor_refuses_each_hostile_plugin_with_a_true_bounded_reason(hostile):
    done = run(["-m", "tree_recurrence", "doctor", "--json"], hostile)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout) < 200_000, "doctor printed a field whole"
    report = json.loads(done.stdout)
    assert {p["family"] for p in report["plugins"]} >= {"gated_delta_net", "mamba2", "short_conv"}
    reasons = {r["family"]: r["reason"] for r in report["refused"]}
    for family, expected in hostile["expected"].items():
        assert family in reasons, (family, sorted(reasons))
        assert expected in reasons[family], (family, reasons[family])
    for reason in reasons.values():
        assert len(reason) <= 2100
        assert "Bad file descriptor" not in reason
    assert any("folder_loop" in r["manifest"] and "Too many levels of symbolic links" in r["reason"] for r in report["refused"])
    assert any("File name too long" in r["reason"] and "qqq" in r["manifest"] for r in report["refused"])
    assert not hostile["marker"].exists(), "a library outside its plugin folder was opened"


def test_doctor_text_output_is_bounded(hostile):
    done = run(["-m", "tree_recurrence", "doctor"], hostile)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout) < 200_000
    assert "outside the plugin folder" in done.stdout
    assert not hostile["marker"].exists()


def test_install_works_beside_hostile_plugin_folders(hostile):
    code = textwrap.dedent("""\
        import sys, torch
        sys.path.insert(0, %r)
        import models as M
        import tree_recurrence as tr
        model = M.make_model("qwen3_5_text")
        support = tr.install(model)
        assert support.mode == "tree", support.reason
        tree = M.pack_forest("fan")
        out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
        assert torch.isfinite(out.logits).all()
        print("ok", support.mode)
        """) % str(Path(__file__).parent)
    done = run(["-c", code], hostile, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok tree" in done.stdout
    assert not hostile["marker"].exists()
