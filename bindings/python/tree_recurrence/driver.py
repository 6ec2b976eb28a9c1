"""The driver: runs a seam call over the trie, generically, from the family manifest's adapter spec.

The adapters (docs/plugins.md):

* ``conv`` -- a causal depthwise conv over channels-first ``(1, C, N)``: the family's native
  ``tree_conv`` op (each token reads its own path's last inputs), or, through the bound kernel,
  every root-to-leaf path as one row of a right-padded batch.
* ``scan`` -- a recurrence over time-major ``(1, N, ...)`` tensors: ``native`` (the family's tree
  scan op), ``fork`` (one call per trie level, initial states from the parents' final states,
  varlen when the bound kernel takes ``cu_seqlens``, else a padded batch whose padding is
  state-neutral), or ``rescan`` (every path once, varlen or padded).
* ``decline`` -- a fused seam whose caller has an unfused path: answers None (the split path runs).
* ``family`` -- a seam the family runs in its own Python (its manifest's ``python: {adapters: ...}``).

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


def _instance_forward(seam: Any) -> Any:
    """A hub seam's (nn.Module's) instance-level forward: kernelize swaps it on the object."""
    return seam.__dict__.get("forward") if isinstance(seam, torch.nn.Module) else None


def bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """Cached per seam object and its instance forward (seams are module globals, alive while bound; a
    kernel that kernelize puts on a hub seam's instance is read again)."""
    forward = _instance_forward(seam)
    cached = _bound_cache.get(id(seam))
    if cached is not None and cached[0] is seam and cached[1] is forward:
        return cached[2]
    found = _find_bound_implementation(seam)
    _bound_cache[id(seam)] = (seam, forward, found)
    return found


def _hub_wrapper_inside(f: Any, depth: int = 4) -> Any:
    """transformers' use_kernel_func_from_hub_with_fallback wrapper (its closure holds
    ``implementation`` and ``applicable_params``) at ``f`` or inside it (``__wrapped__``, bound
    methods, closure cells: a profiler or spy around the seam), or None."""
    frontier, seen = [f], set()
    for _ in range(depth):
        following = []
        for item in frontier:
            if item is None or id(item) in seen or isinstance(item, type):
                continue
            seen.add(id(item))
            code, closure = getattr(item, "__code__", None), getattr(item, "__closure__", None)
            if code is not None and closure:
                cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
                if "implementation" in cells and "applicable_params" in cells:
                    return item
                following += list(cells.values())
            following += [getattr(item, "__wrapped__", None), getattr(item, "__func__", None)]
        frontier = following
    return None


def _takes_keyword(f: Any, name: str) -> bool:
    """Whether ``f`` takes keyword ``name``: a parameter of that name, or ``**kwargs``."""
    import inspect

    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _find_bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """(implementation, named parameters, is_library_kernel) of a transformers seam object.

    transformers wraps each seam with use_kernel_func_from_hub_with_fallback, which picks a
    library kernel (or the torch reference) at import and drops every keyword the pick does not
    name; with the `kernels` package the seam is an nn.Module around that wrapper.
    """
    f = seam
    if isinstance(f, torch.nn.Module):
        if _instance_forward(f) is not None:  # kernelize put a kernel on the instance
            f = _instance_forward(f)
        else:
            forward = type(f).forward
            cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__ or ())))
            f = cells.get("func", f)
    hub = _hub_wrapper_inside(f)
    if hub is not None:
        cells = dict(zip(hub.__code__.co_freevars, (c.cell_contents for c in hub.__closure__)))
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


@dataclass(frozen=True)
class Route:
    """What a seam call does, decided once per (plan, family, seam, spec, device, backend) and cached on
    the plan (``TreePlan.routes``): the strategy and why, the native op's handle, whether the bound
    kernel takes ``cu_seqlens`` and whether it is a library kernel. A seam call after the first is a
    dictionary lookup plus the op."""

    strategy: str
    reason: str
    op: Any = None
    varlen: bool = False
    is_library: bool = True
    kernel: Any = None  # call this instead of the seam object (its keyword filter would drop cu_seqlens)


def _route(call: SeamCall, backend: str, policy: Policy, device: torch.device, decide: Callable) -> Route:
    """The cached route, or ``decide(call, backend, policy, device)``'s, cached. The entry holds the policy,
    the bound kernel and the spec it was decided for (a different one decides again; holding them keeps
    their ids from being reused while the plan lives)."""
    key = (call.family, call.seam, id(call.spec), device, backend)
    entry = call.plan.routes.get(key)
    forward = _instance_forward(call.original)  # kernelize may swap it: decide again then
    if (entry is not None and entry[0] is policy and entry[1] is call.original and entry[2] is call.spec
            and entry[4] is forward):
        return entry[3]
    route = decide(call, backend, policy, device)
    call.plan.routes[key] = (policy, call.original, call.spec, route, forward)
    return route


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
    return _tree_conv_op(plugins.ops(family).tree_conv, x, weight, bias, activation, plan)


