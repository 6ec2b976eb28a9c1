"""The driver: runs a seam call over the trie, generically, from the family manifest's adapter spec.

Two adapters cover every family so far (docs/plugins.md):

* ``conv`` -- a causal depthwise conv over channels-first ``(1, C, N)``: the family's native
  ``tree_conv`` op (each token reads its own path's last inputs), or, through the bound kernel,
  every root-to-leaf path as one row of a right-padded batch.
* ``scan`` -- a recurrence over time-major ``(1, N, ...)`` tensors: ``native`` (the family's tree
  scan op), ``fork`` (one call per trie level, initial states from the parents' final states,
  varlen when the bound kernel takes ``cu_seqlens``, else a padded batch whose padding is
  state-neutral), or ``rescan`` (every path once, varlen or padded).

No family appears here by name: the manifest says which arguments are which.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import plugins
from ._plan import TREE_FIELDS, TreePlan
from .policy import Policy

logger = logging.getLogger("tree_recurrence")

# Recent strategy decisions, newest last: (family, seam, strategy, reason). For tests and debugging.
decisions: collections.deque = collections.deque(maxlen=256)
_warned_reference: set = set()

# Keywords of packed-row kernels that the driver sets itself; a caller's own are refused.
_DRIVER_KEYWORDS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


@dataclass
class SeamCall:
    """One intercepted call, its arguments bound to the names the manifest uses."""

    family: str
    seam: str
    spec: dict
    original: Callable
    plan: TreePlan
    named: dict
    rest: dict  # other keywords, tree_* removed
    positional: int  # how many of the manifest's arguments the model passed positionally

    @classmethod
    def bind(cls, family, seam, spec, original, plan, args, kwargs) -> "SeamCall":
        names = spec["args"]
        if len(args) > len(names):
            raise TypeError(f"{seam}: got {len(args)} positional arguments, the {family} manifest names {len(names)}")
        named = dict(zip(names, args))
        rest = {k: v for k, v in kwargs.items() if k not in TREE_FIELDS and not k.startswith("tree_")}
        for name in names[len(args):]:
            if name in rest:
                named[name] = rest.pop(name)
        for key in _DRIVER_KEYWORDS:
            if rest.get(key) is not None:
                raise ValueError(f"{seam}: got both tree_* kwargs and '{key}'; a tree-packed row carries its own boundaries")
            rest.pop(key, None)
        return cls(family, seam, spec, original, plan, named, rest, len(args))

    def call_original(self, inputs: dict, **extra):
        """Calls the bound kernel the way the model called the seam (same positional arguments,
        same keywords), with ``inputs`` replacing arguments and ``extra`` added or replacing
        keywords. Library kernels order their parameters differently from the torch references
        (causal-conv1d puts seq_idx before activation), so keywords must stay keywords."""
        names = self.spec["args"]
        value = lambda n: inputs.get(n, self.named.get(n))  # noqa: E731
        positional = [value(n) for n in names[: self.positional]]
        keywords = {n: value(n) for n in names[self.positional:] if n in self.named or n in inputs}
        return self.original(*positional, **{**self.rest, **keywords, **extra})


_bound_cache: dict[int, tuple[Any, Any]] = {}


def bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """Cached per seam object (seams are module globals, alive while bound)."""
    cached = _bound_cache.get(id(seam))
    if cached is not None and cached[0] is seam:
        return cached[1]
    found = _find_bound_implementation(seam)
    _bound_cache[id(seam)] = (seam, found)
    return found


def _find_bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """(implementation, named parameters, is_library_kernel) of a transformers seam object.

    transformers wraps each seam with use_kernel_func_from_hub_with_fallback, which picks a
    library kernel (or the torch reference) at import and drops every keyword the pick does not
    name; with the `kernels` package the seam is an nn.Module around that wrapper.
    """
    f = seam
    if isinstance(f, torch.nn.Module):
        forward = type(f).forward
        cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__ or ())))
        f = cells.get("func", f)
    code = getattr(f, "__code__", None)
    if code is not None and f.__closure__:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in f.__closure__)))
        if "implementation" in cells and "applicable_params" in cells:
            return cells["implementation"], tuple(cells["applicable_params"]), bool(cells.get("is_new_implementation"))
    import inspect

    try:
        params = tuple(inspect.signature(f).parameters)
    except (TypeError, ValueError):
        params = ()
    return f, params, True


def _check_row(call: SeamCall, tensor: torch.Tensor, time_dim: int, what: str) -> None:
    n = call.plan.num_tokens
    if tensor.shape[0] != 1 or tensor.shape[time_dim] != n:
        raise ValueError(
            f"{call.seam}: {what} has shape {tuple(tensor.shape)}, expected batch 1 and {n} tokens (the tree-packed row). "
            "Tree-packed rows need use_cache=False (no past states) and one packed row per forward."
        )


def _warn_reference(call: SeamCall, is_library: bool) -> None:
    if not is_library and call.seam not in _warned_reference:
        _warned_reference.add(call.seam)
        logger.warning(
            "tree_recurrence: %s runs on transformers' PyTorch reference (no kernel library installed); "
            "correct but slow", call.seam)


def _record(call: SeamCall, strategy: str, reason: str) -> None:
    decisions.append((call.family, call.seam, strategy, reason))
    logger.debug("tree_recurrence: %s/%s -> %s (%s)", call.family, call.seam, strategy, reason)


# --------------------------------------------------------------------------------------------
# conv
# --------------------------------------------------------------------------------------------


def tree_conv(family: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              plan: TreePlan) -> torch.Tensor:
    """The family's native tree conv on a channels-first ``(1, C, N)`` row; returns ``(1, C, N)``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"tree_conv: activation must be None, 'silu' or 'swish', got {activation!r}")
    width = weight.shape[-1]
    weight = weight.reshape(weight.shape[0], width)
    ancestors, reader_offsets, readers = plan.conv_tables(width, x.device)
    y = plugins.ops(family).tree_conv(x[0].transpose(0, 1), weight, bias, ancestors, reader_offsets, readers,
                                      activation is not None)
    return y.transpose(0, 1).unsqueeze(0)


