"""A first install without stumbles: ``bench`` checks its optional packages before the first point
(a missing matplotlib costs the PNG and one line, never the run), finds its model table inside the
installed package from any working folder, and ``doctor`` says whether the CUDA the kernels were
built with fits the running torch's CUDA and the driver (one line, and why where it breaks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tree_recurrence
from tree_recurrence import __main__ as cli
from tree_recurrence import bench

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# bench: dependencies checked first, its own table
# ------------------------------------------------------------------------------------------------


def test_bench_without_matplotlib_from_another_folder_runs_to_the_end(tmp_path):
    """A matplotlib that does not import, a working folder outside the repository, no --models: one
    line says there is no PNG (before the first point), every point runs, the table prints and
    bench.json is complete. One model, two prompt lengths: a plot failure after the first prompt
    length is what cut the run short."""
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib' (a test stub)\")\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    cmd = [sys.executable, "-m", "tree_recurrence", "bench", "--tiny", "--device", "cpu", "--model", "lfm2",
           "--prompts", "0,4", "--checkpointing", "off", "--warmup", "0", "--repeat", "1", "--out", "out"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = [line for line in proc.stderr.splitlines() if "no bench.png" in line]
    assert len(notes) == 1 and "pip install matplotlib" in notes[0] and "tree-recurrence[bench]" in notes[0], notes
    assert proc.stderr.index("no bench.png") < proc.stderr.index("%|")  # said before the progress bar starts
    assert "bench: 100%" in proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("lfm2 ")]
    assert len(rows) == 2 and "tree ms" in proc.stdout, proc.stdout  # the table, both points
    assert proc.stdout.rstrip().endswith("bench.json")  # wrote the JSON, no PNG named
    report = json.loads((work / "out" / "bench.json").read_text())
    assert [r["prompt"] for r in report["results"]] == [0, 4]
    assert all(r[mode]["ms"] > 0 for r in report["results"] for mode in bench.MODES)
    assert not (work / "out" / "bench.png").exists()


def test_dependency_check_skips_the_plot_in_one_line_and_stops_on_a_required_package(monkeypatch, capsys):
    assert bench.check_dependencies(True) is True  # matplotlib is installed here
    assert bench.check_dependencies(False) is False and capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.check_dependencies(True) is False
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no bench.png" in err[0] and "pip install matplotlib" in err[0], err
    assert bench.check_dependencies(False) is False and capsys.readouterr().err == ""  # --no-plot: nothing to say
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit, match=r"tqdm does not import .*tree-recurrence\[bench\]"):
        bench.check_dependencies(False)


def test_the_dependency_check_runs_before_any_work(monkeypatch):
    """bench.run stops on a missing required package before reading its table or building a model."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(bench, "load_table", lambda *a: pytest.fail("the table was read before the check"))
    args = SimpleNamespace(no_plot=True, models=None)
    with pytest.raises(SystemExit, match="tqdm does not import"):
        bench.run(args)


def test_bench_table_is_installed_with_the_package_and_is_its_only_copy():
    table = bench.default_table()
    package = Path(tree_recurrence.__file__).parent  # the installed package, not the checkout
    assert table == package / "bench_models.json" and table.is_file()
    assert set(bench.load_table()) == {"qwen3_5", "nemotron_h", "lfm2"} == set(bench.load_table(table))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:  # one copy in the repository: the package's
        copies = [f for f in tracked.stdout.splitlines() if f.endswith("bench_models.json")]
        assert copies == ["bindings/python/tree_recurrence/bench_models.json"], copies


def test_bench_table_errors_name_the_file(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"--models .*nothing\.json: no such file"):
        bench.load_table(tmp_path / "nothing.json")
    monkeypatch.setattr(bench, "TABLE_NAME", "no_such_table.json")
    with pytest.raises(SystemExit, match=r"model table .*no_such_table\.json is missing.*reinstall"):
        bench.load_table()


# ------------------------------------------------------------------------------------------------
# doctor: the CUDA line
# ------------------------------------------------------------------------------------------------


def test_built_cuda_reads_the_fingerprint():
    assert cli.built_cuda("torch 2.11.0, cxx11_abi 1, cuda 13.0.88 (sm 90)") == ("13.0.88", "90")
    assert cli.built_cuda("torch 2.11.0, cxx11_abi 1, cuda 12.8.93 (sm 80,90a)") == ("12.8.93", "80,90a")
    assert cli.built_cuda("torch 2.11.0, cxx11_abi 1, cuda 13.0.88") == ("13.0.88", None)
    assert cli.built_cuda("torch 2.11.0, cxx11_abi 1, cuda none") == (None, None)


