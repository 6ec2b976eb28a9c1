"""A forward's ``tree_*`` kwargs -> its TreePlan (``tree_plan``), built once and cached on
``tree_cu_seqlens_q``: TRL's tree formats (TRL 1.16's key paths, segment parents / depths,
huggingface/trl#7686's level sizes), fields given as tensors or int sequences, and a collated row's
padding, which must be exactly padding."""

from __future__ import annotations

import functools
import operator
from typing import Any, Mapping

import torch

from ._plan import TreePlan
from ._plan import _version as tensor_version

# Keyword names a trainer passes to the model's forward (docs/tree-format.md).
CU_SEQLENS_Q = "tree_cu_seqlens_q"
KV_INDEX = "tree_kv_index"
CU_SEQLENS_K = "tree_cu_seqlens_k"
SEGMENT_PARENTS = "tree_segment_parents"
SEGMENT_DEPTHS = "tree_segment_depths"
TREE_FIELDS = (CU_SEQLENS_Q, KV_INDEX, CU_SEQLENS_K, SEGMENT_PARENTS, SEGMENT_DEPTHS)
# huggingface/trl#7686's level sizes: segments per trie level (root level first), under either name;
# ``tree_n_chunks`` (an int) says how many of its entries are real (the rest is a collator's padding).
LEVEL_SIZES, LEVEL_SIZES_ALIAS, LEVEL_COUNT = "tree_level_sizes", "tree_sizes", "tree_n_chunks"
LEVEL_FIELDS = (LEVEL_SIZES, LEVEL_SIZES_ALIAS)

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


def _level_count(kwargs: Mapping[str, Any]) -> int | None:
    value = kwargs.get(LEVEL_COUNT)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_meta:
            raise ValueError(f"{LEVEL_COUNT}: expected one integer (how many entries of {LEVEL_SIZES} are real), "
                             f"got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{LEVEL_COUNT}: expected a positive integer (how many entries of {LEVEL_SIZES} are real), "
                         f"got {value!r}")
    return value


def _check_level_sizes(plan: "TreePlan", parts: Mapping[str, torch.Tensor], count: int | None) -> None:
    """huggingface/trl#7686's level sizes, checked against the levels the key paths (or parents) give."""
    given = [name for name in LEVEL_FIELDS if name in parts]
    if not given:
        if count is not None:
            raise ValueError(f"{LEVEL_COUNT}: given ({count}) without {LEVEL_SIZES} / {LEVEL_SIZES_ALIAS}")
        return
    if len(given) == 2 and not torch.equal(parts[LEVEL_SIZES], parts[LEVEL_SIZES_ALIAS]):
        raise ValueError(f"{LEVEL_SIZES}: {parts[LEVEL_SIZES].tolist()[:8]} but {LEVEL_SIZES_ALIAS}: "
                         f"{parts[LEVEL_SIZES_ALIAS].tolist()[:8]}; give one, or the same")
    name = given[0]
    sizes = parts[name]
    if count is not None:
        if count > sizes.numel():
            raise ValueError(f"{LEVEL_COUNT}: {count}, but {name} has {sizes.numel()} entries")
        sizes = sizes[:count]
    else:
        sizes = _strip_tail(name, sizes, plan.num_levels, f"after the tree's {plan.num_levels} levels")  # 0 / -1
    offsets = plan.array("level_offsets")
    expected = (offsets[1:] - offsets[:-1]).tolist()
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
    key += ((LEVEL_COUNT, _level_count(kwargs)),)
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
    _check_level_sizes(plan, parts, _level_count(kwargs))
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
    version (None for inference tensors: identity only), and the level count when it is None or an int;
    None (the full key decides) when a field is an int sequence or the level count is a tensor."""
    count = kwargs.get(LEVEL_COUNT)
    if values or not (count is None or type(count) is int):
        return None
    fast = [(name, kwargs.get(name), None if kwargs.get(name) is None else tensor_version(kwargs[name]))
            for name in _KEY_FIELDS]
    return tuple((name, obj, version if isinstance(version, int) else None) for name, obj, version in fast) + \
        ((LEVEL_COUNT, count, None),)


def _unchanged(fast: tuple, kwargs: Mapping[str, Any]) -> bool:
    get = kwargs.get
    for name, obj, version in fast:
        current = get(name)
        if current is not obj or (version is not None and current._version != version):
            return False
    return True


# Plans of tree fields given as int sequences (no tensor to cache them on), by id of their
# tree_cu_seqlens_q, newest last; the entries hold the sequences, so their ids are not reused.
_sequence_plans: dict[int, tuple] = {}
_SEQUENCE_PLANS = 16


def _snapshot(value: Any) -> Any:
    """A copy of an int sequence's values (rows copied too), to tell on lookup that it is unchanged."""
    if isinstance(value, (list, tuple)):
        return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in value) \
            if value and isinstance(value[0], (list, tuple)) else tuple(value)
    return value
