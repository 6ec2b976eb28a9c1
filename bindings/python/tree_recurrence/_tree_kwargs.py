"""A forward's ``tree_*`` kwargs -> its TreePlan (``tree_plan``), built once and cached on
``tree_cu_seqlens_q``: TRL's tree formats (TRL 1.16's key paths, segment parents / depths,
huggingface/trl#7686's level sizes, size header and chunk count), fields given as tensors or int
sequences, and a collated row's padding, which must be exactly padding."""

from __future__ import annotations

import functools
import operator
from typing import Any, Mapping

import torch

from ._plan import TreePlan, tensor_version
from ._engine import ENGINE

# Keyword names a trainer passes to the model's forward (docs/tree-format.md).
CU_SEQLENS_Q = "tree_cu_seqlens_q"
KV_INDEX = "tree_kv_index"
CU_SEQLENS_K = "tree_cu_seqlens_k"
SEGMENT_PARENTS = "tree_segment_parents"
SEGMENT_DEPTHS = "tree_segment_depths"
TREE_FIELDS = (CU_SEQLENS_Q, KV_INDEX, CU_SEQLENS_K, SEGMENT_PARENTS, SEGMENT_DEPTHS)
# huggingface/trl#7686's fields (docs/tree-format.md): ``tree_level_sizes``, segments per trie level
# (root level first); ``tree_sizes``, ``[max_q, max_k, n_kv, n_chunks, *level sizes]``; both zero-padded
# after the levels by its collator and checked against the plan. ``tree_n_chunks`` (an int) is how many
# chunks its kernel splits the row into: checked to be a non-negative integer, and not used otherwise.
LEVEL_SIZES, SIZES, N_CHUNKS = "tree_level_sizes", "tree_sizes", "tree_n_chunks"
LEVEL_FIELDS = (LEVEL_SIZES, SIZES)
# tree_sizes' header: (name, what it is, the plan's value), before the level sizes.
_SIZES_HEADER = (("max_q", "longest segment (tree_max_seqlen_q)", lambda plan: plan.max_segment_length),
                 ("max_k", "longest key path, root to a segment's end (tree_max_seqlen_k)",
                  lambda plan: plan.max_path_length),
                 ("n_kv", "key-index length, every segment's key path end to end (tree_cu_seqlens_k[-1])",
                  lambda plan: int((plan.array("segment_start") + plan.array("seg_lengths")).sum())),
                 ("n_chunks", None, None))

_CACHE_ATTR = "_tree_recurrence_plan"