# Seam dispatch is host work (policy, plan tables, kernel lookup) around native ops or bound
# kernels: under torch.compile it runs eagerly, one graph break per seam call.
@torch.compiler.disable
def run_conv(call: SeamCall, backend: str, policy: Policy) -> torch.Tensor:
    x_name, w_name, b_name, act_name = call.spec["args"][:4]
    x = call.named[x_name]
    _check_row(call, x, 2, x_name)
    record = plugins.families()[call.family]
    native = plugins.has_kernel(record, "tree_conv", x.device)
    if backend in ("auto", "native") and native:
        _record(call, "native", "native tree conv")
        return tree_conv(call.family, x, call.named[w_name], call.named.get(b_name), call.named.get(act_name), call.plan)
    if backend == "native":
        raise ValueError(f"{call.family}: backend 'native' has no tree_conv kernel for {x.device.type} in this build")
    _record(call, "rescan", "conv over every path as a padded batch of the bound kernel")
    _, _, is_library = bound_implementation(call.original)
    _warn_reference(call, is_library)
    gather, source = call.plan.padded_paths(x.device)
    rows = x[0][:, gather.clamp(min=0)] * (gather >= 0).to(x.dtype)  # (C, P, Lmax), zero padding
    y = call.call_original({x_name: rows.permute(1, 0, 2)})
    if isinstance(y, tuple):
        y = y[0]
    channels = y.shape[1]
    return y.permute(1, 0, 2).reshape(channels, -1)[:, source].unsqueeze(0)


# --------------------------------------------------------------------------------------------
# scan
# --------------------------------------------------------------------------------------------


