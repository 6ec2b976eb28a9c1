"""The Python engine's shape (issue 18): the driver's private names stay inside the driver (components,
family adapters, integrations, benchmarks and tests use its public seam-call API), and its files stay
small, one concern each."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "bindings" / "python"
# The driver and the private modules it is made of.
DRIVER = {ENGINE / "tree_recurrence" / name for name in ("driver.py", "_scan_strategies.py", "_bound_kernels.py")}
SOURCES = ("bindings", "plugins", "sdk", "tests", "benchmarks", "examples")
PRIVATE_DRIVER_NAME = re.compile(r"\bdriver\s*\.\s*_[A-Za-z]\w*|from\s+\S*driver\s+import\s+[^\n]*\b_[A-Za-z]")


def _python_files():
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" not in path.parts and "build" not in path.parts and path.resolve() != Path(__file__).resolve():
                yield path


def test_no_module_outside_the_driver_calls_a_private_driver_name():
    hits = []
    for path in _python_files():
        if path in DRIVER:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PRIVATE_DRIVER_NAME.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "private driver names used outside the driver (use its public API):\n" + "\n".join(hits)


def test_the_grep_finds_what_it_looks_for():
    assert PRIVATE_DRIVER_NAME.search("driver._record(call, 'x', 'y')")
    assert PRIVATE_DRIVER_NAME.search("from tree_recurrence.driver import SeamCall, _check_row")
    assert not PRIVATE_DRIVER_NAME.search("call.record('x', 'y'); driver.decide_route(call, b, p, d)")


MAX_LINES = 400


def test_no_file_of_the_python_engine_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in sorted(ENGINE.rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files of bindings/python over {MAX_LINES} lines (split them by concern): {long}"


def test_the_activation_check_is_written_once():
    """The engine's conv activation check is driver.check_activation; the library stand-ins (stand_ins.py
    files) keep the libraries' own exceptions and messages."""
    pattern = re.compile(r"activation\s+not\s+in\s+\(None,\s*\"silu\",\s*\"swish\"\)")
    hits = [f"{path.relative_to(ROOT)}:{number}" for path in _python_files()
            if path.parts[len(ROOT.parts)] in ("bindings", "plugins") and path.name != "stand_ins.py"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, f"activation checks outside driver.check_activation: {hits}"
