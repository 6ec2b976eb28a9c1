"""The native ops' argument errors raise with their numbers and sizes in the message, formatted without
iostreams (sdk/include/tree_recurrence/sdk/check.h: on the GPU machine's build, messages that put a number
through c10::str's ostream crashed the process instead of raising). CPU:
the texts must read as c10::str would have written them."""

from __future__ import annotations

import pytest
import torch

from tree_recurrence import plugins
from test_ssd_chunked import chunk_tables

SEG, PAR = [0, 5, 9, 12], [-1, 0, 0]


def _ssd_call(A, x=None):
    ops = plugins.ops("mamba2")
    tabs = chunk_tables(SEG, PAR, 64, "cpu")
    n, H, P, G, N = SEG[-1], 4, 8, 2, 16
    x = torch.randn(n, H, P) if x is None else x
    return ops.ssd_tree_scan(x, torch.randn(n, H), torch.randn(n, G, N), torch.randn(n, G, N), tabs["gather"],
                             tabs["scatter"], tabs["seg_chunk_offsets"], tabs["parents"], tabs["root_index"],
                             tabs["level_segments"], tabs["level_offsets"], tabs["child_offsets"], tabs["children"],
                             None, A=A, dt_limit=[0.0, float("inf")], D=None, dt_bias=None, dt_softplus=True, z=None)


def test_integer_and_sizes_in_a_value_error():
    with pytest.raises(ValueError, match=r"^ssd_tree_scan: A must be \(heads=4\), got \[3\]"):
        _ssd_call(torch.zeros(3))


def test_sizes_of_several_dims():
    with pytest.raises(ValueError, match=r"x must be \(tokens, heads, head_dim\), got \[12, 4\]"):
        _ssd_call(torch.zeros(4), x=torch.randn(12, 4))


def test_dtype_in_a_type_error():
    with pytest.raises(TypeError, match=r"x has dtype Long, expected"):
        _ssd_call(torch.zeros(4), x=torch.zeros(SEG[-1], 4, 8, dtype=torch.long))


def test_no_torch_check_left_in_our_cpp():
    # every check of ours goes through TR_CHECK*: a TORCH_CHECK with a number would bring the crash back
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    pat = re.compile(r"\bTORCH_(CHECK\w*|WARN\w*)\(")
    bad = []
    for sub in ("core", "sdk", "plugins", "bindings/src"):
        for f in (root / sub).rglob("*"):
            if f.suffix in (".cpp", ".h", ".cu", ".cuh") and f.name != "check.h":
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if pat.search(line) and "message::str(" not in line and "TORCH_WARN_ONCE(::" not in line:
                        bad.append(f"{f.relative_to(root)}:{i}")
    assert not bad, f"TORCH_CHECK / TORCH_WARN with c10::str formatting (use TR_CHECK*, sdk/check.h): {bad}"
