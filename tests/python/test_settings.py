"""The environment variables are declared once (sdk/include/tree_recurrence/sdk/settings.h), and only those
are read: the table's shape, a scan of the repository's sources for every TREE_RECURRENCE_* environment
access (each must be declared; no kernel file reads the environment; settings.h is the one C++ file that
calls getenv for these names and tree_recurrence/settings.py the one Python module of the package), the
doctor's listing, and the errors a bad value gives in both languages."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tree_recurrence import Policy, _core, settings

REPO = Path(__file__).resolve().parents[2]
SETTINGS_H = REPO / "sdk" / "include" / "tree_recurrence" / "sdk" / "settings.h"
ROOTS = ("core", "sdk", "plugins", "bindings", "examples", "benchmarks", "tests", "scripts")
SKIP_DIRS = {"__pycache__", ".git", "build", "results", "node_modules"}
C_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".cuh"}
NAME = re.compile(r"TREE_RECURRENCE_[A-Z0-9_]+")
FULL_NAME = re.compile(r"TREE_RECURRENCE_[A-Z0-9_]+\Z")


def sources():
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*")):
            if path.is_file() and not SKIP_DIRS.intersection(path.relative_to(REPO).parts):
                yield path


# --- the scan ----------------------------------------------------------------------------------------

C_ENV_CALL = re.compile(r"\b(secure_getenv|getenv|setenv|unsetenv|putenv)\s*\(\s*([^,)]*)")
SHELL_READ = re.compile(r"\$\{?(TREE_RECURRENCE_[A-Z0-9_]+)")
SHELL_SET = re.compile(r"(?<![\w.\-/])(TREE_RECURRENCE_[A-Z0-9_]+)=")
CMAKE_READ = re.compile(r"\$ENV\{(TREE_RECURRENCE_[A-Z0-9_]+)\}")
PY_ENV_FUNCS = {"getenv", "putenv", "unsetenv", "setenv", "delenv"}
PY_ENVIRON_METHODS = {"get", "pop", "setdefault"}


def strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def c_env_accesses(text: str):
    """(line, function, argument text) of each getenv / setenv / unsetenv / putenv call outside comments."""
    text = strip_c_comments(text)
    for m in C_ENV_CALL.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2).strip()


def shell_env_names(text: str):
    """(line, name) of each $TREE_RECURRENCE_X read and TREE_RECURRENCE_X=... assignment outside comments
    (a CMake definition such as -Ccmake.define.TREE_RECURRENCE_TESTS=ON is no environment variable)."""
    for number, line in enumerate(text.splitlines(), 1):
        code = line if not line.lstrip().startswith("#") else ""
        code = re.sub(r"(^|\s)#.*", "", code)
        for pattern in (SHELL_READ, SHELL_SET):
            for m in pattern.finditer(code):
                yield number, m.group(1)


def _constants(tree: ast.AST) -> dict[str, set[str]]:
    """NAME -> the TREE_RECURRENCE_* strings the value bound to NAME holds, for a module's assignments
    (NAME = "...", a tuple, a dict, ...) and for loop and comprehension targets (the strings of the
    sequence or of the constant they run over: a name bound to no such string resolves to none)."""
    out: dict[str, set[str]] = {}

    def strings(node):
        if isinstance(node, ast.Name) and node.id in out:
            return out[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # CONST.items(), .keys(), ...
            return strings(node.func.value)
        if isinstance(node, (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict)):
            return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    and FULL_NAME.match(n.value)}
        return None

    for node in [*ast.walk(tree), *ast.walk(tree)]:  # twice: a loop over a constant defined further down
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, (ast.For, ast.comprehension)):
            target, value = node.target, node.iter
        else:
            continue
        held = strings(value)
        for t in ast.walk(target):  # for k, v in ...: both names
            if isinstance(t, ast.Name) and held is not None:
                out.setdefault(t.id, set()).update(held)
    return out


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name) and node.id == "environ")


def python_env_names(text: str, global_constants: dict[str, set[str]]):
    """(line, name or None) of each environment access in Python source naming a TREE_RECURRENCE_* variable:
    os.getenv / os.putenv / monkeypatch.setenv / .delenv, os.environ.get / .pop / .setdefault / [...] / in,
    dict displays keyed by such a name and dict(..., TREE_RECURRENCE_X=...) (an environment for a child
    process). A key given by a name this scan cannot resolve yields None."""
    tree = ast.parse(text)
    local = _constants(tree)

    def resolve(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value} if FULL_NAME.match(node.value) else set()
        if isinstance(node, ast.Name) and node.id in local:
            return local[node.id]
        # another module's constant: plugins.DISABLE_ENV, or a NAME imported from it
        key = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        if key.isupper() and key in global_constants:
            return global_constants[key]
        return None

    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            environ_method = name in PY_ENVIRON_METHODS and isinstance(f, ast.Attribute) and _is_environ(f.value)
            if node.args and (name in PY_ENV_FUNCS or environ_method):
                keys.append(node.args[0])
            if name == "dict":
                keys += [ast.Constant(k.arg) for k in node.keywords if k.arg and FULL_NAME.match(k.arg)]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
        elif isinstance(node, ast.Dict):
            keys += [k for k in node.keys if isinstance(k, ast.Constant) and FULL_NAME.match(str(k.value))]
        for key in keys:
            names = resolve(key)
            if names is None:
                yield node.lineno, None
            for n in names or ():
                yield node.lineno, n


def _c_violation(rel: Path, func: str, arg: str) -> str | None:
    """Why this environment call may not be where it is, or None."""
    if rel.suffix in (".cu", ".cuh") or (rel.parts[0] == "plugins" and "csrc" in rel.parts):
        return f"{rel}: {func}({arg}) in a kernel file"
    literal = re.fullmatch(r'"([^"]*)"', arg)
    if "getenv" in func and rel != SETTINGS_H.relative_to(REPO) and not (literal and not NAME.match(literal.group(1))):
        return f"{rel}: {func}({arg}) outside settings.h (a TREE_RECURRENCE_* name, or a name not visible here)"
    return None


def scan():
    """(accesses, violations): accesses maps each TREE_RECURRENCE_* name the sources use as an environment
    variable to where; violations lists environment calls where none may be."""
    files = [p for p in sources() if p != Path(__file__).resolve()]
    python, trees, global_constants = {}, {}, {}
    for path in files:
        if path.suffix == ".py":
            python[path] = path.read_text(errors="replace")
            try:
                trees[path] = ast.parse(python[path])
            except SyntaxError:
                continue
            for k, v in _constants(trees[path]).items():
                global_constants.setdefault(k, set()).update(v)
    accesses: dict[str, list[str]] = {}
    violations: list[str] = []

    def found(name, path, line):
        accesses.setdefault(name, []).append(f"{path.relative_to(REPO)}:{line}")

    for path in files:
        rel = path.relative_to(REPO)
        if path.suffix in C_SUFFIXES:
            for line, func, arg in c_env_accesses(path.read_text(errors="replace")):
                literal = re.fullmatch(r'"([^"]*)"', arg)
                if literal and NAME.match(literal.group(1)):
                    found(literal.group(1), path, line)
                why = _c_violation(rel, func, arg)
                if why:
                    violations.append(why.replace(f"{rel}:", f"{rel}:{line}:", 1))
        elif path.suffix == ".sh":
            for line, name in shell_env_names(path.read_text(errors="replace")):
                found(name, path, line)
        elif path.name == "CMakeLists.txt" or path.suffix == ".cmake":
            for m in CMAKE_READ.finditer(path.read_text(errors="replace")):
                found(m.group(1), path, 0)
        elif path in python:
            package_module = rel.parts[:3] == ("bindings", "python", "tree_recurrence")
            try:
                hits = list(python_env_names(python[path], global_constants))
            except SyntaxError:
                hits = [(0, None)]
            for line, name in hits:
                if name is None:  # a key this scan cannot follow: every such name the file spells counts
                    for n in sorted(set(NAME.findall(python[path]))):
                        found(n, path, line)
                else:
                    found(name, path, line)
                if package_module and path.name != "settings.py":
                    violations.append(f"{rel}:{line}: reads {name or 'a TREE_RECURRENCE_* variable'} itself "
                                      "(the package reads them through tree_recurrence.settings)")
    return accesses, violations


# --- the table ---------------------------------------------------------------------------------------


def test_the_table_declares_at_most_ten_documented_variables():
    table = settings.declared()
    names = [s.name for s in table]
    assert 0 < len(table) <= 10, names
    assert len(set(names)) == len(names), names
    for s in table:
        assert FULL_NAME.match(s.name), s
        assert s.kind in ("flag", "count", "choice", "path", "path list", "names"), s
        assert len(s.doc) > 15 and "\n" not in s.doc, s
    assert "TREE_RECURRENCE_FUSED" in names  # the one kill switch of the fused kernels
    # the installed core carries the table the source declares
    header = SETTINGS_H.read_text()
    declared_in_source = re.findall(r'\{"(TREE_RECURRENCE_[A-Z0-9_]+)"', header[header.index("kAll[kCount]"):])
    assert declared_in_source == names


def test_every_environment_variable_the_sources_read_is_declared():
    accesses, violations = scan()
    undeclared = {name: where for name, where in sorted(accesses.items()) if name not in settings.names()}
    listing = "\n".join(f"  {name}: {', '.join(where[:6])}" for name, where in undeclared.items())
    assert not undeclared, f"environment variables read but not declared in settings.h:\n{listing}"
    assert not violations, "\n".join(violations)


def test_the_scan_sees_every_form_of_access():
    name = "TREE_RECURRENCE_" + "UNDECLARED"
    c = f'int a = f(std::getenv("{name}"));\n// getenv("{name}X") in a comment\n'
    assert list(c_env_accesses(c)) == [(1, "getenv", f'"{name}"')]
    assert _c_violation(Path("core/src/x.cpp"), "getenv", f'"{name}"')
    assert _c_violation(Path("core/src/x.cpp"), "getenv", "name")
    assert _c_violation(Path("core/src/x.cpp"), "getenv", '"HOME"') is None
    assert _c_violation(Path("tests/cpp/t.cpp"), "setenv", f'"{name}"') is None
    assert _c_violation(Path("sdk/kernels/k.cu"), "getenv", '"HOME"')
    assert _c_violation(Path("plugins/f/csrc/host.cpp"), "getenv", '"HOME"')
    sh = f'# ${name}X in a comment\nexport {name}=1\nX="${{{name}Y:-0}}" cmake -Ccmake.define.{name}Z=ON -D{name}W=1\n'
    assert [n for _, n in shell_env_names(sh)] == [name, name + "Y"]
    py = (f'import os\nK = "{name}A"\nos.environ.get(K)\nos.environ["{name}B"] = "1"\nos.getenv("{name}C")\n'
          f'for v in ("{name}D",):\n    monkeypatch.delenv(v)\nrun(env={{**os.environ, "{name}E": "1"}})\n'
          f'dict(os.environ, {name}F="1")\nassert "{name}G" not in os.environ\nmonkeypatch.setenv(plugins.OTHER, "0")\n'
          f'monkeypatch.setenv(switch, "0")\nprint("{name}H")\n')
    got = list(python_env_names(py, {"OTHER": {name + "I"}}))
    assert sorted(n for _, n in got if n) == [name + s for s in "ABCDEFGI"]
    assert [line for line, n in got if n is None] == [12]


# --- the doctor and the errors -----------------------------------------------------------------------


def test_doctor_lists_every_setting_with_its_value():
    env = {**os.environ, "TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS": "77", "TREE_RECURRENCE_LARGE_TESTS": "maybe"}
    env.pop("TREE_RECURRENCE_SSD_RECOMPUTE_Y", None)
    text = subprocess.run([sys.executable, "-m", "tree_recurrence", "doctor"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines() if line.strip().startswith("TREE_RECURRENCE_")}
    for s in settings.declared():
        assert s.name in lines, (s.name, text.stdout[-3000:])
        assert s.doc in lines[s.name] or "INVALID" in lines[s.name]
    assert " 77 " in lines["TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS"]
    assert "(default 0)" in lines["TREE_RECURRENCE_SSD_RECOMPUTE_Y"]
    assert "INVALID: TREE_RECURRENCE_LARGE_TESTS must be 1 or 0" in lines["TREE_RECURRENCE_LARGE_TESTS"]
    report = json.loads(subprocess.run([sys.executable, "-m", "tree_recurrence", "doctor", "--json"], capture_output=True,
                                       text=True, env=env, timeout=300).stdout)
    rows = {r["name"]: r for r in report["settings"]}
    assert set(rows) == set(settings.names())
    assert rows["TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS"]["value"] == 77
    assert rows["TREE_RECURRENCE_SSD_RECOMPUTE_Y"] == {**rows["TREE_RECURRENCE_SSD_RECOMPUTE_Y"], "set": False, "value": False}


def test_values_are_typed_and_read_at_each_call(monkeypatch):
    for name in settings.names():
        monkeypatch.delenv(name, raising=False)
    assert settings.get("TREE_RECURRENCE_FUSED") is True
    assert settings.get("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS") == 1024
    assert settings.get("TREE_RECURRENCE_STRATEGY") == "auto"
    assert settings.get("TREE_RECURRENCE_PLUGIN_PATH") == [] and settings.get("TREE_RECURRENCE_POLICY_FILE") == ""
    for text, value in (("0", False), ("off", False), ("No", False), ("1", True), (" TRUE ", True), ("on", True), ("", True)):
        monkeypatch.setenv("TREE_RECURRENCE_FUSED", text)
        assert settings.get("TREE_RECURRENCE_FUSED") is value, text
    monkeypatch.setenv("TREE_RECURRENCE_PLUGIN_PATH", os.pathsep.join(["/a b", "", "/c"]))
    assert settings.get("TREE_RECURRENCE_PLUGIN_PATH") == ["/a b", "/c"]
    monkeypatch.setenv("TREE_RECURRENCE_DISABLE_FAMILIES", " x, ,y")
    assert settings.get("TREE_RECURRENCE_DISABLE_FAMILIES") == ["x", "y"]
    assert settings.is_set("TREE_RECURRENCE_DISABLE_FAMILIES") and not settings.is_set("TREE_RECURRENCE_STRATEGY")


@pytest.mark.parametrize("name, bad, message", [
    ("TREE_RECURRENCE_FUSED", "maybe", "TREE_RECURRENCE_FUSED must be 1 or 0"),
    ("TREE_RECURRENCE_TEST_OPS", "2", "TREE_RECURRENCE_TEST_OPS must be 1 or 0"),
    ("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", "-5", "TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS must be a non-negative integer"),
    ("TREE_RECURRENCE_STRATEGY", "sideways", "TREE_RECURRENCE_STRATEGY must be one of auto, native, fork, rescan"),
])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, name, bad, message):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=message):
        settings.get(name)
    rows = {r["name"]: r for r in settings.all_settings()}
    assert rows[name]["value"] is None and message in rows[name]["error"]


def test_cpp_reads_through_the_same_parser(monkeypatch):
    """The core's own reads (Policy from the environment, C++ getenv through settings.h) give the same
    errors, raised through the binding."""
    for name in ("TREE_RECURRENCE_POLICY_FILE", "TREE_RECURRENCE_STRATEGY", "TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TREE_RECURRENCE_PREFER_NATIVE", "maybe")
    with pytest.raises(ValueError, match="TREE_RECURRENCE_PREFER_NATIVE must be 1 or 0"):
        _core.Policy.from_environment(_core.Policy())
    with pytest.raises(ValueError, match="TREE_RECURRENCE_PREFER_NATIVE must be 1 or 0"):
        Policy()
    monkeypatch.setenv("TREE_RECURRENCE_PREFER_NATIVE", "Off")
    assert _core.Policy.from_environment(_core.Policy()).prefer_native is False
    assert Policy().prefer_native is False and settings.get("TREE_RECURRENCE_PREFER_NATIVE") is False
    monkeypatch.setenv("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", "12x")
    with pytest.raises(ValueError, match="TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS must be a non-negative integer"):
        Policy()


def test_an_undeclared_name_is_a_clear_error():
    with pytest.raises(KeyError, match="TREE_RECURRENCE_NOT_A_SETTING is not a tree-recurrence setting"):
        settings.get("TREE_RECURRENCE_NOT_A_SETTING")
    with pytest.raises(KeyError, match="the settings are TREE_RECURRENCE_"):
        settings.raw("TREE_RECURRENCE_NOT_A_SETTING")