@pytest.mark.parametrize("built, torch_cuda, driver, archs, gpu, fine, words", [
    # the same major: fine, whatever the minors (the kernels use torch's libcudart.so.13)
    ("13.0.88", "13.2", "13.2", "90", "90", True, ["minor version compatibility", "libcudart.so.13"]),
    ("13.0.88", "13.0", "13.0", "90", "90", True, ["the same version"]),
    ("13.2.51", "13.0", "13.2", "90", "90", True, ["minor version compatibility"]),
    ("13.0.88", "13.2", None, "90", None, True, ["no NVIDIA driver"]),
    # a driver of the major but older than the toolkit: the built archs' machine code runs ...
    ("13.2.51", "13.2", "13.0", "90", "90", True, ["older than the toolkit", "sm 90"]),
    # ... another GPU would need PTX JIT, which that driver refuses
    ("13.2.51", "13.2", "13.0", "90", "100", False, ["cannot JIT PTX", "CMAKE_CUDA_ARCHITECTURES=100"]),
    # what breaks: another major, a driver of an older major, a torch without CUDA
    ("12.8.93", "13.2", "13.2", "90", "90", False, ["libcudart.so.12", "libcudart.so.13", "CUDA 13 toolkit"]),
    ("13.0.88", "12.8", "13.0", "90", "90", False, ["libcudart.so.13", "libcudart.so.12", "CUDA 12 toolkit"]),
    ("13.0.88", "13.0", "12.9", "90", "90", False, ["driver supports CUDA up to 12.9", "update the driver"]),
    ("13.0.88", None, None, "90", None, False, ["this torch has no CUDA"]),
    (None, "13.0", "13.0", None, "90", True, ["no CUDA kernels"]),
])
def test_cuda_compatibility(built, torch_cuda, driver, archs, gpu, fine, words):
    ok, line = cli.cuda_compatibility(built, torch_cuda, driver, archs, gpu)
    assert ok is fine, line
    assert line.startswith("fine: " if fine else "WARNING: ") and "\n" not in line, line
    for word in words:
        assert word in line, (word, line)


def test_cuda_compatibility_refuses_a_version_it_cannot_read():
    with pytest.raises(ValueError, match="not a CUDA version.*'thirteen'"):
        cli.cuda_compatibility("thirteen", "13.0", None)


def test_doctor_prints_the_cuda_line_and_puts_it_in_the_json(monkeypatch, capsys):
    """The line under "running torch", from the core's fingerprint, torch.version.cuda and the driver;
    a differing major prints the warning (in the JSON too: ``cuda_check``)."""
    core = SimpleNamespace(core_fingerprint=lambda: "torch 2.11.0, cxx11_abi 1, cuda 13.0.88 (sm 90)")
    monkeypatch.setattr(cli, "driver_cuda", lambda: "13.2")
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    with monkeypatch.context() as m:
        m.setattr(cli, "_core", core)
        report = cli.cuda_report()
    assert report["fine"] and report["built"] == "13.0.88" and report["torch"] == "13.2" and report["driver"] == "13.2"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with monkeypatch.context() as m:
        m.setattr(cli, "_core", core)
        report = cli.cuda_report()
    assert not report["fine"] and "libcudart.so.12" in report["line"]

    with monkeypatch.context() as m:  # a plugin's own fingerprint (built out of tree) is read, not the core's
        m.setattr(cli, "_core", SimpleNamespace(core_fingerprint=lambda: pytest.fail("the core's fingerprint was read")))
        assert cli.cuda_report("torch 2.11.0, cxx11_abi 1, cuda 12.8.93 (sm 90)")["fine"]

    fine = {**report, "fine": True, "line": "fine: as the core"}
    monkeypatch.setattr(cli, "cuda_report", lambda fingerprint=None: report if fingerprint is None else fine)
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  running torch"))
    assert lines[at + 1] == f"  cuda: {report['line']}"
    assert not [line for line in lines if line.startswith("    cuda:")]  # plugins that fit add no line
    assert cli.main(["doctor", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cuda_check"] == report and all(p["cuda_check"] == fine for p in printed["plugins"])

    monkeypatch.setattr(cli, "cuda_report", lambda fingerprint=None: report)  # every plugin breaks too
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plugins = [i for i, line in enumerate(lines) if line.startswith("    library: ")]
    assert plugins and all(lines[i + 1] == f"    cuda: {report['line']}" for i in plugins)


def test_driver_cuda_is_a_version_or_none():
    version = cli.driver_cuda()  # None where no NVIDIA driver is installed (a CPU machine)
    assert version is None or cli._major_minor(version) >= (1, 0)


# ------------------------------------------------------------------------------------------------
# what the README tells a first install
# ------------------------------------------------------------------------------------------------


def test_readme_install_section_says_build_time_progress_cmake_options_and_which_torch():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Installing into your own environment"):readme.index("## Example")]
    for words in ("about six on 2 CPU cores", "`pip install -v`", "`[step/total]`", "-Ccmake.define.NAME=VALUE",
                  "whatever torch (>= 2.11) is installed", "the one they were built against",
                  "`tree-recurrence[bench]`", "`cuda:` line"):
        assert words in section, words
    extras = (ROOT / "pyproject.toml").read_text()
    assert 'bench = ["transformers>=5.15", "tqdm", "matplotlib"]' in extras