def _tree_conv_op(op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  plan: TreePlan) -> torch.Tensor:
    width = weight.shape[-1]
    ancestors, reader_offsets, readers = plan.conv_tables(width, x.device)
    y = op(x[0].transpose(0, 1), weight.reshape(weight.shape[0], width), bias, ancestors, reader_offsets, readers,
           activation is not None)
    return y.transpose(0, 1).unsqueeze(0)


def _decide_conv(call: SeamCall, backend: str, policy: Policy, device: torch.device) -> Route:
    native = plugins.has_kernel(plugins.families()[call.family], "tree_conv", device)
    _, _, is_library = bound_implementation(call.original)
    if backend in ("auto", "native") and native:
        return Route("native", "native tree conv", plugins.ops(call.family).tree_conv, is_library=is_library)
    if backend == "native":
        raise ValueError(f"{call.family}: backend 'native' has no tree_conv kernel for {device.type} in this build")
    return Route("rescan", "conv over every path as a padded batch of the bound kernel", is_library=is_library)


# Seam dispatch is host work (policy, plan tables, kernel lookup) around native ops or bound
# kernels: under torch.compile it runs eagerly, one graph break per seam call.
@torch.compiler.disable
def run_conv(call: SeamCall, backend: str, policy: Policy) -> torch.Tensor:
    x_name, w_name, b_name, act_name = call.spec["args"][:4]
    x = call.named[x_name]
    _check_row(call, x, 2, x_name)
    route = _route(call, backend, policy, x.device, _decide_conv)
    _record(call, route.strategy, route.reason)
    if route.op is not None:
        activation = call.named.get(act_name)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"tree_conv: activation must be None, 'silu' or 'swish', got {activation!r}")
        return _tree_conv_op(route.op, x, call.named[w_name], call.named.get(b_name), activation, call.plan)
    _warn_reference(call, route.is_library)
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
    value = float(call.spec.get("neutral", {}).get(name, 0.0))
    shape = valid.shape + (1,) * (rows.dim() - valid.dim())
    return torch.where(valid.reshape(shape), rows, value)


def _gather_rows(call: SeamCall, gather: torch.Tensor, valid: torch.Tensor) -> dict:
    """Every sequence tensor gathered to (rows, Lmax, ...) with state-neutral padding (``gather``
    clamped to valid indices, ``valid`` its mask)."""
    flat = gather.reshape(-1)
    return {name: _neutral_fill(call, name, _take(call.named[name][0], flat).reshape(*gather.shape, *call.named[name].shape[2:]),
                                valid) for name in call.spec["sequence"]}


def _gather_flat(call: SeamCall, tokens: torch.Tensor) -> dict:
    return {name: _take(call.named[name][0], tokens).unsqueeze(0) for name in call.spec["sequence"]}


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along dim 0 for a 1-D index (index_select: several times cheaper on the host than
    advanced indexing, the same autograd)."""
    return t.index_select(0, index)


def _output(call: SeamCall, result):
    """The sequence output of a bound kernel's result (first element of a tuple)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _finish(call: SeamCall, output: torch.Tensor):
    """The seam's return value in the shape the model expects: the output, other results None."""
    arity = call.spec.get("returns", 1)
    return output if arity == 1 else (output,) + (None,) * (arity - 1)


def _scan_native(call: SeamCall, op):
    native = call.spec["native"]
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
        # Token-walking ops (native-op convention): the plan's index tensors on the inputs' device.
        device = inputs[0].device
        out = op(*inputs, call.plan.tensor("seg_offsets", device), call.plan.tensor("parents", device), initial, **kwargs)
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
    out = _output(call, call.call_original(_gather_rows(call, gather.clamp(min=0), gather >= 0), **extra))
    return out.reshape(-1, *out.shape[2:])[source].unsqueeze(0)


def _fork_levels(plan: TreePlan, device: torch.device) -> dict:
    """The fork's tables, built once per plan and device from its index tensors (cached in
    ``plan.routes``), so that a fork call gathers every level's inputs in one op per tensor:

    * ``levels``: per trie level (segments, first and end position in ``order``, cu_seqlens of its
      segments, first and end position in ``grid``, padded width, each segment's parent's position in
      the previous level (None at the roots));
    * ``order``: the levels' tokens concatenated (varlen form) and ``inverse``, each token's position there;
    * ``grid`` / ``grid_valid``: every level's padded (segments, width) grid flattened and concatenated
      (indices clamped to >= 0, and which are real) and ``grid_source``, each token's position there."""
    key = ("fork levels", device)
    cached = plan.routes.get(key)
    if cached is not None:
        return cached
    parents = plan.array("parents")
    position = torch.empty(plan.num_segments, dtype=torch.int64)  # a segment's position in its level
    levels, order, grids, sources = [], [], [], []
    token_at, grid_at = 0, 0
    for level in range(plan.num_levels):
        segments, gather, tokens, source = plan.padded_level(level, device)
        position[segments] = torch.arange(len(segments))
        lengths = plan.array("seg_lengths")[segments]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]).to(device)
        parent_position = position[parents[segments]].to(device) if level > 0 else None
        count, width = gather.shape
        levels.append((count, token_at, token_at + tokens.numel(), cu, grid_at, grid_at + count * width, width,
                       parent_position))
        order.append(tokens)
        grids.append(gather.reshape(-1))
        sources.append(source + grid_at)
        token_at += tokens.numel()
        grid_at += count * width
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    grid = torch.cat(grids)
    grid_source = torch.empty_like(order)
    grid_source[order] = torch.cat(sources)
    tables = {"levels": levels, "token_sizes": [t1 - t0 for _, t0, t1, *_ in levels],
              "grid_sizes": [g1 - g0 for _, _, _, _, g0, g1, _, _ in levels], "order": order, "inverse": inverse, "grid": grid.clamp(min=0), "grid_valid": grid >= 0,
              "grid_source": grid_source}
    plan.routes[key] = tables
    return tables


