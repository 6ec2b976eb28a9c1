"""The ``scan`` adapter's strategies over the trie (``driver.run_scan`` picks one by the call's route):

* ``native`` -- the family's tree scan op on the plan's index tensors (or chunk tables);
* ``rescan`` -- the bound kernel over every root-to-leaf path once, varlen or as a padded batch;
* ``fork`` -- the bound kernel once per trie level, each segment from its parent's final state.

Each takes a bound ``SeamCall`` and returns the sequence output ``(1, N, ...)``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._plan import TreePlan
from ._seam_call import SeamCall


def _neutral_fill(call: SeamCall, name: str, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    value = float((call.spec.neutral or {}).get(name, 0.0))
    shape = valid.shape + (1,) * (rows.dim() - valid.dim())
    return torch.where(valid.reshape(shape), rows, value)


def _gather_rows(call: SeamCall, gather: torch.Tensor, valid: torch.Tensor) -> dict:
    """Every sequence tensor gathered to (rows, Lmax, ...) with state-neutral padding (``gather``
    clamped to valid indices, ``valid`` its mask)."""
    flat = gather.reshape(-1)
    return {name: _neutral_fill(call, name, _take(call.named[name][0], flat).reshape(*gather.shape, *call.named[name].shape[2:]),
                                valid) for name in call.spec.sequence}


def _gather_flat(call: SeamCall, tokens: torch.Tensor) -> dict:
    return {name: _take(call.named[name][0], tokens).unsqueeze(0) for name in call.spec.sequence}


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along dim 0 for a 1-D index (index_select: several times cheaper on the host than
    advanced indexing, the same autograd)."""
    return t.index_select(0, index)


def _output(result):
    """The sequence output of a bound kernel's result (first element of a tuple)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def scan_native(call: SeamCall, op):
    spec = call.spec
    native = spec.native
    named, rest = call.named, call.rest
    kwargs = {arg: rest.get(source, named.get(source, default)) for arg, (source, default) in native.kwargs.items()}
    inputs = [named[name][0] for name in spec.sequence]
    state = spec.state_args
    initial = None
    if state is not None:
        initial = named.get(state["initial_state"])
        if initial is None:
            initial = rest.get(state["initial_state"])
    chunk = native.chunk
    if chunk is not None:
        # Chunked native ops (native-op convention): the plan's chunk tables on the inputs' device.
        out = op(*inputs, *call.plan.chunk_op_args(chunk, inputs[0].device), initial, **kwargs)
    else:
        # Token-walking ops (native-op convention): the plan's index tensors on the inputs' device.
        device = inputs[0].device
        out = op(*inputs, call.plan.tensor("seg_offsets", device), call.plan.tensor("parents", device), initial, **kwargs)
    return out.unsqueeze(0)


def scan_rescan(call: SeamCall, varlen: bool):
    plan = call.plan
    device = call.named[call.spec.sequence[0]].device
    state = call.spec.state_args
    extra = {}
    if state:
        extra[state["output_final_state"]] = False
        initial = call.rest.pop(state["initial_state"], None)
        if initial is not None:
            extra[state["initial_state"]] = initial.expand(plan.num_leaves, *initial.shape[1:])
    if varlen:
        tokens = plan.tensor("path_tokens", device)
        cu = plan.tensor("path_offsets", device)
        out = _output(call.call_original(_gather_flat(call, tokens), **{call.spec.varlen["cu_seqlens"]: cu}, **extra))
        return out[0][plan.tensor("token_source", device)].unsqueeze(0)
    gather, source = plan.padded_paths(device)
    out = _output(call.call_original(_gather_rows(call, gather.clamp(min=0), gather >= 0), **extra))
    return out.reshape(-1, *out.shape[2:])[source].unsqueeze(0)


class ForkLevel(NamedTuple):
    """One trie level of the fork's tables."""

    count: int  # segments of the level
    token_start: int  # the level's tokens are order[token_start:token_end] (varlen form)
    token_end: int
    cu_seqlens: torch.Tensor  # of the level's segments
    grid_start: int  # the level's padded (count, width) grid is grid[grid_start:grid_end]
    grid_end: int
    width: int
    parent_position: torch.Tensor | None  # each segment's parent's position in the previous level (None at roots)


