"""Mamba2's library kernels, stand-ins: mamba-ssm's ``mamba_chunk_scan_combined`` and
``mamba_split_conv1d_scan_combined`` (``mamba_ssm.ops.triton.ssd_combined``, mamba-ssm 2.3.2; seq_idx,
per-row initial states), exact token recurrences in fp32 (float64 for float64 inputs).

The manifest (``library:`` of the seams ``mamba2_chunk_scan`` and ``mamba2_split_conv1d_scan_combined``)
says which seam each stands in for.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tree_recurrence.sdk import causal_conv1d_fn

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"]


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
    **kwargs,  # keywords a caller passes down: ignored, as the library does
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


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool) -> torch.Tensor:
    """mamba-ssm's gated RMSNorm (layernorm_gated's RMSNormGated, is_rms_norm): RMS over groups of
    ``group_size`` channels, in fp32 (float64 for float64), the gate silu(z) after the norm if
    ``norm_before_gate`` else before (the family's fused adapter uses it too)."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.to(f))
    shape = xf.shape
    grouped = xf.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    y = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).reshape(shape) * weight.to(f)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: Optional[torch.Tensor], dt_bias: torch.Tensor,
    A: torch.Tensor, D: torch.Tensor, chunk_size: int,
    initial_states: Optional[torch.Tensor] = None, seq_idx: Optional[torch.Tensor] = None,
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
    **kwargs,  # keywords a caller passes down (Granite-4's output_router_logits): ignored, as the library does
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
        out = rms_norm_gated(out, rmsnorm_weight, z.reshape(batch, seqlen, dim), rmsnorm_eps, dim // ngroups,
                              norm_before_gate)
    if d_nonssm > 0:
        gate, up = zx0.chunk(2, dim=-1)
        out = torch.cat([F.silu(gate) * up, out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    elif outproj_bias is not None:
        raise AssertionError("outproj_bias without outproj_weight")
    return (out, final) if return_final_states else out