def _scan_fork(call: SeamCall, varlen: bool):
    """One call of the bound kernel per trie level, every segment of a level starting from its parent's
    final state. Inputs of every level are gathered at once (one op per sequence tensor), each level is
    a slice of them, its initial states one index op over the previous level's finals, and the outputs
    return to token order in one op."""
    device = call.named[call.spec["sequence"][0]].device
    state = call.spec["state_args"]
    initial = call.rest.pop(state["initial_state"], None)
    tables = _fork_levels(call.plan, device)
    names = call.spec["sequence"]
    if varlen:
        cu_name = call.spec["varlen"]["cu_seqlens"]
        gathered = {name: call.named[name].index_select(1, tables["order"]) for name in names}
    else:
        valid = tables["grid_valid"]
        gathered = {name: _neutral_fill(call, name, _take(call.named[name][0], tables["grid"]), valid) for name in names}
    # every level's slice of every gathered tensor (one split per tensor)
    slices = zip(*(t.split_with_sizes(tables["token_sizes"] if varlen else tables["grid_sizes"], 1 if varlen else 0)
                   for t in gathered.values()))
    pieces, final = [], None
    for (count, _, _, cu, _, _, width, parent_position), level_inputs in zip(tables["levels"], slices):
        level = len(pieces)
        if parent_position is None:
            init = None if initial is None else initial.expand(count, *initial.shape[1:])
        else:
            if final is None:
                raise ValueError(f"{call.seam}: the bound kernel returned no final states although asked for them "
                                 f"({state['output_final_state']}=True), and level {level} of the tree starts from "
                                 "them: bind a kernel that returns them, or use Policy(strategy='rescan')")
            init = final.index_select(0, parent_position)
        # the last level's final states feed nothing: not asked for (a one-level plan, a forest of chains,
        # is one plain varlen call)
        extra = {state["output_final_state"]: level < len(tables["levels"]) - 1, state["initial_state"]: init}
        if varlen:
            out, final = call.call_original(dict(zip(names, level_inputs)), **{cu_name: cu}, **extra)
            pieces.append(out[0])
        else:
            rows = {n: t.view(count, width, *t.shape[1:]) for n, t in zip(names, level_inputs)}
            out, final = call.call_original(rows, **extra)
            pieces.append(out.reshape(-1, *out.shape[2:]))
    return _take(torch.cat(pieces), tables["inverse"] if varlen else tables["grid_source"]).unsqueeze(0)


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
    route = _route(call, backend, policy, first.device, _decide_scan)
    _record(call, route.strategy, route.reason)
    if route.strategy == "native":
        return _finish(call, _scan_native(call, route.op))
    _warn_reference(call, route.is_library)
    if route.kernel is not None:
        call.original = route.kernel
    if route.strategy == "fork":
        return _finish(call, _scan_fork(call, route.varlen))
    return _finish(call, _scan_rescan(call, route.varlen))


def _decide_scan(call: SeamCall, backend: str, policy: Policy, device: torch.device) -> Route:
    spec = call.spec
    op_name = spec["native"]["op"] if "native" in spec else None
    native = op_name is not None and plugins.has_kernel(plugins.families()[call.family], op_name, device)
    implementation, params, is_library = bound_implementation(call.original)
    cu_name = spec["varlen"]["cu_seqlens"] if "varlen" in spec else None
    # The manifest says the family's library kernels take cu_seqlens: a library kernel that names it, or
    # takes **kwargs (FLA passes it there) or keyword-only parameters, is varlen. Through **kwargs only,
    # transformers' wrapper would filter it out: then the implementation is called directly.
    varlen = cu_name is not None and (cu_name in params or (is_library and _takes_keyword(implementation, cu_name)))
    kernel = implementation if varlen and cu_name not in params else None
    fork = spec.get("state_args") is not None and (varlen or "neutral" in spec)
    if backend == "native":
        if not native:
            raise ValueError(f"{call.family}: backend 'native' has no {op_name or 'tree scan'} kernel "
                             f"for {device.type} in this build")
        strategy, reason = "native", "backend native"
    else:
        strategy, reason = policy.choose(call.plan, native and backend == "auto", fork)
    op = getattr(plugins.ops(call.family), op_name) if strategy == "native" else None
    return Route(strategy, reason, op, varlen, is_library, kernel)


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