def index_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` as an index tensor: a tensor as it is; a sequence of ints (a list or tuple, or a list
    of one such row, as a collator or a hand-built row may pass them) as an int64 CPU tensor. Anything
    else, and a sequence holding anything but ints (floats, bools, ragged rows), is a ValueError naming
    ``name``. The caller checks dtype and shape as for any tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected a torch.Tensor or a sequence of ints, got {type(value).__name__}")
    try:
        tensor = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name}: expected a sequence of ints (or one row of them), got {_abbreviated(value)}: "
                         f"{error}") from None
    if tensor.numel() == 0:
        return tensor.to(torch.int64).reshape(tensor.shape)
    if tensor.dtype in (torch.bool, torch.uint8) or tensor.is_floating_point() or tensor.is_complex():
        position = _first_non_int(value)
        raise ValueError(f"{name}: expected a sequence of ints, got {_abbreviated(value)}"
                         + (f" (entry {position} is {_entry(value, position)!r})" if position is not None else ""))
    return tensor.to(torch.int64)


def _abbreviated(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_non_int(value: Any):
    """The position (an int, or (row, column)) of the first entry of a sequence that is not an int."""
    for i, v in enumerate(value):
        if isinstance(v, (list, tuple)):
            inner = _first_non_int(v)
            if inner is not None:
                return (i, inner)
        elif isinstance(v, bool) or not isinstance(v, int):
            try:
                if isinstance(v, bool):
                    raise TypeError
                operator.index(v)  # numpy's integers pass
            except TypeError:
                return i
    return None


def _entry(value: Any, position):
    if isinstance(position, tuple):
        return _entry(value[position[0]], position[1])
    return value[position]


def _as_index_vector(name: str, value: Any, device: torch.device | None) -> torch.Tensor:
    value = index_tensor(name, value)
    if value.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {value.dtype}")
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1:
        rows = f"a collated batch of {value.shape[0]} rows" if value.dim() == 2 else "not one packed row"
        raise ValueError(
            f"{name}: expected a 1-D tensor (one packed row, batch size 1), got shape {tuple(value.shape)} ({rows}); "
            "forward one row at a time: tree_recurrence.integrations.trl.tree_kwargs_from_batch(batch, row=i) "
            "gives row i's forward kwargs without the collator's padding"
        )
    if device is not None and value.device != device:
        raise ValueError(f"{name}: is on {value.device} but {CU_SEQLENS_Q} is on {device}; all tree tensors must share a device")
    return value


def row_length(kwargs: Mapping[str, Any]) -> int | None:
    """Tokens of the packed row a model forward received (``input_ids`` (1, N) or ``inputs_embeds``
    (1, N, H)), or None when neither is there. Plan carriers refuse a plan with more tokens than
    this (a longer row is a padded one); building that plan first costs O(segments) only."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() in (1, 2) and (ids.dim() == 1 or ids.shape[0] == 1):
        return int(ids.shape[-1])
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and embeds.shape[0] == 1:
        return int(embeds.shape[1])
    return None


def is_meta_tree(kwargs: Mapping[str, Any]) -> bool:
    """Whether the tree kwargs are meta tensors (a model traced on the meta device): no plan can be
    built; the hooks let such a forward run untouched (shapes are all a meta trace computes)."""
    cu_q = kwargs.get(CU_SEQLENS_Q)
    return isinstance(cu_q, torch.Tensor) and cu_q.is_meta


_PAD_VALUES = (-1, 0)  # what collators pad tree fields with (TRL 1.16: -1; huggingface/trl#7686: 0)


def _strip_offsets_padding(name: str, offsets: torch.Tensor) -> torch.Tensor:
    """Offsets (0, ends...) without a collator's padding: what follows the row's end (the first
    occurrence of the largest entry) must be exactly padding, all -1, all 0 or all the end repeated;
    anything else there is a ValueError naming ``name`` and the first entry that is not padding (a
    mixed tail such as ``[0, 3, 0, 3]`` would otherwise build a plan of the head and drop the rest)."""
    if offsets.numel() < 2:
        return offsets
    end = int(offsets.max())
    last = int((offsets == end).nonzero()[0, 0])
    tail = offsets[last + 1:]
    if tail.numel() == 0:
        return offsets
    _check_padding(name, tail, last + 1, (-1, 0, end), f"after the row's end ({end}, entry {last})")
    return offsets[: last + 1]


def _check_padding(name: str, tail: torch.Tensor, start: int, pads: tuple, where: str) -> None:
    """Refuses a ``tail`` (entries ``start``... of ``name``) that is not one pad value repeated."""
    first = int(tail[0])
    if first not in pads:
        raise ValueError(f"{name}: entry {start} is {first} {where}, but padding must be all "
                         f"{' / all '.join(str(p) for p in dict.fromkeys(pads))}; is the field from another row?")
    odd = (tail != first).nonzero()
    if odd.numel():
        at = int(odd[0, 0])
        raise ValueError(f"{name}: malformed padding {where}: entry {start} is {first} but entry {start + at} is "
                         f"{int(tail[at])}; padding must be one value repeated (all "
                         f"{' / all '.join(str(p) for p in dict.fromkeys(pads))}) up to the end")


def _strip_tail(name: str, values: torch.Tensor, length: int, what: str) -> torch.Tensor:
    """``values`` cut to ``length`` entries; the rest must be one pad value (-1 or 0) repeated, else a
    ValueError naming ``name`` and the position."""
    if values.numel() <= length:
        return values
    _check_padding(name, values[length:], length, _PAD_VALUES, what)
    return values[:length]


def _strip_padding(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tree fields of one row of a collated batch without the collator's trailing padding."""
    parts = dict(parts)
    parts[CU_SEQLENS_Q] = _strip_offsets_padding(CU_SEQLENS_Q, parts[CU_SEQLENS_Q])
    if CU_SEQLENS_K in parts:
        parts[CU_SEQLENS_K] = _strip_offsets_padding(CU_SEQLENS_K, parts[CU_SEQLENS_K])
        if KV_INDEX in parts and parts[CU_SEQLENS_K].numel() > 1:  # else the core reports the offsets
            end = max(int(parts[CU_SEQLENS_K][-1]), 0)
            parts[KV_INDEX] = _strip_tail(KV_INDEX, parts[KV_INDEX], end, f"after the {end} entries {CU_SEQLENS_K} "
                                          "ends at")
    elif KV_INDEX in parts:
        tail = (parts[KV_INDEX] == -1).flip(0).cumprod(0).sum()  # kv entries are >= 0: trailing -1s are padding
        parts[KV_INDEX] = parts[KV_INDEX][: parts[KV_INDEX].numel() - int(tail)]
    segments = parts[CU_SEQLENS_Q].numel() - 1
    for name in (SEGMENT_PARENTS, SEGMENT_DEPTHS):
        if name in parts and segments > 0:  # no segments: the core reports the offsets
            parts[name] = _strip_tail(name, parts[name], segments, f"after the {segments} segments of {CU_SEQLENS_Q}")
    return parts


def chunk_count(kwargs: Mapping[str, Any]) -> int | None:
    """huggingface/trl#7686's ``tree_n_chunks``: the chunks its kernel splits the row into (a function of
    that kernel's chunk size; it says nothing about the tree's levels). One non-negative integer, else a
    ValueError; the plan does not use it."""
    value = kwargs.get(N_CHUNKS)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or value.dtype == torch.bool or value.is_floating_point() or \
                value.is_complex():
            raise ValueError(f"{N_CHUNKS}: expected one non-negative integer (the chunks huggingface/trl#7686's "
                             f"kernel splits the row into), got a tensor of shape {tuple(value.shape)} and dtype "
                             f"{value.dtype}")
        value = value.item()
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # numpy's integers pass
    except TypeError:
        raise ValueError(f"{N_CHUNKS}: expected a non-negative integer, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{N_CHUNKS}: expected a non-negative integer, got {value}")
    return value


def _levels_of(name: str, values: torch.Tensor, start: int, levels: int) -> torch.Tensor:
    """Entries ``start``... of ``name`` cut to the tree's ``levels`` level sizes; the rest must be one pad
    value (0 or -1) repeated, else a ValueError naming the entry."""
    if values.numel() > start + levels:
        _check_padding(name, values[start + levels:], start + levels, _PAD_VALUES, f"after the tree's {levels} levels")
    return values[start: start + levels]


def _check_level_sizes(plan: "TreePlan", parts: Mapping[str, torch.Tensor]) -> None:
    """huggingface/trl#7686's ``tree_level_sizes`` and ``tree_sizes``, checked against the plan the key
    paths (or parents) give: the header of ``tree_sizes`` against the plan's sizes, the level sizes of
    either against its levels (and against each other when both are given)."""
    levels = {}
    if LEVEL_SIZES in parts:
        levels[LEVEL_SIZES] = _levels_of(LEVEL_SIZES, parts[LEVEL_SIZES], 0, plan.num_levels)
    if SIZES in parts:
        sizes = parts[SIZES]
        if sizes.numel() < len(_SIZES_HEADER):
            raise ValueError(f"{SIZES}: {sizes.numel()} entries {sizes.tolist()}, but huggingface/trl#7686's layout is "
                             "[max_q, max_k, n_kv, n_chunks, *level sizes]")
        for entry, ((what, meaning, planned), given) in enumerate(zip(_SIZES_HEADER, sizes.tolist())):
            # n_chunks is accepted unchecked (beyond >= 0): it depends on the chunk size of #7686's kernel,
            # which the plan does not know, and nothing here uses it. Nor is it compared with tree_n_chunks: a
            # collated batch may carry that one per batch rather than per row, and refusing a valid row over a
            # count no computation reads would be the wrong way to fail.
            if planned is None:
                if given < 0:
                    raise ValueError(f"{SIZES}: {what} (entry {entry}) is {given}, expected a non-negative integer")
            elif given != planned(plan):
                raise ValueError(f"{SIZES}: {what} (entry {entry}) is {given}, but the tree's {meaning} is "
                                 f"{planned(plan)}; do the fields describe the same row?")
        levels[SIZES] = _levels_of(SIZES, sizes, len(_SIZES_HEADER), plan.num_levels)
    if len(levels) == 2 and not torch.equal(levels[LEVEL_SIZES], levels[SIZES]):
        raise ValueError(f"{LEVEL_SIZES}: {levels[LEVEL_SIZES].tolist()[:8]} but {SIZES} gives the level sizes "
                         f"{levels[SIZES].tolist()[:8]} (its entries 4...); give one, or the same")
    offsets = plan.array("level_offsets")
    expected = (offsets[1:] - offsets[:-1]).tolist()
    for name, sizes in levels.items():
        got = sizes.tolist()
        if len(got) != len(expected):
            raise ValueError(f"{name}: {len(got)} levels {got[:8]}, but the key paths give the tree {len(expected)} "
                             f"levels ({expected[:8]} segments per level)")
        for level, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise ValueError(f"{name}: level {level}: {g} segments, but the key paths put {e} segments at level "
                                 f"{level}")


def has_tree(kwargs: Mapping[str, Any]) -> bool:
    return kwargs.get(CU_SEQLENS_Q) is not None


def host_work(function):
    """``function`` run eagerly under torch.compile (``torch.compiler.disable``: a graph break, instead of
    being traced with fake tensors) and called directly otherwise: the disabled wrapper costs about a
    microsecond per call (eval-frame switches), and the seam call's hot path makes two such calls."""
    disabled = torch.compiler.disable(function)
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(function)
    def call(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return function(*args, **kwargs)

    return call


# Host work (the plan is built and cached on the host from the index tensors' values).
@host_work
def tree_plan(kwargs: Mapping[str, Any], num_tokens: int | None = None) -> TreePlan | None:
    """The plan of the tree kwargs in ``kwargs``, or None when there are none.

    Built on the host with one device-to-host copy and cached on the ``tree_cu_seqlens_q``
    tensor (rebuilt if that tensor is modified in place), so every layer and every gradient
    checkpoint replay of one forward shares it. Raises ValueError naming the field on bad input.
    """
    cu_q = kwargs.get(CU_SEQLENS_Q)
    if cu_q is None:
        stray = [k for k in TREE_FIELDS if kwargs.get(k) is not None]
        if stray:
            raise ValueError(f"{CU_SEQLENS_Q}: missing, but {', '.join(stray)} given")
        return None
    if isinstance(cu_q, torch.Tensor):  # the hot path: every field the very object it was, unchanged
        entry = getattr(cu_q, _CACHE_ATTR, None)
        if entry is not None and entry[4] is not None and _unchanged(entry[4], kwargs) and \
                (num_tokens is None or entry[0].num_tokens == num_tokens):
            return entry[0]
    # The cache key: every tree field by identity and version (an in-place edit or a different
    # companion tensor rebuilds the plan); fields given as int sequences by identity and a copy of
    # their values (compared on lookup: a list has no version counter).
    fields = TREE_FIELDS + LEVEL_FIELDS
    given = [name for name in fields if kwargs.get(name) is not None]
    key = tuple((name, id(kwargs[name]), tensor_version(kwargs[name])) for name in given)
    key += ((N_CHUNKS, chunk_count(kwargs)),)
    values = tuple(_snapshot(kwargs[name]) for name in given if not isinstance(kwargs[name], torch.Tensor))
    fast = _fast_key(kwargs, given, values)  # versions read with the key's, before the values are copied
    cached = getattr(cu_q, _CACHE_ATTR, None) if isinstance(cu_q, torch.Tensor) else _sequence_plans.get(id(cu_q))
    if cached is not None and cached[1] == key and cached[3] == values and \
            (num_tokens is None or cached[0].num_tokens == num_tokens):
        return cached[0]
    tensors = [kwargs[name] for name in given if isinstance(kwargs[name], torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    present = {name: _as_index_vector(name, index_tensor(name, kwargs[name]),
                                      device if isinstance(kwargs[name], torch.Tensor) else None) for name in given}
    if device.type == "meta":
        raise ValueError(f"{CU_SEQLENS_Q}: is a meta tensor (no values); a tree plan is built from the tree's values: "
                         "pass real tensors (a model traced on the meta device runs its recurrent layers untouched)")
    sizes = [t.numel() for t in present.values()]
    host = torch.cat([t.to(torch.int64) for t in present.values()]).cpu()  # the one device->host copy
    parts = _strip_padding(dict(zip(present, torch.split(host, sizes))))  # a collated row's padding ignored

    plan = TreePlan.build(parts, num_tokens, device)
    _check_level_sizes(plan, parts)
    # The companions are kept alive with the entry so their ids cannot be reused while it is cached.
    entry = (plan, key, [kwargs[name] for name in given], values, fast)
    if isinstance(cu_q, torch.Tensor):
        setattr(cu_q, _CACHE_ATTR, entry)
    else:
        _sequence_plans.pop(id(cu_q), None)
        _sequence_plans[id(cu_q)] = entry
        while len(_sequence_plans) > _SEQUENCE_PLANS:
            del _sequence_plans[next(iter(_sequence_plans))]
    return plan


_KEY_FIELDS = TREE_FIELDS + LEVEL_FIELDS


def _fast_key(kwargs: Mapping[str, Any], given: list, values: tuple) -> tuple | None:
    """What ``_unchanged`` compares on the hot path: every tree field's object (None when absent) and
    version (None for inference tensors: identity only), and the chunk count when it is None or an int;
    None (the full key decides) when a field is an int sequence or the chunk count is a tensor."""
    count = kwargs.get(N_CHUNKS)
    if values or not (count is None or type(count) is int):
        return None
    fast = [(name, kwargs.get(name), None if kwargs.get(name) is None else tensor_version(kwargs[name]))
            for name in _KEY_FIELDS]
    return tuple((name, obj, version if isinstance(version, int) else None) for name, obj, version in fast) + \
        ((N_CHUNKS, count, None),)


def _unchanged(fast: tuple, kwargs: Mapping[str, Any]) -> bool:
    get = kwargs.get
    for name, obj, version in fast:
        current = get(name)
        if current is not obj or (version is not None and current._version != version):
            return False
    return True


# Plans of tree fields given as int sequences (no tensor to cache them on), by id of their
# tree_cu_seqlens_q, newest last; the entries hold the sequences, so their ids are not reused.
_sequence_plans: dict[int, tuple] = ENGINE.sequence_plans
_SEQUENCE_PLANS = 16


def _snapshot(value: Any) -> Any:
    """A copy of an int sequence's values (rows copied too), to tell on lookup that it is unchanged."""
    if isinstance(value, (list, tuple)):
        return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in value) \
            if value and isinstance(value[0], (list, tuple)) else tuple(value)
    return value
