"""The kernel a seam is bound to, as the router keys its measurements: the package it comes from, that
package's version, and which of the package's backends would run the call (FLA hands its gated delta
rule to FlashQLA where it can: FLA on Triton is not FLA on FlashQLA). Also whether the bound
kernel's backward can run here (``backward_problem``), and whether a requirement (a module, or a
package at a version) is installed."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True)
class KernelId:
    """A bound kernel as measurements are keyed: top-level package, its version ("" when unknown), the
    backend the package runs the call on ("" for a package with one)."""

    package: str
    version: str = ""
    backend: str = ""

    def describe(self) -> str:
        text = self.package or "no bound kernel"
        text += f" {self.version}" if self.version else ""
        return text + (f" on {self.backend}" if self.backend else "")

    def as_dict(self) -> dict:
        return {"package": self.package, "version": self.version, "backend": self.backend}


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
        return _version_tuple(importlib.metadata.version(name)) >= _version_tuple(version)
    except Exception:  # noqa: BLE001 -- a package without metadata: its version is unknown
        return False


def bound_library(implementation: Any) -> str:
    """The top-level package the bound implementation comes from ("" when unknown)."""
    module = getattr(implementation, "__module__", None) or ""
    return module.split(".")[0]


@functools.lru_cache(maxsize=None)
def _distributions() -> Mapping[str, list]:
    return importlib.metadata.packages_distributions()


@functools.lru_cache(maxsize=None)
def library_version(package: str) -> str:
    """The installed version of top-level ``package`` (its module's ``__version__`` where imported, else
    its distribution's metadata: FLA's ``fla`` is the ``flash-linear-attention`` distribution), "" when
    unknown. Once per process."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version:
        return version
    for distribution in _distributions().get(package, []):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fla_backend(dtype: torch.dtype | None, dims: Mapping[str, int] | None) -> str:
    """The backend FLA's dispatch (fla/backends) hands a gated delta rule call to: ``flash_qla`` when that
    package imports, neither FLA_DISABLE_BACKEND_DISPATCH=1 nor FLA_FLASH_QLA=0 is set (read as FLA reads
    them), and the call is one FlashQLA takes (bf16 / fp16, key and value head dims 128; unknown facts
    count as taken); else ``triton`` (FLA's own kernels)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1" or os.environ.get("FLA_FLASH_QLA", "1") == "0":
        return "triton"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return "triton"
    if dims and any(dims.get(name, 128) != 128 for name in ("key", "value")):
        return "triton"
    return "flash_qla" if _importable("flash_qla") else "triton"


# Package -> which of its backends runs a call of (dtype, {argument: last dim}); a package missing here has one.
BACKEND_PROBES: dict[str, Callable[[torch.dtype | None, Mapping[str, int] | None], str]] = {"fla": _fla_backend}


def bound_backend(library: str, dtype: torch.dtype | None = None, dims: Mapping[str, int] | None = None) -> str:
    """The backend package ``library`` would run a call on ("" for a package with one backend)."""
    probe = BACKEND_PROBES.get(library)
    return probe(dtype, dims) if probe is not None else ""


def kernel_id(package: str, dtype: torch.dtype | None = None, dims: Mapping[str, int] | None = None) -> KernelId:
    return KernelId(package, library_version(package) if package else "", bound_backend(package, dtype, dims))


def _fla_backward(backend: str, device: torch.device | None) -> str | None:
    """FLA's gated delta rule backward on Hopper runs through tilelang or Triton >= 3.7.1 (its own guard
    refuses otherwise); FlashQLA brings its own backward."""
    if backend != "triton" or device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    needs = ("tilelang", "triton>=3.7.1")
    return None if any(requirement_met(n) for n in needs) else f"fla's backward on Hopper needs one of {list(needs)}"


# Package -> why its backward cannot run on (backend, device), or None.
BACKWARD_PROBES: dict[str, Callable[[str, torch.device | None], str | None]] = {"fla": _fla_backward}


def backward_problem(kernel: KernelId, device: torch.device | None) -> str | None:
    """Why the bound kernel's backward cannot run on ``device`` (None: it can, as far as is known)."""
    probe = BACKWARD_PROBES.get(kernel.package)
    return probe(kernel.backend, device) if probe is not None else None
