"""Pure-PyTorch reference versions of the library kernels that the hooks may call.

These run anywhere torch runs (CPU included), are differentiable by autograd, and follow the
public APIs of the libraries they stand in for:

* :func:`causal_conv1d_fn` -- ``causal_conv1d.causal_conv1d_fn`` (causal-conv1d 1.6.1).
* :func:`chunk_gated_delta_rule` -- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
  (flash-linear-attention / fla-core 0.5.2).
* :func:`chunk_kda` -- ``fla.ops.kda.chunk_kda`` (Kimi Delta Attention: a decay per key channel).
* :func:`mamba_chunk_scan_combined`, :func:`mamba_split_conv1d_scan_combined` --
  ``mamba_ssm.ops.triton.ssd_combined`` (mamba-ssm 2.3.2): seq_idx, per-row initial states.

They are written for clarity and exactness, not speed: the delta rule and the SSD scan are plain
token-by-token recurrences in fp32. Use them as ground truth in tests and as the "library" on
machines where the real kernels are not installed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["bind_reference_kernels", "causal_conv1d_fn", "chunk_gated_delta_rule", "chunk_kda", "l2norm",
           "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"]


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
    return _delta_rule(_gated_delta_scan, qf, kf, vf, gf, bf, v.dtype, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds)


def _delta_rule(scan, qf, kf, vf, gf, bf, out_dtype, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds):
    """What FLA's delta-rule kernels (GDN, KDA) share around their token recurrence ``scan``:
    beta as a logit, q/k l2norm and scale, grouped value heads, per-sequence initial and final
    states over ``bounds`` (cu_seqlens as a list, or None for a padded batch). Inputs in the
    compute dtype; returns ``(o in out_dtype, final_state or None)``."""
    H, HV, K, V = qf.shape[2], vf.shape[2], qf.shape[3], vf.shape[3]
    if use_beta_sigmoid_in_kernel:
        bf = (2.0 if allow_neg_eigval else 1.0) * bf.sigmoid()
    if use_qk_l2norm_in_kernel:
        qf = l2norm(qf, dim=-1, eps=1e-6)
        kf = l2norm(kf, dim=-1, eps=1e-6)
    qf = qf * scale
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)
    N = qf.shape[0] if bounds is None else len(bounds) - 1
    if initial_state is None:
        h0 = qf.new_zeros(N, HV, K, V)
    else:
        h0 = initial_state.to(qf.dtype)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    if bounds is None:
        o, ht = scan(qf, kf, vf, gf, bf, h0)
    else:
        outs, finals = [], []
        for n in range(N):
            s, e = bounds[n], bounds[n + 1]
            o_n, h_n = scan(qf[:, s:e], kf[:, s:e], vf[:, s:e], gf[:, s:e], bf[:, s:e], h0[n : n + 1])
            outs.append(o_n)
            finals.append(h_n)
        o, ht = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    if state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


# --------------------------------------------------------------------------------------------
# mamba-ssm: mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
# --------------------------------------------------------------------------------------------


def _ssd_scan(dx, decay, B, C, state, seq_idx=None, ends=None):
    """Exact SSD token recurrence. dx = dt * x (b, T, H, P); decay = exp(dt * A) (b, T, H);
    B, C (b, T, H, N) (groups already repeated to heads); state (b, H, P, N). A position whose
    ``seq_idx`` differs from the previous one starts from a zero state (mamba-ssm's packed
    sequences); the row's first position keeps ``state`` only if its seq_idx is 0 (mamba-ssm
    takes the initial state as that of a sequence 0 ending before the row). ``ends``: positions
    whose state to return too (varlen states). Returns (y (b, T, H, P), final state, states at ends)."""
    outs, at_ends = [], {}
    for t in range(dx.shape[1]):
        if seq_idx is not None:
            previous = seq_idx[:, t - 1] if t > 0 else torch.zeros_like(seq_idx[:, 0])
            keep = (seq_idx[:, t] == previous).to(state.dtype)
            state = state * keep[:, None, None, None]
        state = state * decay[:, t, :, None, None] + dx[:, t, :, :, None] * B[:, t, :, None, :]
        outs.append((state * C[:, t, :, None, :]).sum(-1))
        if ends is not None and t in ends:
            at_ends[t] = state
    y = torch.stack(outs, dim=1) if outs else dx.new_zeros(dx.shape)
    return y, state, at_ends


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
):
    """Mamba2 SSD scan with mamba-ssm's ``mamba_chunk_scan_combined`` API (mamba-ssm 2.3.2), as an
    exact token recurrence (fp32; float64 when x is float64). ``chunk_size`` is validated only.

    x (batch, seqlen, nheads, headdim); dt (batch, seqlen, nheads) raw; A (nheads); B, C (batch,
    seqlen, ngroups, dstate), head h reading group h // (nheads // ngroups); D (nheads) or
    (nheads, headdim); z like x (output gate: ``out * silu(z)``); dt_bias (nheads).
    dt = clamp(softplus?(dt + dt_bias), *dt_limit), computed in fp32 as the kernel does.
    ``initial_states`` (batch, nheads, headdim, dstate): the state before each row.
    ``seq_idx`` (batch, seqlen): packed sequences, each starting from a zero state (the first keeps
    the initial state when its id is 0, as mamba-ssm's kernels do).
    ``cu_seqlens`` (num_sequences + 1): only read with ``return_varlen_states`` (batch 1): the final
    state of each sequence. It does not separate sequences; ``seq_idx`` does.
    Returns out (x's dtype), then the final states (batch, nheads, headdim, dstate) fp32 if
    ``return_final_states``, then the varlen states (num_sequences, ...) if ``return_varlen_states``.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if B.dim() != 4:
        raise ValueError(f"B must be (batch, seqlen, ngroups, dstate), got {tuple(B.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    if nheads % ngroups != 0:
        raise AssertionError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    if tuple(B.shape) != (batch, seqlen, ngroups, dstate) or tuple(C.shape) != tuple(B.shape):
        raise AssertionError(f"B and C must be ({batch}, {seqlen}, {ngroups}, {dstate}), got {tuple(B.shape)}, {tuple(C.shape)}")
    if tuple(dt.shape) != (batch, seqlen, nheads):
        raise AssertionError(f"dt must be ({batch}, {seqlen}, {nheads}), got {tuple(dt.shape)}")
    if tuple(A.shape) != (nheads,):
        raise AssertionError(f"A must be ({nheads},), got {tuple(A.shape)}")
    if z is not None and z.shape != x.shape:
        raise AssertionError(f"z must be shaped like x {tuple(x.shape)}, got {tuple(z.shape)}")
    if D is not None and tuple(D.shape) not in ((nheads, headdim), (nheads,)):
        raise AssertionError(f"D must be ({nheads},) or ({nheads}, {headdim}), got {tuple(D.shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) != (nheads,):
        raise AssertionError(f"dt_bias must be ({nheads},), got {tuple(dt_bias.shape)}")
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, seqlen):
        raise AssertionError(f"seq_idx must be ({batch}, {seqlen}), got {tuple(seq_idx.shape)}")
    if initial_states is not None and tuple(initial_states.shape) != (batch, nheads, headdim, dstate):
        raise AssertionError(f"initial_states must be ({batch}, {nheads}, {headdim}, {dstate}), got {tuple(initial_states.shape)}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    ends = None
    if return_varlen_states:
        if cu_seqlens is None:
            raise AssertionError("cu_seqlens must be provided if return_varlen_states is True")
        if batch != 1:
            raise AssertionError("passing cu_seqlens to get the varlen states is only supported if batch dimension is 1")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seqlen or any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must increase strictly from 0 to seqlen={seqlen}, got {bounds}")
        ends = [b - 1 for b in bounds[1:]]

    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtf = dt.to(f)
    if dt_bias is not None:
        dtf = dtf + dt_bias.to(f)
    if dt_softplus:
        dtf = F.softplus(dtf)  # threshold 20, as the kernel's `where(dt <= 20, softplus(dt), dt)`
    dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.to(f)
    repeat = nheads // ngroups
    Bh = B.to(f).repeat_interleave(repeat, dim=2)
    Ch = C.to(f).repeat_interleave(repeat, dim=2)
    decay = torch.exp(dtf * A.to(f))
    state = initial_states.to(f) if initial_states is not None else xf.new_zeros(batch, nheads, headdim, dstate)
    y, final, at_ends = _ssd_scan(xf * dtf[..., None], decay, Bh, Ch, state, seq_idx, set(ends) if ends else None)
    if D is not None:
        y = y + (D.to(f)[:, None] if D.dim() == 1 else D.to(f)) * xf
    if z is not None:
        y = y * F.silu(z.to(f))
    out = y.to(x.dtype)
    results = [out]
    if return_final_states:
        results.append(final.float() if f == torch.float32 else final)
    if return_varlen_states:
        varlen = torch.cat([at_ends[e] for e in ends], dim=0)
        results.append(varlen.float() if f == torch.float32 else varlen)
    return results[0] if len(results) == 1 else tuple(results)


def _rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate):
    """mamba-ssm's RMSNormGated (layernorm_gated, is_rms_norm): per group of ``group_size``
    channels; the gate silu(z) before the norm unless ``norm_before_gate``."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.to(f))
    shape = xf.shape
    grouped = xf.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    y = grouped.reshape(shape) * weight.to(f)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: Optional[torch.Tensor],
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    dt_limit: tuple = (0.0, float("inf")),
    return_final_states: bool = False,
    activation: Optional[str] = "silu",
    rmsnorm_weight: Optional[torch.Tensor] = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Optional[torch.Tensor] = None,
    outproj_bias: Optional[torch.Tensor] = None,
    headdim: Optional[int] = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
):
    """mamba-ssm's fused Mamba2 mixer core (``mamba_split_conv1d_scan_combined``, 2.3.2): split
    ``zxbcdt`` (batch, seqlen, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads) into
    [zx0 | z | xBC | dt], causal conv1d (+ silu) over xBC (``seq_idx`` separates packed
    sequences), the SSD scan with ``dt_softplus=True`` (``mamba_chunk_scan_combined``), then either
    the output gate silu(z) inside the scan (``rmsnorm_weight`` None) or mamba-ssm's gated RMSNorm
    per group of ``dim // ngroups`` channels (as the fused kernel does; mamba-ssm's own
    ``mamba_split_conv1d_scan_ref`` normalises over all channels, state-spaces/mamba#647),
    swiglu(zx0) prepended when d_nonssm > 0, and ``outproj``. Returns out, or (out, final states).
    """
    if activation not in (None, "silu", "swish"):
        raise AssertionError("activation must be None, silu or swish")
    if D.dim() == 1:
        if headdim is None:
            raise AssertionError("headdim must be given when D is 1-D")
        (nheads,) = D.shape
    else:
        nheads, headdim = D.shape
    batch, seqlen, _ = zxbcdt.shape
    dim = nheads * headdim
    if nheads % ngroups != 0:
        raise AssertionError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or zxbcdt.shape[-1] != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads:
        raise AssertionError(f"zxbcdt last dimension {zxbcdt.shape[-1]} does not split into "
                             f"2*d_nonssm + 2*{dim} + 2*{ngroups}*{dstate} + {nheads}")
    if tuple(dt_bias.shape) != (nheads,) or tuple(A.shape) != (nheads,):
        raise AssertionError(f"dt_bias and A must be ({nheads},), got {tuple(dt_bias.shape)} and {tuple(A.shape)}")
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation="silu" if activation in ("silu", "swish") else None).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, seqlen, nheads, headdim)
    B = B.reshape(batch, seqlen, ngroups, dstate)
    C = C.reshape(batch, seqlen, ngroups, dstate)
    z = z.reshape(batch, seqlen, nheads, headdim)
    out, final = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, z=z if rmsnorm_weight is None else None,
                                           dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                                           dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
    out = out.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        out = _rms_norm_gated(out, rmsnorm_weight, z.reshape(batch, seqlen, dim), rmsnorm_eps, dim // ngroups,
                              norm_before_gate)
    if d_nonssm > 0:
        gate, up = zx0.chunk(2, dim=-1)
        out = torch.cat([F.silu(gate) * up, out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    elif outproj_bias is not None:
        raise AssertionError("outproj_bias without outproj_weight")
    return (out, final) if return_final_states else out


# --------------------------------------------------------------------------------------------
# flash-linear-attention: chunk_kda (Kimi Delta Attention)
# --------------------------------------------------------------------------------------------


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
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
        raise NotImplementedError("cp_context (context parallelism) is not supported by the reference")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, H, K] / [B, T, HV, V]")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if tuple(v.shape[:2]) != (B, T) or HV % H != 0:
        raise ValueError(f"v must be [{B}, {T}, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
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
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`.")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must increase from 0 to T={T}, got {bounds}")
        N = len(bounds) - 1
    else:
        bounds, N = None, B
    if initial_state is not None:
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be {list(expected)}, got {list(initial_state.shape)}")

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
    return _delta_rule(_kda_scan, qf, kf, vf, gf, bf, q.dtype, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds)


# --------------------------------------------------------------------------------------------
# Binding the references into a modeling module, exactly as transformers binds a library
# --------------------------------------------------------------------------------------------

# seam name in a modeling module -> (hub key, package, reference standing in for the package)
_LIBRARY_SEAMS = {
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d", "causal_conv1d_fn"),
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla", "chunk_gated_delta_rule"),
    "chunk_kimi_delta_attention": ("chunk_kda", "fla", "chunk_kda"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm", "mamba_chunk_scan_combined"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm",
                                          "mamba_split_conv1d_scan_combined"),
}


def reference_seam(seam: str, current):
    """The reference standing in for ``seam``'s library, wrapped exactly as transformers wraps a
    library kernel (keyword filtering included), with ``current``'s torch reference as fallback;
    None when no reference stands in for that seam. Cached per seam while neither the torch
    reference nor the reference implementation changes (tests replace them with spies)."""
    import sys
    import types

    from transformers.integrations import hub_kernels

    if seam not in _LIBRARY_SEAMS:
        return None
    key, package, reference_name = _LIBRARY_SEAMS[seam]
    this = sys.modules[__name__]
    torch_function = getattr(current, "__wrapped__", None)
    if torch_function is None or not hasattr(this, reference_name):
        return None
    implementation = getattr(this, reference_name)
    cached = _wrapped_references.get(seam)
    if cached is not None and cached[0] is torch_function and cached[1] is implementation:
        return cached[2]
    internal = hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS.get(key)
    parts = [package] + (internal.split(".") if internal else [])
    fakes = [types.ModuleType(".".join(parts[: i + 1])) for i in range(len(parts))]
    for parent, child, name in zip(fakes, fakes[1:], parts[1:]):
        setattr(parent, name, child)
    setattr(fakes[-1], key, implementation)
    saved = {f.__name__: sys.modules.get(f.__name__) for f in fakes}
    sys.modules.update({f.__name__: f for f in fakes})
    try:  # transformers picks the implementation while the stand-in package is importable
        wrapped = hub_kernels.use_kernel_func_from_hub_with_fallback(key, package)(torch_function)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    _wrapped_references[seam] = (torch_function, implementation, wrapped)
    return wrapped


_wrapped_references: dict = {}


def bind_reference_kernels(module, seams=None):
    """Rebinds ``module``'s seams as if FLA / causal-conv1d / mamba-ssm were installed, with these
    references as the libraries (``reference_seam``), so each seam filters keywords and dispatches
    exactly as it would with the real library.

    Call it before ``tree_recurrence.install``. Returns a function that restores the seams.
    """
    replaced = {}
    for seam in _LIBRARY_SEAMS:
        if (seams is not None and seam not in seams) or not hasattr(module, seam):
            continue
        current = getattr(module, seam)
        if getattr(current, "__wrapped__", None) is None:
            raise ValueError(f"{module.__name__}.{seam} is not a transformers kernel seam (no __wrapped__)")
        wrapped = reference_seam(seam, current)
        if wrapped is not None:
            replaced[seam] = current
            setattr(module, seam, wrapped)

    def restore():
        for seam, original in replaced.items():
            setattr(module, seam, original)

    return restore
