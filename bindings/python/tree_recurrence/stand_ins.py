"""Library stand-ins: exact PyTorch functions with library APIs, and binding them into a modeling
module as transformers binds the library they imitate.

Families ship their own stand-ins (the library kernels their seams call: ``python: {stand_ins: ...}``
in the family manifest, files in ``plugins/<family>/python/``) and say in each seam's ``library:`` key
which library kernel the seam dispatches to and which stand-in imitates it (``stand_in:``). What stays
here is generic and names no family:

* :func:`causal_conv1d_fn` -- ``causal_conv1d.causal_conv1d_fn`` (causal-conv1d 1.6.1), the causal
  depthwise conv several families' mixers call.
* :func:`l2norm`, :func:`delta_rule` -- what flash-linear-attention's delta-rule kernels share around their
  token recurrence (families pass their recurrence).
* :func:`family_stand_ins`, :func:`stand_in_seam`, :func:`bind_stand_ins` -- find a family's
  stand-ins through its manifest and bind them exactly as transformers binds the real library.

A stand-in of a loaded family is also reachable as an attribute of this module
(``tree_recurrence.stand_ins.<name>``, the first loaded family defining it).

Stand-ins are written for clarity and exactness, not speed: token-by-token recurrences in fp32. Use them
as ground truth in tests and as the "library" on machines where the real kernels are not installed
(backend ``"stand_ins"``). The tree kernels' own float64 oracles are C++ test-only ops
(``*_token_oracle`` in the families' csrc/), not these.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Optional

import torch
import torch.nn.functional as F

from . import plugins
from ._engine import ENGINE

__all__ = ["bind_stand_ins", "causal_conv1d_fn", "delta_rule", "delta_rule_layout", "family_stand_ins", "l2norm", "stand_in", "stand_in_seam", "wrap_as_library"]


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
    **kwargs,  # keywords a caller passes down (Granite-4's output_router_logits): ignored, as the libraries do
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
# the delta rule's wrapper (flash-linear-attention's delta-rule kernels share it)
# --------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: ``x / sqrt(sum(x * x) + eps)`` along ``dim``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)



def delta_rule_layout(q, k, v, cu_seqlens, initial_state, state_v_first):
    """The shape checks FLA's delta-rule kernels share (families' stand-ins call it before their own):
    q, k [B, T, H, K] alike; v [B, T, HV, V], HV a multiple of H; ``cu_seqlens`` (B must be 1)
    increasing from 0 to T; ``initial_state`` [N, HV, K, V] ([N, HV, V, K] with ``state_v_first``).
    Returns ``(B, T, H, K, HV, V, bounds)``, bounds the cu_seqlens list or None."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, T, H, K] / [B, T, HV, V]")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be [{B}, {T}, HV, V], got {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_heads (H={H}), "
                         f"but got HV % H = {HV % H}")
    bounds = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                             "Please flatten variable-length inputs before processing.")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must increase from 0 to T={T}, got {bounds}")
    N = B if bounds is None else len(bounds) - 1
    if initial_state is not None:
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != expected:
            if bounds is not None and initial_state.shape[0] != N:
                raise ValueError("The number of initial states is expected to be equal to the number of input "
                                 f"sequences, i.e., {N} rather than {initial_state.shape[0]}.")
            raise ValueError(f"initial_state must be {list(expected)}, got {list(initial_state.shape)}")
    return B, T, H, K, HV, V, bounds


def delta_rule(scan, qf, kf, vf, gf, bf, out_dtype, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, bounds):
    """What FLA's delta-rule kernels share around their token recurrence ``scan`` (families' stand-ins
    call it with their own recurrence):
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
# Families' stand-ins, found through their manifests
# --------------------------------------------------------------------------------------------


def family_stand_ins(family: str):
    """The stand-ins module a loaded family's manifest names (``python: {stand_ins: ...}``; the
    deprecated role name ``reference`` is read too)."""
    return plugins.family_python(family, "stand_ins") or plugins.family_python(family, "reference")


def _library(family: str, seam: str) -> dict | None:
    """The seam's ``library:`` entry ({package, kernel, stand_in}) in the family's manifest, or None."""
    record = plugins.families().get(family)
    spec = record.seams.get(seam) if record else None
    return dict(spec.library) if spec is not None and spec.library is not None else None


def stand_in(family: str, seam: str):
    """The function the seam's ``library: {stand_in: ...}`` names (unwrapped), or None."""
    library = _library(family, seam)
    dotted = library and (library.get("stand_in") or library.get("reference"))  # "reference": deprecated key
    return _resolve(family, dotted) if dotted else None


