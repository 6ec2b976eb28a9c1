"""Pure-PyTorch reference versions of the library kernels that the hooks may call.

These run anywhere torch runs (CPU included), are differentiable by autograd, and follow the
public APIs of the libraries they stand in for:

* :func:`causal_conv1d_fn` -- ``causal_conv1d.causal_conv1d_fn`` (causal-conv1d 1.6.1).
* :func:`chunk_gated_delta_rule` -- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
  (flash-linear-attention / fla-core 0.5.2).

They are written for clarity and exactness, not speed: the delta rule is a plain token-by-token
recurrence in fp32. Use them as ground truth in tests and as the "library" on machines where
the real kernels are not installed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["bind_reference_kernels", "causal_conv1d_fn", "chunk_gated_delta_rule", "l2norm"]


# --------------------------------------------------------------------------------------------
# causal-conv1d
# --------------------------------------------------------------------------------------------


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_states_out: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
):
    """Causal depthwise conv1d with causal-conv1d's API.

    x: (batch, dim, seqlen) channels-first (any memory layout is accepted here).
    weight: (dim, width), width 2..4 as in the CUDA kernel. bias: (dim,) or None.
    seq_idx: (batch, seqlen) int32 or None. A position only reads earlier positions of the
        same row that carry the same ``seq_idx``; a position with ``seq_idx < 0`` (padding)
        outputs exactly 0 (no bias, no activation), as the CUDA kernel does.
    initial_states: (batch, dim, width - 1) or None: the inputs "before" position 0.
    return_final_states: also return the last ``width - 1`` inputs (batch, dim, width - 1),
        left-padded with zeros (or the initial states) when ``seqlen < width - 1``.
    final_states_out: if given (with ``return_final_states``) the final states are copied into it
        and it is returned.
    activation: None, "silu" or "swish".

    Returns ``out`` (batch, dim, seqlen) in ``x``'s dtype, or ``(out, final_states)``.
    As in causal-conv1d, ``seq_idx`` cannot be combined with ``initial_states`` or
    ``return_final_states``. Arithmetic runs in ``weight``'s dtype promoted to at least fp32.
    """
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, dim, seqlen), got shape {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be (dim={dim}, width), got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if not 2 <= width <= 4:
        raise RuntimeError("causal_conv1d only supports width between 2 and 4")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be ({dim},), got shape {tuple(bias.shape)}")
    if seq_idx is not None:
        if initial_states is not None:
            raise AssertionError("initial_states must be None if seq_idx is not None")
        if return_final_states:
            raise AssertionError("If seq_idx is not None, we don't return final_states_out")
        if tuple(seq_idx.shape) != (batch, seqlen):
            raise ValueError(f"seq_idx must be ({batch}, {seqlen}), got {tuple(seq_idx.shape)}")
        if seq_idx.dtype != torch.int32:
            raise TypeError(f"seq_idx must be int32, got {seq_idx.dtype}")
    if initial_states is not None and tuple(initial_states.shape) != (batch, dim, width - 1):
        raise ValueError(
            f"initial_states must be ({batch}, {dim}, {width - 1}), got {tuple(initial_states.shape)}"
        )

    dtype_in = x.dtype
    compute_dtype = torch.promote_types(weight.dtype, torch.float32)
    xc = x.to(compute_dtype)
    w = weight.to(compute_dtype)
    if initial_states is not None:
        prefix = initial_states.to(compute_dtype)
    else:
        prefix = xc.new_zeros(batch, dim, width - 1)
    xp = torch.cat([prefix, xc], dim=-1)  # (B, D, W-1+L)

    if seq_idx is not None:
        sid = seq_idx.to(torch.long)
        # Positions before the row start carry -1, which never equals a valid (>= 0) id.
        sid_p = torch.cat([sid.new_full((batch, width - 1), -1), sid], dim=-1)  # (B, W-1+L)

    out = None
    for j in range(width):  # tap j reads the input `width - 1 - j` steps back
        tap = xp[:, :, j : j + seqlen]
        if seq_idx is not None:
            same = (sid_p[:, j : j + seqlen] == sid).to(compute_dtype).unsqueeze(1)
            tap = tap * same
        term = tap * w[:, j].view(1, dim, 1)
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.to(compute_dtype).view(1, dim, 1)
    if activation is not None:
        out = F.silu(out)
    if seq_idx is not None:
        out = out * (sid >= 0).to(compute_dtype).unsqueeze(1)
    out = out.to(dtype_in)

    if not return_final_states:
        return out
    final_states = xp[:, :, xp.shape[-1] - (width - 1) :].to(dtype_in)
    if final_states_out is not None:
        with torch.no_grad():
            final_states_out.copy_(final_states)
        return out, final_states_out
    return out, final_states


# --------------------------------------------------------------------------------------------
# flash-linear-attention: chunk_gated_delta_rule
# --------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: ``x / sqrt(sum(x * x) + eps)`` along ``dim``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


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
        raise NotImplementedError("cp_context (context parallelism) is not supported by the reference")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    use_gate_in_kernel = bool(kwargs.get("use_gate_in_kernel", False))
    use_beta_sigmoid_in_kernel = bool(kwargs.get("use_beta_sigmoid_in_kernel", False))
    allow_neg_eigval = bool(kwargs.get("allow_neg_eigval", False))
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, H, K] / [B, T, HV, V]")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be [{B}, {T}, HV, V], got {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), "
            f"but got HV % H = {HV % H}"
        )
    if tuple(g.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
        raise ValueError(
            f"g and beta must be [{B}, {T}, {HV}], got {tuple(g.shape)} and {tuple(beta.shape)}"
        )
    if scale is None:
        scale = K**-0.5

    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                "Please flatten variable-length inputs before processing."
            )
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(
            b1 < b0 for b0, b1 in zip(bounds[:-1], bounds[1:])
        ):
            raise ValueError(f"cu_seqlens must increase from 0 to T={T}, got {bounds}")
        N = len(bounds) - 1
    else:
        bounds = None
        N = B
    if initial_state is not None:
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != expected:
            if cu_seqlens is not None and initial_state.shape[0] != N:
                raise ValueError(
                    "The number of initial states is expected to be equal to the number of input "
                    f"sequences, i.e., {N} rather than {initial_state.shape[0]}."
                )
            raise ValueError(f"initial_state must be {list(expected)}, got {list(initial_state.shape)}")

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
    if use_beta_sigmoid_in_kernel:
        bf = (2.0 if allow_neg_eigval else 1.0) * bf.sigmoid()
    if use_qk_l2norm_in_kernel:
        qf = l2norm(qf, dim=-1, eps=1e-6)
        kf = l2norm(kf, dim=-1, eps=1e-6)
    qf = qf * scale
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)

    if initial_state is None:
        h0 = qf.new_zeros(N, HV, K, V)
    else:
        h0 = initial_state.to(f32)
        if state_v_first:
            h0 = h0.transpose(-1, -2)

    if bounds is None:
        o, ht = _gated_delta_scan(qf, kf, vf, gf, bf, h0)
    else:
        outs, finals = [], []
        for n in range(N):
            s, e = bounds[n], bounds[n + 1]
            o_n, h_n = _gated_delta_scan(
                qf[:, s:e], kf[:, s:e], vf[:, s:e], gf[:, s:e], bf[:, s:e], h0[n : n + 1]
            )
            outs.append(o_n)
            finals.append(h_n)
        o = torch.cat(outs, dim=1)
        ht = torch.cat(finals, dim=0)

    o = o.to(v.dtype)
    if not output_final_state:
        return o, None
    if state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


# --------------------------------------------------------------------------------------------
# Binding the references into a modeling module, exactly as transformers binds a library
# --------------------------------------------------------------------------------------------

# seam name in a modeling module -> (hub key, package, reference standing in for the package)
_LIBRARY_SEAMS = {
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d", "causal_conv1d_fn"),
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla", "chunk_gated_delta_rule"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm", "mamba_chunk_scan_combined"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm",
                                          "mamba_split_conv1d_scan_combined"),
}


def bind_reference_kernels(module, seams=None):
    """Rebinds ``module``'s seams as if FLA / causal-conv1d / mamba-ssm were installed, with these
    references as the libraries: each seam is re-decorated with transformers' own
    ``use_kernel_func_from_hub_with_fallback`` while a stand-in package is importable, so the
    seam filters keywords and dispatches exactly as it would with the real library.

    Call it before ``tree_recurrence.install``. Returns a function that restores the seams.
    """
    import sys
    import types

    from transformers.integrations import hub_kernels

    this = sys.modules[__name__]
    replaced = {}
    for seam, (key, package, reference_name) in _LIBRARY_SEAMS.items():
        if seams is not None and seam not in seams:
            continue
        if not hasattr(module, seam) or not hasattr(this, reference_name):
            continue
        current = getattr(module, seam)
        torch_function = getattr(current, "__wrapped__", None)
        if torch_function is None:
            raise ValueError(f"{module.__name__}.{seam} is not a transformers kernel seam (no __wrapped__)")
        internal = hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS.get(key)
        parts = [package] + (internal.split(".") if internal else [])
        fakes = [types.ModuleType(".".join(parts[: i + 1])) for i in range(len(parts))]
        for parent, child, name in zip(fakes, fakes[1:], parts[1:]):
            setattr(parent, name, child)
        setattr(fakes[-1], key, getattr(this, reference_name))
        saved = {f.__name__: sys.modules.get(f.__name__) for f in fakes}
        sys.modules.update({f.__name__: f for f in fakes})
        try:
            replaced[seam] = current
            setattr(module, seam, hub_kernels.use_kernel_func_from_hub_with_fallback(key, package)(torch_function))
        finally:
            for name, previous in saved.items():
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous

    def restore():
        for seam, original in replaced.items():
            setattr(module, seam, original)

    return restore
