"""Hardening: plan memory safety and resource bounds, the fresh-machine set-up and the probes kept
in the test command. Fuzzing is in test_plan_fuzz.py, hostile plugin folders in
test_hostile_plugins.py."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tree_recurrence import _core
from tree_recurrence._tree_kwargs import tree_plan

REPO = Path(__file__).resolve().parents[2]


def fan_plan():
    cu = torch.tensor([0, 3, 5, 8, 9])
    parents = torch.tensor([-1, 0, 0, 2])
    return tree_plan({"tree_cu_seqlens_q": cu, "tree_segment_parents": parents})


# ------------------------------------------------------------------------------------------------
# plans
# ------------------------------------------------------------------------------------------------


def test_writing_plan_arrays_never_changes_the_plan():
    plan, fresh = fan_plan(), fan_plan()
    expected = fresh.conv_tables(4)
    plan.array("seg_lengths").add_(1000)  # was a heap-buffer-overflow write in conv_ancestors
    plan.array("seg_offsets").fill_(-5)
    plan.array("parents").zero_()
    assert plan.array("seg_lengths").tolist() == [3, 2, 3, 1]
    assert plan.array("parents").tolist() == [-1, 0, 0, 2]
    for got, want in zip(plan.conv_tables(4), expected):
        assert torch.equal(got, want)
    # cached tables handed to kernels are rebuilt when written in place
    plan.conv_tables(4)[0].fill_(7)
    plan.tensor("parents").fill_(3)
    assert torch.equal(plan.conv_tables(4)[0], expected[0])
    assert plan.tensor("parents").tolist() == [-1, 0, 0, 2]
    for name in _core.TreePlan.array_names():
        assert torch.equal(plan.array(name), fresh.array(name)), name


@pytest.mark.parametrize("last", [2**40, 2**62, 2**31])
def test_a_tiny_input_naming_a_huge_row_is_refused_at_once(last):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"tree_cu_seqlens_q: ends at {last}: a row holds at most 2147483647 tokens"):
        tree_plan({"tree_cu_seqlens_q": torch.tensor([0, last]), "tree_segment_parents": torch.tensor([-1])})
    assert time.perf_counter() - start < 0.5


def test_an_unheld_big_row_is_planned_without_per_token_memory():
    start = time.perf_counter()
    plan = tree_plan({"tree_cu_seqlens_q": torch.tensor([0, 2**28]), "tree_segment_parents": torch.tensor([-1])})
    assert time.perf_counter() - start < 0.5  # was 11 s and 2.5 GB
    assert plan.num_tokens == 2**28 and plan.num_leaves == 1
    with pytest.raises(ValueError, match="tree_cu_seqlens_q: ends at 268435456 but the row has 8 tokens"):
        tree_plan({"tree_cu_seqlens_q": torch.tensor([0, 2**28]), "tree_segment_parents": torch.tensor([-1])}, num_tokens=8)


def test_the_model_refuses_tree_kwargs_of_another_row():
    sys.path.insert(0, str(Path(__file__).parent))
    import models as M
    import tree_recurrence as tr

    model = M.make_model("qwen3_5_text")
    tr.install(model)
    try:
        tree = M.pack_forest("fan")
        for bad in ("huge", "other"):
            kwargs = tree.trl_kwargs()
            if bad == "huge":  # was a multi-GB per-token allocation before any check
                kwargs["tree_cu_seqlens_q"] = kwargs["tree_cu_seqlens_q"].clone()
                kwargs["tree_cu_seqlens_q"][-1] = 2**30
            else:  # a valid tree of another row
                kwargs = M.pack_forest("tiny").trl_kwargs()
            start = time.perf_counter()
            with pytest.raises(ValueError, match="tree_|tokens"):
                model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **kwargs)
            assert time.perf_counter() - start < 5
    finally:
        tr.uninstall(model)


def test_row_length_reads_the_row_a_carrier_received():
    from tree_recurrence._tree_kwargs import row_length

    assert row_length({"input_ids": torch.zeros(1, 9, dtype=torch.long)}) == 9
    assert row_length({"inputs_embeds": torch.zeros(1, 7, 4)}) == 7
    assert row_length({"input_ids": torch.zeros(2, 9, dtype=torch.long)}) is None
    assert row_length({}) is None
    cu = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="tree_cu_seqlens_q: ends at 5 but the row has 9 tokens"):
        tree_plan({"tree_cu_seqlens_q": cu, "tree_segment_parents": torch.tensor([-1, 0])}, num_tokens=9)


def test_a_plan_carrier_refuses_tree_kwargs_longer_than_its_row():
    """Mamba2ForCausalLM carries the plan (its backbone drops the kwargs): it sees input_ids, so a
    tree longer than the row is refused there, naming both lengths; a longer (padded) row is not."""
    import tree_recurrence as tr

    sys.path.insert(0, str(Path(__file__).parent))
    import models as M

    from test_mamba2_models import make_model as make_mamba

    model = make_mamba("mamba2")
    tr.install(model)
    try:
        tree = M.pack_forest("tiny")
        short = tree.input_ids[:, : tree.num_tokens - 1]
        with pytest.raises(ValueError, match=rf"ends at {tree.num_tokens} but the row .* has only {tree.num_tokens - 1} tokens"):
            model(input_ids=short, use_cache=False, **tree.trl_kwargs())
    finally:
        tr.uninstall(model)


def test_the_core_never_takes_an_address():
    build = _core.TreePlan.build
    with pytest.raises(TypeError):
        build((12345678, 4), None, None, None, None, -1)  # the old (pointer, length) form
    with pytest.raises(TypeError):
        build(12345678, None, None, None, None, -1)
    import array

    with pytest.raises(TypeError, match="tree_cu_seqlens_q: expected a buffer of int64 values"):
        build(array.array("i", [0, 2, 4]), None, None, None, None, -1)
    with pytest.raises(TypeError, match="tree_segment_parents: expected a buffer of int64 values"):
        build(array.array("q", [0, 2, 4]), None, None, array.array("d", [-1.0, 0.0]), None, -1)
    plan = build(array.array("q", [0, 2, 4]), None, None, array.array("q", [-1, 0]), None, -1)
    assert plan.num_tokens == 4 and plan.num_leaves == 1
    assert isinstance(plan.array("parents"), bytearray)  # a copy, not a view of the plan


# ------------------------------------------------------------------------------------------------
# fresh machine
# ------------------------------------------------------------------------------------------------


def _requirements() -> set[str]:
    names = set()
    for line in (REPO / "scripts" / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!\[ ]", line)[0].lower().replace("_", "-"))
    return names


def _imports(folder: Path) -> set[str]:
    """Top-level modules imported by the .py files of a folder (imports guarded by an ImportError
    handler are optional and left out)."""
    found = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        optional = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError", "Exception")
                    for h in node.handlers):
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def _with_dependencies(names: set[str]) -> set[str]:
    """The distributions in ``names`` and everything they require (extras left out), as installed."""
    from importlib import metadata

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            if "extra ==" in spec:
                continue
            todo.append(re.split(r"[<>=!~\[ ;(]", spec.strip())[0].lower().replace("_", "-"))
    return seen


def test_requirements_cover_every_third_party_import_of_tests_examples_and_benchmarks():
    from importlib import metadata

    local = {p.stem for folder in ("tests/python", "examples", "benchmarks") for p in (REPO / folder).rglob("*.py")}
    local |= {"tree_recurrence", "__future__"}
    required = _requirements()
    assert {"requests", "tqdm", "matplotlib", "pytest", "pyyaml", "torch", "transformers", "trl", "numpy"} <= required
    installed_by_setup = _with_dependencies(required)
    providers = metadata.packages_distributions()
    missing = []
    for folder in ("tests/python", "examples", "benchmarks"):
        for module in sorted(_imports(REPO / folder) - local - set(sys.stdlib_module_names)):
            dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
            if not dists & installed_by_setup:
                missing.append(f"{folder}: {module} ({', '.join(sorted(dists))})")
    assert not missing, f"imported but not installed by scripts/requirements.txt: {missing}"
    extra = re.search(r"^test = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M).group(1)
    for name in ("requests", "tqdm", "matplotlib"):
        assert f'"{name}"' in extra


def test_ci_starts_from_an_empty_virtual_environment():
    text = (REPO / ".ci" / "run").read_text()
    assert "rm -rf .ci/venv" in text and "export VENV_DIR=.ci/venv" in text and "unset PYTHON" in text
    assert text.index("rm -rf .ci/venv") < text.index("bash scripts/test.sh")


def _env_script(folder: Path) -> Path:
    (folder / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "python-env.sh", folder / "scripts" / "python-env.sh")
    return folder


def test_python_env_makes_a_project_venv_unless_python_is_given(tmp_path):
    clone = _env_script(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "VENV_DIR")}
    done = subprocess.run(["bash", "-c", "source scripts/python-env.sh && echo \"PY=$PY\""], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"PY={clone}/.venv/bin/python" in done.stdout
    assert (clone / ".venv" / "bin" / "python").exists()
    done = subprocess.run(["bash", "-c", "source scripts/python-env.sh && echo \"PY=$PY\""], cwd=clone,
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert f"PY={sys.executable}" in done.stdout
    done = subprocess.run(["bash", "-c", "source scripts/python-env.sh && echo \"PY=$PY\""], cwd=clone,
                          env={**env, "VENV_DIR": ".ci/venv"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"PY={clone}/.ci/venv/bin/python" in done.stdout


def test_every_script_uses_the_chosen_interpreter():
    for name in ("setup.sh", "test.sh", "demo.sh", "dev-install.sh"):
        text = (REPO / "scripts" / name).read_text()
        assert "source scripts/python-env.sh" in text, name
        code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        assert not any(re.search(r"(^|\s)python3? ", line) for line in code), (name, "bare python on PATH")


def test_setup_stops_with_pips_own_message(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ERROR: fake pip failure 4242 (no matching distribution)' >&2\nexit 3\n")
    fake.chmod(0o755)
    text = (REPO / "scripts" / "setup.sh").read_text()
    assert "|| true" not in text and "grep -v" not in text
    if shutil.which("dpkg") is None or subprocess.run(["bash", "-c", "dpkg -s g++ cmake ninja-build libyaml-cpp-dev "
                                                       "doctest-dev python3-venv"], capture_output=True).returncode:
        pytest.skip("set-up would install Debian packages first")
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env={**os.environ, "PYTHON": str(fake)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert "fake pip failure 4242" in done.stderr
    assert "build and install" not in done.stdout


def test_isolated_builds_are_refused_at_once_in_one_line():
    code = textwrap.dedent(f"""\
        import sys
        sys.modules["torch"] = None  # as in pip's build isolation: torch is not importable
        sys.path.insert(0, {str(REPO / "scripts")!r})
        import build_backend
        try:
            build_backend.get_requires_for_build_wheel()
        except SystemExit as e:
            print(e.code)
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if "No module named 'scikit_build_core'" in done.stderr:
        pytest.skip("scikit-build-core is not installed here")
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-build-isolation ." in lines[0] and "torch" in lines[0], done
    assert 'build-backend = "build_backend"' in (REPO / "pyproject.toml").read_text()
    readme = (REPO / "README.md").read_text()
    assert "--no-build-isolation" in readme and "build isolation" in readme


