"""Kimi Delta Attention's library kernel, a stand-in: FLA's ``chunk_kda`` (a decay per key channel),
an exact token recurrence in fp32 (float64 for float64 inputs).

The manifest (``library:`` of the seam ``chunk_kimi_delta_attention``) says which seam it stands in for.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tree_recurrence.sdk import delta_rule, delta_rule_layout

__all__ = ["chunk_kda"]


def _kda_scan(q, k, v, g, beta, state):
    """Exact KDA token recurrence. q, k: (B, T, HV, K) (already scaled / normalised); v: (B, T, HV, V);
    g: (B, T, HV, K) log decay per key channel; beta: (B, T, HV); state: (B, HV, K, V).
    Returns (o (B, T, HV, V), state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]
        k_t = k[:, t]  # (B, HV, K)
        kv_mem = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
    **kwargs,
):
    """Kimi Delta Attention with FLA's ``chunk_kda`` API (exact token recurrence, fp32; float64 when an
    input is float64).

    q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H (value head ``hv`` reads key head
    ``hv // (HV // H)``); g: [B, T, HV, K], the log decay of every key channel; beta: [B, T, HV].
    Per token and head: ``S = diag(exp(g)) S``; ``S += k (beta (v - k^T S))^T``; ``o = scale q^T S``.
    scale defaults to ``K ** -0.5``; ``use_qk_l2norm_in_kernel`` l2-normalises q and k first. With
    ``cu_seqlens`` ([N+1]) B must be 1 and each of the N sequences starts from its own
    ``initial_state[n]`` ([N, HV, K, V]). ``use_gate_in_kernel``: g is raw and the decay is
    ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log`` [HV] and ``dt_bias`` [HV * K] as keywords), or
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` with ``safe_gate`` and ``lower_bound``.
    ``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval``: beta is a logit (times 2 when negative
    eigenvalues are allowed). ``state_v_first``: states stored [.., V, K].
    Returns ``(o [B, T, HV, V] in q's dtype, final_state fp32 [N or B, HV, K, V] or None)``.
    """
    if kwargs.get("head_first"):
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if cp_context is not None:
        raise NotImplementedError("cp_context (context parallelism) is not supported by the stand-in")
    B, T, H, K, HV, V, bounds = delta_rule_layout(q, k, v, cu_seqlens, initial_state, state_v_first)
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g must be [{B}, {T}, {HV}, {K}] (one log decay per key channel), got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [{B}, {T}, {HV}], got {tuple(beta.shape)}")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True requires lower_bound")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if scale is None:
        scale = K**-0.5

    f32 = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype) else torch.float32
    qf, kf, vf, gf, bf = (t.to(f32) for t in (q, k, v, g, beta))
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if dt_bias is not None:
            gf = gf + dt_bias.to(f32).view(HV, K)
        if safe_gate:
            rate = 1.0 if A_log is None else A_log.to(f32).exp().view(HV, 1)
            gf = lower_bound * torch.sigmoid(rate * gf)
        else:
            if A_log is None:
                raise AssertionError("A_log must be provided when use_gate_in_kernel=True.")
            gf = -A_log.to(f32).exp().view(HV, 1) * F.softplus(gf)
    return delta_rule(_kda_scan, qf, kf, vf, gf, bf, q.dtype, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds)