def _resolve(family: str, dotted: str):
    """``<module>.<name>``: a module of the family's ``python:`` folder, else an importable module."""
    module_name, _, name = dotted.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"family '{family}': library stand-in '{dotted}' must be <module>.<function>")
    record = plugins.families()[family]
    if module_name in record.python_modules.values():
        module = plugins.family_python_module(family, module_name)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"family '{family}': library stand-in '{dotted}': {module.__name__} has no '{name}'")
    return getattr(module, name)


def stand_in_seam(family: str, seam: str, current):
    """The stand-in for ``seam``'s library (the family manifest's ``library:``), wrapped exactly as
    transformers wraps a library kernel (keyword filtering included), with ``current``'s torch
    function (transformers' PyTorch path) as fallback; None when the manifest names no stand-in for
    that seam. Cached per (family, seam) while neither the torch function nor the stand-in changes
    (tests replace them with spies)."""
    library = _library(family, seam)
    torch_function = getattr(current, "__wrapped__", None)
    implementation = stand_in(family, seam) if torch_function is not None else None
    if implementation is None:
        return None
    key, package = library["kernel"], library["package"]
    cached = _wrapped_stand_ins.get((family, seam))
    if cached is not None and cached[0] is torch_function and cached[1] is implementation:
        return cached[2]
    wrapped = wrap_as_library(torch_function, package, key, implementation)
    _wrapped_stand_ins[(family, seam)] = (torch_function, implementation, wrapped)
    return wrapped


_wrapped_stand_ins: dict = ENGINE.wrapped_stand_ins


def wrap_as_library(torch_function, package: str, kernel: str, implementation):
    """``torch_function`` decorated by transformers' own ``use_kernel_func_from_hub_with_fallback(kernel,
    package)`` while a stand-in ``package`` exposes ``implementation`` at transformers' internal path
    for ``kernel`` (``_KERNELS_INTERNAL_PATH_MAPPINGS``, e.g. fla.ops.gated_delta_rule): what a
    modeling module would hold had the library been installed at its import."""
    from transformers.integrations import hub_kernels

    internal = hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS.get(kernel)
    parts = [package] + (internal.split(".") if internal else [])
    fakes = [types.ModuleType(".".join(parts[: i + 1])) for i in range(len(parts))]
    for fake in fakes:
        fake.__path__ = []  # a package
    for parent, child, name in zip(fakes, fakes[1:], parts[1:]):
        setattr(parent, name, child)
    setattr(fakes[-1], kernel, implementation)
    saved = {f.__name__: sys.modules.get(f.__name__) for f in fakes}
    sys.modules.update({f.__name__: f for f in fakes})
    try:  # transformers picks the implementation while the stand-in package is importable
        return hub_kernels.use_kernel_func_from_hub_with_fallback(kernel, package)(torch_function)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def _seam_families(module) -> dict[str, str]:
    """seam name -> the family whose stand-in binds it in ``module``: a family whose manifest lists the
    module first, then any loaded family with a ``library:`` for that seam."""
    found: dict[str, str] = {}
    families = plugins.families()
    owning = [n for n, r in families.items()
              if any(e.get("module") == module.__name__ for e in r.models)]
    for name in owning + sorted(n for n in families if n not in owning):
        for seam, spec in families[name].seams.items():
            if spec.library and seam not in found:
                found[seam] = name
    return found


def bind_stand_ins(module, seams=None):
    """Rebinds ``module``'s seams as if the libraries the family manifests name (FLA, causal-conv1d,
    ...) were installed, with the families' stand-ins in their place (``stand_in_seam``), so
    each seam filters keywords and dispatches exactly as it would with the real library.

    Call it before ``tree_recurrence.install``. Returns a function that restores the seams.
    """
    replaced = {}
    for seam, family in _seam_families(module).items():
        if (seams is not None and seam not in seams) or not hasattr(module, seam):
            continue
        current = getattr(module, seam)
        if getattr(current, "__wrapped__", None) is None:
            raise ValueError(f"{module.__name__}.{seam} is not a transformers kernel seam (no __wrapped__)")
        wrapped = stand_in_seam(family, seam, current)
        if wrapped is not None:
            replaced[seam] = current
            setattr(module, seam, wrapped)

    def restore():
        for seam, original in replaced.items():
            setattr(module, seam, original)

    return restore


def __getattr__(name: str):
    """A loaded family's stand-in by name (``tree_recurrence.stand_ins.<kernel>``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    for family in plugins.families():
        module = family_stand_ins(family)
        if module is not None and name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no loaded family's stand-ins define it)")