def test_progress_is_shown_and_demo_warnings_are_handled():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pip_line = next(line for line in setup.splitlines() if "pip install -r" in line and not line.startswith("echo"))
    assert " -q" not in pip_line
    assert "--verbose-build" in setup
    assert "TRL_EXPERIMENTAL_SILENCE=1" in (REPO / "scripts" / "demo.sh").read_text()
    assert "tree_recurrence.stand_ins replace FLA" in (REPO / "README.md").read_text()  # what the demo prints


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(), reason="no nvcc here")
def test_cuda_off_configures_where_nvcc_exists(tmp_path):
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    done = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"), *generator, "-DTREE_RECURRENCE_CUDA=OFF",
                           "-DTREE_RECURRENCE_TESTS=OFF", f"-DPython_EXECUTABLE={sys.executable}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": "/usr/local/cuda/bin:" + os.environ["PATH"]})
    assert done.returncode == 0, done.stderr[-3000:]
    cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    assert "TREE_RECURRENCE_CUDA:STRING=OFF" in cache
    assert not list((tmp_path / "build").rglob("*.cu.o"))


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout")
    return set(out.stdout.splitlines())


def test_readme_and_docs_link_only_what_ships():
    tracked = _tracked()
    folders = {str(Path(f).parent) for f in tracked} | {str(p) for f in tracked for p in Path(f).parents}
    bad = []
    for doc in ["README.md", *sorted(f for f in tracked if f.startswith("docs/") and f.endswith(".md"))]:
        text = (REPO / doc).read_text()
        if "shared/" in text and doc == "README.md":
            bad.append(f"{doc}: mentions shared/")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
            if path not in tracked and path not in folders:
                bad.append(f"{doc}: {target}")
    assert not bad, f"links to files that are not in the repository: {bad}"


def test_the_build_lock_lives_in_the_build_folder():
    for name in ("setup.sh", "dev-install.sh"):
        text = (REPO / "scripts" / name).read_text()
        assert "/tmp/" not in text, name
    assert "flock build/py/.install.lock" in (REPO / "scripts" / "dev-install.sh").read_text()


# ------------------------------------------------------------------------------------------------
# the sanitizer job is part of the test command
# ------------------------------------------------------------------------------------------------


def test_the_test_command_runs_the_sanitizer_job():
    test = (REPO / "scripts" / "test.sh").read_text()
    assert "bash scripts/asan.sh" in test
    cmake = (REPO / "tests" / "cpp" / "asan" / "CMakeLists.txt").read_text()
    assert "-fsanitize=address,undefined" in cmake
    for suite in ("test_tree_plan.cpp", "test_registry.cpp", "test_policy.cpp", "test_tree_conv.cpp"):
        assert suite in cmake
    asan = (REPO / "scripts" / "asan.sh").read_text()
    assert "build/asan/core_tests" in asan and "build/asan/kernel_tests" in asan