class ForkTables(NamedTuple):
    """The fork's tables of one plan and device (``fork_tables``)."""

    levels: list  # ForkLevel per trie level
    token_sizes: list  # tokens per level
    grid_sizes: list  # grid entries per level
    order: torch.Tensor  # the levels' tokens concatenated (varlen form)
    inverse: torch.Tensor  # each token's position in ``order``
    grid: torch.Tensor  # every level's padded grid flattened and concatenated, indices clamped to >= 0
    grid_valid: torch.Tensor  # which grid entries are real
    grid_source: torch.Tensor  # each token's position in ``grid``
    in_order: bool = False  # ``order`` is every token in token order (one level: a forest of chains)


def fork_tables(plan: TreePlan, device: torch.device) -> ForkTables:
    """The fork's tables, built once per plan and device from its index tensors (``plan.cached``), so
    that a fork call gathers every level's inputs in one op per tensor."""
    return plan.cached(("fork levels", device), lambda: _build_fork_tables(plan, device))


def _build_fork_tables(plan: TreePlan, device: torch.device) -> ForkTables:
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
        levels.append(ForkLevel(count, token_at, token_at + tokens.numel(), cu, grid_at, grid_at + count * width, width,
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
    # the levels' tokens are in token order exactly when the segments are numbered level by level (host
    # arrays: no device-to-host copy)
    in_order = bool(torch.equal(plan.array("level_segments"), torch.arange(plan.num_segments)))
    return ForkTables(levels, [lv.token_end - lv.token_start for lv in levels],
                      [lv.grid_end - lv.grid_start for lv in levels], order, inverse, grid.clamp(min=0), grid >= 0,
                      grid_source, in_order)


def scan_fork(call: SeamCall, varlen: bool):
    """One call of the bound kernel per trie level, every segment of a level starting from its parent's
    final state. Inputs of every level are gathered at once (one op per sequence tensor, none when the
    levels' tokens are already in token order), each level is a slice of them (one split per tensor),
    its initial states one index op over the previous level's finals, and the outputs return to token
    order in one op."""
    spec = call.spec
    names = spec.sequence
    named = call.named
    device = named[names[0]].device
    state = spec.state_args
    initial_name, final_name = state["initial_state"], state["output_final_state"]
    initial = call.rest.pop(initial_name, None)
    tables = fork_tables(call.plan, device)
    levels = tables.levels
    if varlen:
        cu_name = spec.varlen["cu_seqlens"]
        gathered = [named[name] if tables.in_order else named[name].index_select(1, tables.order) for name in names]
        sizes, dim = tables.token_sizes, 1
    else:
        gathered = [_neutral_fill(call, name, _take(named[name][0], tables.grid), tables.grid_valid) for name in names]
        sizes, dim = tables.grid_sizes, 0
    # every level's slice of every gathered tensor (one split per tensor; a one-level plan: the tensors)
    slices = [gathered] if len(levels) == 1 else zip(*(t.split_with_sizes(sizes, dim) for t in gathered))
    pieces, final = [], None
    last = len(levels) - 1
    for level, (lv, level_inputs) in enumerate(zip(levels, slices)):
        if lv.parent_position is None:
            init = None if initial is None else initial.expand(lv.count, *initial.shape[1:])
        else:
            if final is None:
                raise ValueError(f"{call.seam}: the bound kernel returned no final states although asked for them "
                                 f"({final_name}=True), and level {level} of the tree starts from "
                                 "them: bind a kernel that returns them, or use Policy(strategy='rescan')")
            init = final.index_select(0, lv.parent_position)
        # the last level's final states feed nothing: not asked for (a one-level plan, a forest of chains,
        # is one plain varlen call)
        extra = {final_name: level < last, initial_name: init}
        if varlen:
            extra[cu_name] = lv.cu_seqlens
            out, final = call.call_original(dict(zip(names, level_inputs)), **extra)
            pieces.append(out)  # (1, level tokens, ...)
        else:
            rows = {n: t.view(lv.count, lv.width, *t.shape[1:]) for n, t in zip(names, level_inputs)}
            out, final = call.call_original(rows, **extra)
            pieces.append(out.reshape(-1, *out.shape[2:]))
    if varlen:  # the levels' outputs joined along time, back in token order: (1, N, ...)
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)
        return out if tables.in_order else out.index_select(1, tables.inverse)
    return _take(torch.cat(pieces), tables.grid_source).unsqueeze(0)
