"""Which peer library a seam's bound kernel comes from, which of that library's backends a call would run
on, and whether a requirement (a module, or a package at a version) is installed: what the measured
routes (``_routes.py``) compare a call against."""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any, Callable


def _version_tuple(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:4])


def requirement_met(need: str) -> bool:
    """``module`` importable, or ``package>=version`` installed at that version or later."""
    name, _, version = need.partition(">=")
    try:
        if importlib.util.find_spec(name) is None:
            return False
    except (ImportError, ValueError):
        return False
    if not version:
        return True
    try:
        from importlib.metadata import version as installed

        return _version_tuple(installed(name)) >= _version_tuple(version)
    except Exception:  # noqa: BLE001 -- a package without metadata: its version is unknown
        return False


def bound_library(implementation: Any) -> str:
    """The top-level package the bound implementation comes from ("" when unknown)."""
    module = getattr(implementation, "__module__", None) or ""
    return module.split(".")[0]


def _fla_backend() -> str:
    """The backend FLA's dispatch (fla/backends.py) hands a GDN call to that FlashQLA accepts (bf16 / fp16,
    K = V = 128 on SM90 / SM100): ``flash_qla`` when the package is installed and neither
    FLA_DISABLE_BACKEND_DISPATCH=1 nor FLA_FLASH_QLA=0 is set (both read as FLA reads them), else
    ``triton`` (FLA's own kernels, its Hopper backward through tilelang)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return "triton"
    if os.environ.get("FLA_FLASH_QLA", "1") == "0":
        return "triton"
    try:
        return "flash_qla" if importlib.util.find_spec("flash_qla") is not None else "triton"
    except (ImportError, ValueError):
        return "triton"


# Peer library -> which of its backends a call would run on (a library missing here has one backend: "").
BACKEND_PROBES: dict[str, Callable[[], str]] = {"fla": _fla_backend}


def bound_backend(library: str) -> str:
    """The backend the peer ``library`` would run a call on ("" for a library with one backend)."""
    probe = BACKEND_PROBES.get(library)
    return probe() if probe is not None else ""
