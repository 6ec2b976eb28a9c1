"""Mamba2's component adapter: ``ssd_scan``, the SSD scan over a tree-packed row for models that follow
trees in their own code (``tree_recurrence.components.ssd_scan`` while this family is loaded). A thin
front over the generic ``sdk.scan`` with this family's seam."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from tree_recurrence import sdk

__all__ = ["ssd_scan"]


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, plan=None, *,
             chunk_size: int = 256, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf), z: torch.Tensor | None = None,
             initial_state: torch.Tensor | None = None, kernel: Callable | None = None, backend: str = "auto",
             policy=None) -> torch.Tensor:
    """Mamba2 SSD scan over a tree-packed row. x (1, N, H, P); dt (1, N, H) raw; A (H); B, C (1, N, G, S).
    Returns y (1, N, H, P).

    Native: this family's ``ssd_tree_scan``; else rescan over ``kernel``, a function with mamba-ssm's
    ``mamba_chunk_scan_combined`` API (default: this family's stand-in). SSD padding cannot leave the
    state alone, so there is no fork over a kernel."""
    extra: dict[str, Any] = {"chunk_size": chunk_size, "D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus,
                             "dt_limit": tuple(dt_limit), "z": z}
    if initial_state is not None:
        extra["initial_states"] = initial_state
    return sdk.scan("mamba2", "mamba2_chunk_scan", x, dt, A, B, C, plan=plan, kernel=kernel, backend=backend,
                    policy=policy, **extra)