def _neutral_fill(call: SeamCall, name: str, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    value = call.spec.get("neutral", {}).get(name, 0.0)
    shape = valid.shape + (1,) * (rows.dim() - valid.dim())
    return torch.where(valid.reshape(shape), rows, torch.as_tensor(value, dtype=rows.dtype, device=rows.device))


def _gather_rows(call: SeamCall, gather: torch.Tensor) -> dict:
    """Every sequence tensor gathered to (rows, Lmax, ...) with state-neutral padding."""
    valid = gather >= 0
    out = {}
    for name in call.spec["sequence"]:
        t = call.named[name][0]
        out[name] = _neutral_fill(call, name, t[gather.clamp(min=0)], valid)
    return out


def _gather_flat(call: SeamCall, tokens: torch.Tensor) -> dict:
    return {name: call.named[name][0][tokens].unsqueeze(0) for name in call.spec["sequence"]}


def _output(call: SeamCall, result):
    """The sequence output of a bound kernel's result (first element of a tuple)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _finish(call: SeamCall, output: torch.Tensor):
    """The seam's return value in the shape the model expects: the output, other results None."""
    arity = call.spec.get("returns", 1)
    return output if arity == 1 else (output,) + (None,) * (arity - 1)


def _scan_native(call: SeamCall):
    native = call.spec["native"]
    op = getattr(plugins.ops(call.family), native["op"])
    kwargs = {arg: call.rest.get(source, call.named.get(source, default)) for arg, (source, default) in native.get("kwargs", {}).items()}
    inputs = [call.named[name][0] for name in call.spec["sequence"]]
    initial = call.named.get(call.spec["state_args"]["initial_state"]) if "state_args" in call.spec else None
    if initial is None and "state_args" in call.spec:
        initial = call.rest.get(call.spec["state_args"]["initial_state"])
    if "chunk" in native:
        # Chunked native ops (native-op convention): the plan's chunk tables on the inputs' device.
        tables = call.plan.chunk_tables(native["chunk"], inputs[0].device)
        out = op(*inputs, tables.gather, tables.scatter, *tables.state_args(), initial, **kwargs)
    else:
        out = op(*inputs, call.plan.array("seg_offsets"), call.plan.array("parents"), initial, **kwargs)
    return out.unsqueeze(0)


def _scan_rescan(call: SeamCall, varlen: bool):
    plan = call.plan
    device = call.named[call.spec["sequence"][0]].device
    state = call.spec.get("state_args", {})
    extra = {}
    if state:
        extra[state["output_final_state"]] = False
        initial = call.rest.pop(state["initial_state"], None)
        if initial is not None:
            extra[state["initial_state"]] = initial.expand(plan.num_leaves, *initial.shape[1:])
    if varlen:
        tokens = plan.tensor("path_tokens", device)
        cu = plan.tensor("path_offsets", device)
        out = _output(call, call.call_original(_gather_flat(call, tokens), **{call.spec["varlen"]["cu_seqlens"]: cu}, **extra))
        return out[0][plan.tensor("token_source", device)].unsqueeze(0)
    gather, source = plan.padded_paths(device)
    out = _output(call, call.call_original(_gather_rows(call, gather), **extra))
    return out.reshape(-1, *out.shape[2:])[source].unsqueeze(0)


def _scan_fork(call: SeamCall, varlen: bool):
    plan = call.plan
    device = call.named[call.spec["sequence"][0]].device
    state = call.spec["state_args"]
    initial = call.rest.pop(state["initial_state"], None)
    parents = plan.array("parents").tolist()
    finals: dict[int, torch.Tensor] = {}
    pieces, positions = [], []
    for level in range(plan.num_levels):
        segments, gather, tokens, source = plan.padded_level(level, device)
        segments = segments.tolist()
        if level == 0:
            init = None if initial is None else initial.expand(len(segments), *initial.shape[1:])
        else:
            init = torch.stack([finals[parents[s]] for s in segments])
        extra = {state["output_final_state"]: True, state["initial_state"]: init}
        if varlen:
            lengths = plan.array("seg_lengths")[segments]
            cu = torch.zeros(len(segments) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(lengths, 0)
            out, final = call.call_original(_gather_flat(call, tokens), **{call.spec["varlen"]["cu_seqlens"]: cu.to(device)}, **extra)
            pieces.append(out[0])
        else:
            out, final = call.call_original(_gather_rows(call, gather), **extra)
            pieces.append(out.reshape(-1, *out.shape[2:])[source])
        positions.append(tokens)
        for i, s in enumerate(segments):
            finals[s] = final[i]
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(pieces)[inverse].unsqueeze(0)


@torch.compiler.disable  # see run_conv
def run_scan(call: SeamCall, backend: str, policy: Policy):
    spec = call.spec
    first = call.named[spec["sequence"][0]]
    _check_row(call, first, 1, spec["sequence"][0])
    state = spec.get("state_args")
    if state and call.rest.get(state["output_final_state"]):
        raise ValueError(
            f"{call.seam}: a tree-packed row has one final state per sample, not one per row; "
            "call the model with use_cache=False")
    record = plugins.families()[call.family]
    native = "native" in spec and plugins.has_kernel(record, spec["native"]["op"], first.device)
    _, params, is_library = bound_implementation(call.original)
    varlen = "varlen" in spec and spec["varlen"]["cu_seqlens"] in params
    fork = state is not None and (varlen or "neutral" in spec)
    if backend == "native":
        if not native:
            raise ValueError(f"{call.family}: backend 'native' has no {spec.get('native', {}).get('op', 'tree scan')} kernel "
                             f"for {first.device.type} in this build")
        strategy, reason = "native", "backend native"
    else:
        strategy, reason = policy.choose(call.plan, native and backend == "auto", fork)
    _record(call, strategy, reason)
    if strategy == "native":
        return _finish(call, _scan_native(call))
    _warn_reference(call, is_library)
    if strategy == "fork":
        return _finish(call, _scan_fork(call, varlen))
    return _finish(call, _scan_rescan(call, varlen))


@torch.compiler.disable  # see run_conv
def run_decline(call: SeamCall, backend: str, policy: Policy):
    """For fused seams whose callers have an unfused path: answer what the model's own reference
    answers when it cannot fuse (the manifest's ``declined``, None by default), so the mixer takes
    its split path, whose seams follow the tree."""
    _record(call, "decline", "fused seam declined; the mixer takes its split path")
    return call.spec.get("declined")


@torch.compiler.disable  # see run_conv
def run_family(call: SeamCall, backend: str, policy: Policy):
    """Seams a family runs in its own Python: the manifest's ``adapter: family`` with ``function:``,
    a function ``(call, backend, policy)`` of the module its ``python: {adapters: ...}`` names."""
    module = plugins.family_python(call.family, "adapters")
    function = getattr(module, call.spec.get("function") or "", None) if module is not None else None
    if function is None:
        raise ValueError(f"{call.family}: seam '{call.seam}' uses adapter 'family', but the family's Python "
                         f"'adapters' module has no function {call.spec.get('function')!r}")
    return function(call, backend, policy)


ADAPTERS = {"conv": run_conv, "scan": run_scan, "decline": run_decline, "family": run_family}
