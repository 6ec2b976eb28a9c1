"""The layout shows the architecture: the engine (bindings/) names no family; each family's knowledge
(manifest, kernels under csrc/, Python library stand-ins and component adapters under python/) lives in its
own folder. Family names, native op names, model types and mixer classes are read from every manifest
of the repository (plugins/*/family.yaml, sdk/examples/*/family.yaml)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted(REPO.glob("plugins/*/family.yaml")) + sorted(REPO.glob("sdk/examples/*/family.yaml"))
ENGINE = REPO / "bindings"


def _family_words() -> dict[str, str]:
    """word -> the manifest it comes from: family names, native ops, model types, mixer classes."""
    words: dict[str, str] = {}
    for path in MANIFESTS:
        manifest = yaml.safe_load(path.read_text())
        where = str(path.relative_to(REPO))
        words[manifest["family"]] = where
        for spec in (manifest.get("seams") or {}).values():
            op = (spec.get("native") or {}).get("op")
            if op:
                words[op] = where
        for entry in manifest["models"]:
            words[entry["model_type"]] = where
            for name in entry["mixers"] + entry.get("plan_carriers", []):
                words[name] = where
    return words


def test_manifests_are_found():
    assert len(MANIFESTS) >= 4, MANIFESTS  # the three in-tree families and the SDK example
    words = _family_words()
    assert {"gated_delta_net", "mamba2", "short_conv", "kimi_linear", "gdn_tree_scan"} <= set(words)


def test_engine_names_no_family():
    words = _family_words()
    # whole names: letters or digits may not continue them (short_convolution is a generic component)
    alternatives = "|".join(sorted((re.escape(w) for w in words), key=len, reverse=True))
    pattern = re.compile(f"(?<![A-Za-z0-9])(?:{alternatives})(?![A-Za-z0-9])", re.IGNORECASE)
    found = []
    for path in sorted(ENGINE.rglob("*")):
        if path.suffix not in (".py", ".cpp", ".h", ".txt", ".pyi") or "__pycache__" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                found.append(f"{path.relative_to(REPO)}:{number}: '{match.group(0)}' "
                             f"(from {words[next(w for w in words if w.lower() == match.group(0).lower())]})")
    assert not found, "the engine names families:\n" + "\n".join(found)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.parent.name)
def test_family_folder_holds_its_python_and_kernels(manifest):
    """Every module the manifest names under ``python:`` is a file of the family's python/ folder, every
    seam's library stand-in resolves to a module of the family or an importable one, and native kernels
    live under csrc/."""
    folder = manifest.parent
    spec = yaml.safe_load(manifest.read_text())
    modules = (spec.get("python") or {}).values()
    for module in modules:
        assert (folder / "python" / f"{module}.py").is_file(), (manifest, module)
    for seam, seam_spec in spec["seams"].items():
        library = seam_spec.get("library")
        if library:
            module = library["stand_in"].rpartition(".")[0]
            assert module in modules or module.startswith("tree_recurrence."), (seam, library)
    stray = [p.name for p in folder.glob("*") if p.suffix in (".cu", ".cuh") or p.name.endswith(("_scan.cpp", "_scan.h"))]
    assert not stray, f"kernels outside {folder.name}/csrc: {stray}"
    if spec["family"] != "short_conv":
        assert any((folder / "csrc").glob("*.cpp")), folder
