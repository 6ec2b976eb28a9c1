"""Gated DeltaNet's library kernel, a stand-in: FLA's ``chunk_gated_delta_rule``
(flash-linear-attention / fla-core 0.5.2), an exact token recurrence in fp32 (float64 for float64 inputs).

The manifest (``library:`` of the seam ``torch_chunk_gated_delta_rule``) says which seam it stands in for;
``tree_recurrence.stand_ins.bind_stand_ins`` binds it as transformers binds FLA.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tree_recurrence.sdk import delta_rule, delta_rule_layout

__all__ = ["chunk_gated_delta_rule"]


def _gated_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
):
    """Exact token recurrence, fp32. q, k: (B, T, HV, K) (already scaled / normalised);
    v: (B, T, HV, V); g, beta: (B, T, HV); state: (B, HV, K, V). Returns (o (B, T, HV, V), state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]  # (B, HV, K)
        kv_mem = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    if outs:
        o = torch.stack(outs, dim=1)
    else:
        o = v.new_zeros(v.shape)
    return o, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Gated delta rule with FLA's ``chunk_gated_delta_rule`` API (exact fp32 token recurrence).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head ``hv`` reads key
    head ``hv // (HV // H)``); g (log decay, <= 0) and beta: [B, T, HV].
    Per token: ``S = exp(g) S``; ``S += k (beta (v - k^T S))^T``; ``o = scale q^T S``.
    scale defaults to ``K ** -0.5``. ``use_qk_l2norm_in_kernel`` l2-normalises q and k (fp32,
    eps 1e-6) first. With ``cu_seqlens`` ([N+1], int) B must be 1, each of the N sequences starts
    from its own ``initial_state[n]`` (``initial_state`` is [N, HV, K, V]) and no state crosses
    a boundary. Returns ``(o [B, T, HV, V] in v's dtype, final_state fp32 [N or B, HV, K, V] or
    None)``.

    Also honoured, as in FLA: ``chunk_size`` (16/32/64, validated only), ``use_gate_in_kernel``
    with ``A_log`` / ``dt_bias`` (g is raw; ``g = -exp(A_log) * softplus(g + dt_bias)``),
    ``use_beta_sigmoid_in_kernel`` / ``allow_neg_eigval`` (beta is a logit), ``state_v_first``
    (states stored [.., V, K]), ``cu_seqlens_cpu`` (ignored), ``cp_context`` (unsupported unless
    None).
    """
    state_v_first = bool(kwargs.pop("state_v_first", False))
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError("cp_context (context parallelism) is not supported by the stand-in")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    use_gate_in_kernel = bool(kwargs.get("use_gate_in_kernel", False))
    use_beta_sigmoid_in_kernel = bool(kwargs.get("use_beta_sigmoid_in_kernel", False))
    allow_neg_eigval = bool(kwargs.get("allow_neg_eigval", False))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")

    B, T, H, K, HV, V, bounds = delta_rule_layout(q, k, v, cu_seqlens, initial_state, state_v_first)
    if tuple(g.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"g and beta must be [{B}, {T}, {HV}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if scale is None:
        scale = K**-0.5

    # fp32 as FLA computes; float64 when any input is float64, so tests can compare exactly.
    f32 = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype) else torch.float32
    qf, kf, vf, gf, bf = (t.to(f32) for t in (q, k, v, g, beta))
    if use_gate_in_kernel:
        A_log = kwargs.get("A_log")
        if A_log is None:
            raise AssertionError("A_log must be provided when use_gate_in_kernel=True.")
        dt_bias = kwargs.get("dt_bias")
        if dt_bias is not None:
            gf = gf + dt_bias.to(f32)
        gf = -A_log.to(f32).exp() * F.softplus(gf)
    return delta_rule(_gated_delta_scan, qf, kf, vf, gf, bf, v.dtype, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds)
