"""Gated DeltaNet's component adapter: ``gdn_scan``, the gated delta rule over a tree-packed row for
models that follow trees in their own code (``tree_recurrence.components.gdn_scan`` while this family is
loaded). A thin front over the generic ``sdk.scan`` with this family's seam."""

from __future__ import annotations

from typing import Callable

import torch

from tree_recurrence import sdk

__all__ = ["gdn_scan"]


def gdn_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan=None, *,
             scale: float | None = None, initial_state: torch.Tensor | None = None,
             use_qk_l2norm_in_kernel: bool = False, kernel: Callable | None = None, backend: str = "auto",
             policy=None) -> torch.Tensor:
    """Gated delta rule over a tree-packed row. q, k (1, N, H, K); v (1, N, HV, V); g (1, N, HV) log
    decay per head; beta (1, N, HV); initial_state (1, HV, K, V), the state every root starts from, or
    None. Returns o (1, N, HV, V).

    Native: this family's ``gdn_tree_scan``; else fork / rescan over ``kernel``, a function with FLA's
    ``chunk_gated_delta_rule`` API (default: this family's stand-in). ``backend="kernel"`` skips the
    native op. Without a plan, ``kernel`` runs on the ordinary batch."""
    return sdk.delta_rule_scan("gated_delta_net", "torch_chunk_gated_delta_rule", q, k, v, g, beta, plan,
                               scale=scale, initial_state=initial_state, kernel=kernel, backend=backend,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, policy=policy)
