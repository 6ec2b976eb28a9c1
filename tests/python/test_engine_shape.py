"""The Python engine's shape: the driver's private names stay inside the driver (components,
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


# Where a manifest's seam mappings are read: parsed into SeamSpecs at load (plugins, _registered, _specs) and, for a
# record built elsewhere, by the native-op load check (_native_schema). Everything else reads SeamSpecs.
SEAM_PARSERS = {ENGINE / "tree_recurrence" / name for name in ("plugins.py", "_registered.py", "_specs.py",
                                                                  "_native_schema.py")}
MANIFEST_SEAMS = re.compile(r"""\]\s*\[\s*["']seams["']\s*\]|\.get\(\s*["']seams["']""")  # a manifest's ["seams"]
SPEC_AS_DICT = re.compile(r"""\bspec\s*\[\s*["']|\bspec\.get\(""")


def _engine_and_family_python():
    roots = [ENGINE, ROOT / "plugins", ROOT / "sdk" / "examples"]
    return [path for root in roots for path in sorted(root.rglob("*.py"))
            if "build" not in path.parts and (root == ENGINE or "python" in path.parts)]


def test_the_engine_reads_typed_seam_specs():
    """The driver, its strategies, components, install / seams and the families' adapters
    read a seam's ``SeamSpec`` / ``NativeSpec`` (``Family.seams``), not the manifest's mappings."""
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in _engine_and_family_python()
            if path not in SEAM_PARSERS
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if MANIFEST_SEAMS.search(line) or SPEC_AS_DICT.search(line)]
    assert not hits, "seam specs read as manifest mappings (read Family.seams / call.spec fields):\n" + "\n".join(hits)


def test_the_spec_grep_finds_what_it_looks_for():
    assert MANIFEST_SEAMS.search('record["manifest"]["seams"][seam]') and MANIFEST_SEAMS.search("m.get('seams')")
    assert not MANIFEST_SEAMS.search("report['seams']")
    assert SPEC_AS_DICT.search('call.spec["sequence"]') and SPEC_AS_DICT.search('spec.get("native")')
    assert not SPEC_AS_DICT.search("call.spec.sequence") and not SPEC_AS_DICT.search("spec.native.op")
