"""The Python engine is layered and acyclic, read from its imports (``ast``, every import wherever it
stands, ``TYPE_CHECKING`` blocks included):

    plan  <-  registry  <-  driver  <-  top (seams, install, components, the CLI, integrations, sdk)

A module imports its own layer or lower ones, never a higher one; no import cycle; every import of the
package's own modules stands at the top of its file (none at the bottom, none inside a function to
dodge a cycle), except where an optional third-party package is the reason (``ALLOWED_LAZY``); no
module takes another's private (underscore) name. Family Python (``plugins/*/python``, the SDK
example's) imports only ``tree_recurrence.sdk`` of the package, besides torch, the standard library
and its own sibling modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python" / "tree_recurrence"
NAME = "tree_recurrence"

# Module (its first dotted part, relative to the package; "__init__" is the package itself) -> layer.
LAYERS = {
    "plan": ("_core", "_engine", "_plan", "_tree_kwargs", "_specs", "settings", "policy"),
    "registry": ("plugins", "_registered", "_shared_ops", "_native_schema"),
    "driver": ("driver", "_seam_call", "_scan_strategies", "_routes", "_peer_libraries", "_bound_kernels", "stand_ins"),
    "top": ("seams", "install", "components", "backends", "attention", "_detection", "tune", "bench", "_bench_output",
            "reference", "integrations", "sdk", "__main__", "__init__"),
}
ORDER = list(LAYERS)
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}

# (importing module, imported module): why that import waits for first use. Optional third-party
# packages only.
ALLOWED_LAZY = {
    ("integrations.trl", "integrations.trl_chains"): "trl_chains subclasses TRL's batchers: importing it imports trl",
}

FAMILY_PYTHON = sorted(ROOT.glob("plugins/*/python/*.py")) + sorted(ROOT.glob("sdk/examples/*/python/*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}
    found["_core"] = PACKAGE / "_core"  # the compiled core (no Python source)
    return found


MODULES = _modules()


def _package_of(module: str, path: Path) -> list[str]:
    """The package ``module`` lives in, as dotted parts ([] for the top package)."""
    parts = module.split(".") if module != "__init__" else []
    return parts if path.name == "__init__.py" else parts[:-1]


def _target(parts: list[str]) -> str:
    """The own module that dotted ``parts`` (relative to the package) name: the longest prefix that is one."""
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in MODULES:
            return name
    return "__init__"


def _own_imports(module: str, path: Path):
    """(imported own module, the import node, the names it takes) for every import of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == NAME:
                    yield _target(parts[1:]), node, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path)
                base = base[: len(base) - (node.level - 1)]
            elif (node.module or "").split(".")[0] == NAME:
                base = []
            else:
                continue
            parts = base + [p for p in (node.module or "").split(".") if p and p != NAME]
            for alias in node.names:
                sub = parts + [alias.name]
                if ".".join(sub) in MODULES:
                    yield ".".join(sub), node, ()
                else:
                    yield _target(parts), node, (alias.name,)


def _graph() -> dict[str, set[str]]:
    return {module: {target for target, _, _ in _own_imports(module, path)} - {module}
            for module, path in MODULES.items() if path.suffix == ".py"}


def _layer(module: str) -> str:
    return LAYER_OF[module.split(".")[0]]


def test_every_engine_module_has_a_layer():
    missing = sorted(m for m in MODULES if m.split(".")[0] not in LAYER_OF)
    assert not missing, f"engine modules in no layer (add them to LAYERS): {missing}"


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, targets in _graph().items() for t in sorted(targets)
           if ORDER.index(_layer(t)) > ORDER.index(_layer(m))]
    assert not bad, "imports against the layers plan <- registry <- driver <- top:\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_engine_has_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _top_of_file(path: Path) -> set[tuple[int, int]]:
    """Positions of the import statements that open the file (after its docstring), before any other statement."""
    opening = set()
    for index, node in enumerate(ast.parse(path.read_text(encoding="utf-8")).body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        opening.add((node.lineno, node.col_offset))
    return opening


def test_own_imports_stand_at_the_top_of_the_file():
    bad = []
    for module, path in MODULES.items():
        if path.suffix != ".py":
            continue
        top = _top_of_file(path)
        for target, node, _ in _own_imports(module, path):
            if (node.lineno, node.col_offset) not in top and (module, target) not in ALLOWED_LAZY:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}")
    assert not bad, ("imports of the package's own modules inside a function, a block or below code (import them at "
                     "the top; a cycle is fixed by moving code to the lower module):\n" + "\n".join(sorted(set(bad))))


def test_no_module_takes_another_modules_private_name():
    bad = []
    for module, path in MODULES.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()
        for target, node, names in _own_imports(module, path):
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} from {target}")
            if not names and isinstance(node, ast.ImportFrom):
                aliases |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names taken across modules (make them public where they live):\n" + "\n".join(bad)


def _absolute_imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if node.module == NAME:
                for alias in node.names:
                    yield node.lineno, f"{NAME}.{alias.name}"
            else:
                yield node.lineno, node.module


def test_family_python_is_found():
    assert len(FAMILY_PYTHON) >= 6 and any(p.name == "adapters.py" for p in FAMILY_PYTHON), FAMILY_PYTHON


@pytest.mark.parametrize("path", FAMILY_PYTHON, ids=lambda p: str(p.relative_to(ROOT)))
def test_family_python_imports_only_the_sdk(path):
    bad = []
    for line, name in _absolute_imports(path):
        top = name.split(".")[0]
        if top == NAME:
            if name != f"{NAME}.sdk" and not name.startswith(f"{NAME}.sdk."):
                bad.append(f"{line}: {name}")
        elif top not in ("torch", "__future__") and top not in sys.stdlib_module_names:
            bad.append(f"{line}: {name}")
    assert not bad, f"{path.relative_to(ROOT)} imports more than tree_recurrence.sdk, torch and the standard library: {bad}"


def test_the_driver_runs_exactly_the_adapters_the_spec_parser_accepts():
    from tree_recurrence import driver
    from tree_recurrence._specs import KNOWN_ADAPTERS

    assert tuple(driver.ADAPTERS) == KNOWN_ADAPTERS


def test_every_sdk_name_is_documented():
    from tree_recurrence import sdk

    assert sdk.__all__ == [n for n in sdk.__all__ if hasattr(sdk, n)]
    undocumented = [n for n in sdk.__all__ if not (getattr(sdk, n).__doc__ or "").strip()]
    assert not undocumented, f"tree_recurrence.sdk names without a docstring: {undocumented}"
    missing = [n for n in sdk.__all__ if f"``{n}" not in sdk.__doc__]
    assert not missing, f"tree_recurrence.sdk's docstring does not list: {missing}"
