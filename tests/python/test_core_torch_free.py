"""The core is torch-free: no file of ``core/`` includes, directly or through the SDK
headers it uses (the plugin ABI: ``sdk/family.h``, ``abi.h``, ``fingerprint.h``), a torch, ATen or c10
header; and the SDK's kernel headers (``sdk/include/tree_recurrence/kernels/``), which the kernels'
``.cpp`` / ``.cu`` files and the POD-params contracts include, stay torch-free too."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE_DIRS = (ROOT / "core" / "include", ROOT / "sdk" / "include")
QUOTED = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
TORCH = re.compile(r'^\s*#\s*include\s+[<"](?:torch|ATen|c10)/[^>"]*[>"]', re.M)


def _closure(start: Path) -> dict[Path, list[str]]:
    """Every file ``start`` includes through quoted includes found in the project's include folders (or
    beside the including file), with the torch includes each one makes."""
    seen: dict[Path, list[str]] = {}
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        text = path.read_text(encoding="utf-8")
        seen[path] = [m.group(0).strip() for m in TORCH.finditer(text)]
        for name in QUOTED.findall(text):
            for folder in (path.parent, *INCLUDE_DIRS):
                if (folder / name).is_file():
                    todo.append((folder / name).resolve())
                    break
    return seen


def _torch_includes(files) -> list[str]:
    hits = []
    for start in (Path(f).resolve() for f in files):
        for path, includes in _closure(start).items():
            hits += [f"{start.relative_to(ROOT)} -> {path.relative_to(ROOT)}: {inc}" for inc in includes]
    return sorted(set(hits))


def test_core_includes_nothing_that_pulls_in_torch():
    files = [p for p in sorted((ROOT / "core").rglob("*")) if p.suffix in (".h", ".cpp")]
    assert files
    hits = _torch_includes(files)
    assert not hits, "core/ reaches torch headers:\n" + "\n".join(hits)


def test_the_sdk_kernel_headers_are_torch_free():
    files = sorted((ROOT / "sdk" / "include" / "tree_recurrence" / "kernels").glob("*.h"))
    assert files
    hits = _torch_includes(files)
    assert not hits, "SDK kernel headers reach torch headers:\n" + "\n".join(hits)


def test_the_grep_sees_a_torch_include(tmp_path):
    header = tmp_path / "a.h"
    header.write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text("#include <ATen/core/Tensor.h>\n")
    (closure,) = [includes for path, includes in _closure(header).items() if path.name == "b.h"]
    assert closure == ["#include <ATen/core/Tensor.h>"]
