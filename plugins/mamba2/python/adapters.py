"""Mamba2's own seam adapter: mamba-ssm's fused mixer core ``mamba_split_conv1d_scan_combined`` on a
tree-packed row (manifest: ``adapter: family``, ``function: split_conv1d_scan``).

The fused kernel runs conv -> SSD scan -> gated RMSNorm per group -> out projection in one call; none
of its library versions can fork states at segment boundaries. Declining it makes the mixer take its
split path, whose norm is over all channels, not per group: the tree row would then compute other
numbers than the samples alone through the fused kernel. So, with the family's native kernels on
the row's device, this adapter runs the same fused semantics over the trie: the tree conv, the
chunked SSD tree scan, the fused path's own gated RMSNorm (per group of ``dim // ngroups``
channels, ``norm_before_gate`` as mamba-ssm), the swiglu of the non-SSM part, the out projection.

Without native kernels for the device, or on another backend than auto/native, it rescans: the
bound fused kernel over every root-to-leaf path as a right-padded batch (exact; prefixes computed
once per path).

A tree row computes what the samples alone compute with the kernels the user bound, so the native
fused semantics run only where the samples alone would run a fused kernel. The mixers call the
fused seam and take their split path (conv seam, scan seam, their own gated norm, ``out_proj``)
when it answers None; so does the tree row, whose split seams then follow the trie. The adapter
declines (answers None) where the bound kernel -- the one the samples alone call, the seam's own
(``SeamCall.bound`` where backend ``stand_ins`` put a stand-in in its place) -- declines:

* transformers' torch fallback (it always answers None): declined without a call (the seam's
  binding is read per call, cached per seam object: ``sdk.bound_implementation``);
* a library kernel, where the row does not call it (the native route; backend ``stand_ins``, whose
  stand-in never declines): the adapter asks it. The bound kernel, called the way the model called
  the seam on a probe under ``torch.no_grad``, declines when it answers None (``_declines``). The
  probe is the first sample's opening tokens, as that sample alone sends them (batch 1, its first
  ``min(length, chunk_size)`` tokens, the mixer's own chunk size): a library kernel declines by
  the layer and its configuration (a quantized ``out_proj``, a dtype, an option it lacks), not by
  the tokens' values, and a causal kernel on a sample's opening tokens is that sample cut short.
  The answer is cached on the plan per layer: one plan serves every layer (its route,
  ``sdk.decide_route``, is one for all of them), and one layer's kernel may decline while
  another's does not, so the key is the call's signature (``_signature``): every parameter among
  the arguments (or the parameter a view is of: the conv weight) by identity, every other tensor by
  type, dtype, device and shape, every other argument by value. A checkpoint replay and any later
  forward of the same row on unchanged weights reuse the answer (the replay takes the same route);
  a weight replaced (a layer quantized) or written in place (an optimizer step) asks again. Cost:
  one forward of the bound kernel over at most ``chunk_size`` tokens (128 or 256 in released
  configs), no autograd, once per layer per plan: about ``chunk_size / N`` of the layer's forward
  over an N-token row (0.5% at N = 49,152 and chunk 256) plus the kernel's launches; per call, the
  signature (some twenty arguments) and a dictionary lookup;
* the rescan route calls the bound kernel over every path: when it answers None, the adapter
  declines too (no probe).

The bound kernel is taken to decline all of a layer's calls or none (by the layer, not by its
tokens); a kernel that answered None for some samples of a layer and not for others would split
the samples alone between two paths, which one tree row of that layer cannot follow.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tree_recurrence import sdk

from .stand_ins import rms_norm_gated

__all__ = ["split_conv1d_scan", "rms_norm_gated"]


def _rescan(call, zxbcdt: torch.Tensor) -> torch.Tensor | None:
    """The bound fused kernel over every root-to-leaf path, as the rows of a right-padded batch: its
    conv and scan are causal and the rest acts token by token, so the padding at a row's end never
    reaches a real token (exact, but the shared prefixes are computed once per path). None when the
    kernel answers None (it declines: the samples alone take the split path too)."""
    rows, source = call.path_rows(zxbcdt, 1)  # (paths, Lmax, d)
    out = call.call_original({"zxbcdt": rows})
    if out is None:
        return None
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.reshape(-1, out.shape[-1])[source].unsqueeze(0)


_SCALARS = (bool, int, float, str, torch.dtype, torch.device)


def _signature(value, held: list):
    """``value`` as part of a hashable key: a parameter (or a view of one: the conv weight's squeeze)
    by identity (appended to ``held``, which keeps it alive and its id unreused while the key is
    cached), another tensor by type, dtype, device and shape, a sequence or mapping item by item, a
    scalar by value, anything else by identity (held too)."""
    if isinstance(value, torch.Tensor):
        base = value if isinstance(value, torch.nn.Parameter) else value._base
        shape = (type(value), value.dtype, value.device, tuple(value.shape))
        if isinstance(base, torch.nn.Parameter):
            held.append(base)
            return ("parameter", id(base)) + shape
        return ("tensor",) + shape
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value),) + tuple(_signature(v, held) for v in value)
    if isinstance(value, dict):
        return (dict,) + tuple((k, _signature(v, held)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    held.append(value)
    return ("object", type(value), id(value))


def _declines(call, bound) -> bool:
    """Whether ``bound``, the library kernel the model's seam is bound to, declines this layer's call
    (answers None on a probe; see the module's docstring): cached on the plan per call signature, so
    per layer."""
    held: list = []
    arguments = {**call.named, **call.rest}
    key = tuple((name, _signature(arguments[name], held)) for name in sorted(arguments))
    return call.plan.cached(("fused declines", call.family, call.seam, key),
                            lambda: _probe(dataclasses.replace(call, original=bound)),
                            depends=(bound, sdk.instance_forward(bound), *held))


def _probe(call) -> bool:
    """Calls the call's kernel on the first sample's opening tokens (at most the call's chunk size) the
    way the model called the seam, without autograd; True when it answers None."""
    zxbcdt, plan = call.named["zxbcdt"], call.plan
    length = int(plan.array("path_offsets")[1])  # the first sample's tokens
    chunk = call.named.get("chunk_size")
    count = min(length, int(chunk) if isinstance(chunk, int) and chunk > 0 else 64)
    tokens = plan.cached(("fused probe tokens", count, zxbcdt.device),
                         lambda: plan.array("path_tokens")[:count].to(zxbcdt.device))
    with torch.no_grad():
        return call.call_original({"zxbcdt": zxbcdt.index_select(1, tokens)}) is None


def _decline(call, reason: str):
    """The fused seam declined (the manifest's ``declined``, None): the mixer takes its split path."""
    call.record("decline", f"{reason}: the mixer takes its split path")
    return call.spec.extra.get("declined")


def _decide(call, backend: str, policy, device: torch.device) -> sdk.Route:
    """The fused seam's route for a library kernel (``sdk.decide_route`` caches it on the plan, one
    for every layer; whether a layer's bound kernel declines is ``_declines``, per layer): native with
    the family's kernels on ``device`` (backend auto / native), else rescan."""
    implementation = sdk.bound_implementation(call.original)[0]
    record = sdk.families()[call.family]
    native = all(sdk.has_kernel(record, k, device) for k in ("tree_conv", "ssd_tree_scan"))
    if backend == "native" and not native:
        raise ValueError(f"{call.family}: backend 'native' has no tree_conv / ssd_tree_scan kernel for "
                         f"{device.type} in this build")
    if backend not in ("auto", "native") or not native:
        return sdk.Route("rescan", "fused seam: the bound kernel over every path as a padded batch")
    over_trie = "fused seam over the trie: tree conv, chunked SSD tree scan, gated norm, out_proj"
    strategy, reason = "native", over_trie
    if backend == "auto" and policy.strategy == "auto":  # the router: a tune record may order rescan first
        strategy, reason = sdk.route_decision(call, call.named["zxbcdt"], implementation, True, False,
                                              (strategy, reason))
    if strategy == "rescan":
        return sdk.Route("rescan", f"fused seam over every path as a padded batch: {reason}")
    return sdk.Route("native", reason, sdk.ops(call.family).ssd_tree_scan)


def split_conv1d_scan(call, backend: str, policy):
    """The fused seam over the trie (see the module's docstring). Returns out (1, N, hidden)."""
    named, rest = call.named, call.rest
    zxbcdt = named["zxbcdt"]
    if rest.get("return_final_states"):
        raise ValueError(f"{call.seam}: a tree-packed row has one final state per sample, not one per row; "
                         "call the model with use_cache=False")
    if rest.get("initial_states") is not None:
        raise ValueError(f"{call.seam}: initial_states on a tree-packed row are not supported by the fused seam")
    bound = call.bound if call.bound is not None else call.original  # what the samples alone call
    if not sdk.bound_implementation(bound)[2]:
        return _decline(call, "fused seam bound to transformers' torch fallback (None)")
    route = sdk.decide_route(call, backend, policy, zxbcdt.device, _decide)
    call.check_row(zxbcdt, 1, "zxbcdt")
    # the row calls no bound kernel on the native route, and a stand-in in its place under backend stand_ins
    if (route.strategy == "native" or bound is not call.original) and _declines(call, bound):
        return _decline(call, "the bound fused kernel declines this layer (None on a probe)")
    if route.strategy == "rescan":
        out = _rescan(call, zxbcdt)
        if out is None:
            return _decline(call, "the bound fused kernel answered None over every path")
        call.record(route.strategy, route.reason)
        return out

    weight, bias, dt_bias, A, D = (named.get(k) for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D"))
    activation = rest.get("activation", "silu")
    sdk.check_activation(call.seam, activation)
    ngroups = int(rest.get("ngroups", 1))
    if D.dim() == 1:
        headdim = rest.get("headdim")
        if headdim is None:
            raise ValueError(f"{call.seam}: headdim must be given when D is 1-D")
        nheads, headdim = D.shape[0], int(headdim)
    else:
        nheads, headdim = D.shape
    dim = nheads * headdim
    dstate = (weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or zxbcdt.shape[-1] != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads:
        raise ValueError(f"{call.seam}: zxbcdt's last dimension {zxbcdt.shape[-1]} does not split into "
                         f"2*d_nonssm + 2*{dim} + 2*{ngroups}*{dstate} + {nheads}")
    n = zxbcdt.shape[1]
    zx0, z, xBC, dt = torch.split(zxbcdt[0], [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)

    # tree conv over the trie (each token reads its own path's previous inputs)
    xBC = sdk.native_tree_conv(call.family, xBC.t().unsqueeze(0), weight, bias, activation, call.plan)[0].t()
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    rmsnorm_weight = rest.get("rmsnorm_weight")
    tables = call.plan.chunk_tables(int(call.spec.extra.get("chunk", 64)), zxbcdt.device)
    y = route.op(
        x.reshape(n, nheads, headdim), dt, B.reshape(n, ngroups, dstate), C.reshape(n, ngroups, dstate),
        tables.gather, tables.scatter, *tables.state_args(), None, A=A, dt_limit=list(rest.get("dt_limit", (0.0, float("inf")))),
        D=D, dt_bias=dt_bias, dt_softplus=True, z=z.reshape(n, nheads, headdim) if rmsnorm_weight is None else None)
    out = y.to(x.dtype).reshape(n, dim)  # the scan's output in the conv output's dtype, as mamba-ssm's
    if rmsnorm_weight is not None:
        out = rms_norm_gated(out, rmsnorm_weight, z, float(rest.get("rmsnorm_eps", 1e-6)), dim // ngroups,
                             bool(rest.get("norm_before_gate", True)))
    if d_nonssm > 0:
        gate, up = zx0.chunk(2, dim=-1)
        out = torch.cat([F.silu(gate) * up, out], dim=-1)
    outproj_weight, outproj_bias = rest.get("outproj_weight"), rest.get("outproj_bias")
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    elif outproj_bias is not None:
        raise ValueError(f"{call.seam}: outproj_bias without outproj_weight")
    call.record(route.strategy, route.reason)
    return out.unsqueeze(0)
