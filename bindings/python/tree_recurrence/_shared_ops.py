"""The shared ops library: ``libtree_recurrence_ops.so`` (sdk/ops/, sdk/include/tree_recurrence/sdk/shared_ops.h),
installed in the package as ``tree_recurrence/sdk/lib/libtree_recurrence_ops.so``.

It registers the torch ops several families share ONCE, in the namespace ``tree_recurrence``:
``torch.ops.tree_recurrence.tree_conv`` / ``.tree_conv_backward`` and ``.chunk_state_pass`` /
``.chunk_state_pass_backward``, with their CPU, CUDA, Meta and Autograd kernels. The package loads it before any
plugin (``plugins`` calls ``load`` when imported and before every scan); plugins link it (DT_NEEDED, found already
loaded) and call its C++ functions. A family lists the shared ops it offers among its kernels (``tree_conv``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._engine import ENGINE

NAMESPACE = "tree_recurrence"
LIBRARY_NAME = "libtree_recurrence_ops.so"
LIBRARY_PATH = Path(__file__).resolve().parent / "sdk" / "lib" / LIBRARY_NAME

_state: dict[str, str | None] = ENGINE.shared_ops  # "error": None once loaded, the reason when it could not be


def load() -> str | None:
    """Loads the library once (``torch.ops.load_library``); returns None, or why it could not be loaded."""
    if "error" not in _state:
        try:
            if not LIBRARY_PATH.is_file():
                raise OSError(f"{LIBRARY_PATH} is missing: reinstall tree-recurrence")
            torch.ops.load_library(str(LIBRARY_PATH))
            _state["error"] = None
        except (OSError, RuntimeError) as error:
            _state["error"] = f"the shared ops library {LIBRARY_NAME} could not be loaded: {error}"[:2000]
    return _state["error"]


def ops():
    """``torch.ops.tree_recurrence``, the shared ops (loading the library first; RuntimeError when it cannot be)."""
    error = load()
    if error:
        raise RuntimeError(error)
    return getattr(torch.ops, NAMESPACE)
