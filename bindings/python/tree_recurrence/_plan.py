"""TreePlan from a forward's ``tree_*`` kwargs, built once and cached on ``tree_cu_seqlens_q``."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from . import _core

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


def _as_index_vector(name: str, value: Any, device: torch.device | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
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


class ChunkTables(NamedTuple):
    """Segment-aligned chunks of a plan (``TreePlan.chunk_tables``): a chunk never crosses a segment
    boundary; a segment of L tokens has ceil(L / C) chunks, in token order. Tensors are int64 on
    the requested device; ``level_offsets`` is a host list."""

    gather: torch.Tensor             # (NC, C) token index of each chunk row, -1 for padding
    scatter: torch.Tensor            # (N) position of each token in the flattened NC*C grid
    seg_chunk_offsets: torch.Tensor  # (S+1) chunks of segment s: [off[s], off[s+1])
    parents: torch.Tensor            # (S) parent segment, -1 for roots
    root_index: torch.Tensor         # (S) index of a root among the roots (segment order), -1 else
    level_segments: torch.Tensor     # (S) segments grouped by trie level
    level_offsets: list              # (L+1) host ints: level l is level_segments[lo:hi]
    child_offsets: torch.Tensor      # (S+1) children CSR
    children: torch.Tensor           # (S - roots)
    num_chunks: int

    def state_args(self) -> tuple:
        """The tables in chunk_state_pass's order: ``op(w, u, kd, decay, h0, *tables.state_args())``."""
        return (self.seg_chunk_offsets, self.parents, self.root_index, self.level_segments, self.level_offsets,
                self.child_offsets, self.children)

    op_args = state_args


class TreePlan:
    """Host plan of one tree-packed row (see docs/architecture.md for every array)."""

    def __init__(self, core: _core.TreePlan, device: torch.device):
        self._core = core
        self.device = device  # where the tree tensors came from
        self._host: dict[str, tuple] = {}  # array(): (value, [(tensor, version)])
        self._on_device: dict[tuple, Any] = {}
        self._tables: dict[tuple, tuple] = {}  # tensor() and conv_tables(): (value, [(tensor, version)])
        # The driver's per-plan decisions (a seam call's route per family, seam, device and backend)
        # and its tables built from this plan's index tensors (fork levels): decided once per plan.
        self.routes: dict[tuple, Any] = {}

    # counts
    num_tokens = property(lambda self: self._core.num_tokens)
    num_segments = property(lambda self: self._core.num_segments)
    num_leaves = property(lambda self: self._core.num_leaves)
    num_levels = property(lambda self: self._core.num_levels)
    path_token_total = property(lambda self: self._core.path_token_total)
    saved_tokens = property(lambda self: self._core.saved_tokens)
    max_path_length = property(lambda self: self._core.max_path_length)
    max_segment_length = property(lambda self: self._core.max_segment_length)
    is_chains = property(lambda self: self._core.is_chains)

    @staticmethod
    def _wrap(buffer: bytearray) -> torch.Tensor:
        # The core hands out copies (bytearrays): nothing written here can reach the C++ plan.
        if len(buffer) == 0:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(buffer, dtype=torch.int64)

    @staticmethod
    def _unchanged(entry: tuple) -> bool:
        """Whether none of a cached entry's tensors was written in place since it was cached."""
        return all(_version(t) == v for t, v in entry[1])

    @staticmethod
    def _entry(value: Any, *tensors: torch.Tensor) -> tuple:
        return (value, [(t, _version(t)) for t in tensors])

    def array(self, name: str) -> torch.Tensor:
        """A plan array as an int64 CPU tensor: a copy of the C++ plan's array, cached. Writing to
        it cannot change the plan: a copy written in place is replaced by a fresh one on next use."""
        entry = self._host.get(name)
        if entry is None or not self._unchanged(entry):
            value = self._wrap(self._core.array(name))
            entry = self._host[name] = self._entry(value, value)
        return entry[0]

    def tensor(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """A plan array on ``device`` (default: the tree tensors' device), copied once (and again
        if it was written in place)."""
        device = torch.device(device) if device is not None else self.device
        key = (name, device)
        entry = self._tables.get(key)
        if entry is None or not self._unchanged(entry):
            value = self._wrap(self._core.array(name)).to(device)
            entry = self._tables[key] = self._entry(value, value)
        return entry[0]

    def conv_tables(self, width: int, device: torch.device | str | None = None):
        """(ancestors (N, width-1), reader_offsets (N+1), readers) on ``device``, cached."""
        device = torch.device(device) if device is not None else self.device
        key = ("conv", width, device)
        entry = self._tables.get(key)
        if entry is None or not self._unchanged(entry):
            ancestors, offsets, readers = (self._wrap(b) for b in self._core.conv_tables(width))
            value = (ancestors.view(self.num_tokens, width - 1).to(device), offsets.to(device), readers.to(device))
            entry = self._tables[key] = self._entry(value, *value)
        return entry[0]

    def padded_paths(self, device: torch.device | str | None = None):
        """(gather (P, Lmax) token index with -1 padding, source (N) flat index into P*Lmax)."""
        device = torch.device(device) if device is not None else self.device
        key = ("padded_paths", device)
        if key not in self._on_device:
            offsets = self.array("path_offsets")
            lengths = offsets[1:] - offsets[:-1]
            width = self.max_path_length
            position = torch.arange(width).expand(self.num_leaves, width)
            valid = position < lengths[:, None]
            gather = torch.full((self.num_leaves, width), -1, dtype=torch.int64)
            gather[valid] = self.array("path_tokens")
            leaf = self.array("segment_source_leaf")[self.array("token_segment")]
            source = leaf * width + self.array("token_position")
            self._on_device[key] = (gather.to(device), source.to(device))
        return self._on_device[key]

    def padded_level(self, level: int, device: torch.device | str | None = None):
        """For one trie level: (segments, gather (n, Lmax) with -1 padding, scatter (tokens of the
        level), flat source index into n*Lmax for each of those tokens)."""
        device = torch.device(device) if device is not None else self.device
        key = ("level", level, device)
        if key not in self._on_device:
            lo, hi = self.array("level_offsets")[level : level + 2].tolist()
            segments = self.array("level_segments")[lo:hi]
            starts = self.array("seg_offsets")[segments]
            lengths = self.array("seg_lengths")[segments]
            width = int(lengths.max())
            position = torch.arange(width).expand(len(segments), width)
            valid = position < lengths[:, None]
            gather = torch.where(valid, starts[:, None] + position, torch.full_like(position, -1))
            tokens = gather[valid]
            source = (torch.arange(len(segments))[:, None] * width + position)[valid]
            self._on_device[key] = (segments, gather.to(device), tokens.to(device), source.to(device))
        return self._on_device[key]

    def chunk_tables(self, chunk_size: int, device: torch.device | str | None = None) -> ChunkTables:
        """Segment-aligned chunk tables for chunked recurrent kernels (``ChunkTables``), built with
        vectorised ops on the host arrays (no loop over segments), copied to ``device`` once and
        cached per chunk size and device (rebuilt if one of them was written in place)."""
        chunk_size = int(chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
        device = torch.device(device) if device is not None else self.device
        key = ("chunks", chunk_size, device)
        entry = self._tables.get(key)
        if entry is None or not self._unchanged(entry):
            seg_offsets = self.array("seg_offsets")[: self.num_segments + 1]
            lengths = self.array("seg_lengths")
            parents = self.array("parents")
            chunks = (lengths + chunk_size - 1) // chunk_size
            seg_chunk_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(chunks, 0)])
            num_chunks = int(seg_chunk_offsets[-1])
            chunk_segment = torch.repeat_interleave(torch.arange(self.num_segments), chunks)
            local = torch.arange(num_chunks) - seg_chunk_offsets[chunk_segment]
            start = seg_offsets[chunk_segment] + local * chunk_size
            position = start[:, None] + torch.arange(chunk_size)
            valid = position < (seg_offsets[chunk_segment] + lengths[chunk_segment])[:, None]
            gather = torch.where(valid, position, torch.full_like(position, -1))
            scatter = valid.reshape(-1).nonzero().reshape(-1)  # tokens appear in order in the grid
            is_root = parents < 0
            root_index = torch.where(is_root, torch.cumsum(is_root, 0) - 1, torch.full_like(parents, -1))
            moved = [t.to(device, copy=True) for t in (gather, scatter, seg_chunk_offsets, parents, root_index,
                                                      self.array("level_segments"))]
            csr = [self.array(name).to(device, copy=True) for name in ("child_offsets", "children")]
            levels = [int(v) for v in self.array("level_offsets").tolist()]
            value = ChunkTables(*moved, levels, *csr, num_chunks)
            entry = self._tables[key] = self._entry(value, *moved, *csr)
        return entry[0]

    def __repr__(self) -> str:
        return (
            f"TreePlan(tokens={self.num_tokens}, segments={self.num_segments}, samples={self.num_leaves}, "
            f"levels={self.num_levels}, path_tokens={self.path_token_total}, saved={self.saved_tokens})"
        )


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


def _version(value: Any) -> Any:
    """A tensor's version counter for the plan cache key (inference tensors have none: they cannot be
    written in place outside inference mode, so their identity is the key)."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_inference():
        return "inference"
    return value._version


def is_meta_tree(kwargs: Mapping[str, Any]) -> bool:
    """Whether the tree kwargs are meta tensors (a model traced on the meta device): no plan can be
    built; the hooks let such a forward run untouched (shapes are all a meta trace computes)."""
    cu_q = kwargs.get(CU_SEQLENS_Q)
    return isinstance(cu_q, torch.Tensor) and cu_q.is_meta


_PAD_VALUES = (-1, 0)  # what collators pad tree fields with (TRL 1.16: -1; huggingface/trl#7686: 0)


def _strip_offsets_padding(offsets: torch.Tensor) -> torch.Tensor:
    """Offsets (0, ends...) without a collator's padding: trailing -1 / 0 entries or repeats of the
    final offset after the row's end (the first occurrence of the largest entry). Anything else is
    left for the core to report."""
    if offsets.numel() < 2:
        return offsets
    end = int(offsets.max())
    last = int((offsets == end).nonzero()[0, 0])
    tail = offsets[last + 1:]
    if tail.numel() and bool(((tail == end) | (tail == -1) | (tail == 0)).all()):
        return offsets[: last + 1]
    return offsets


def _strip_tail(values: torch.Tensor, length: int) -> torch.Tensor:
    """``values`` cut to ``length`` entries when the rest is one pad value (-1 or 0) repeated."""
    if values.numel() <= length:
        return values
    tail = values[length:]
    if int(tail[0]) in _PAD_VALUES and bool((tail == tail[0]).all()):
        return values[:length]
    return values


def _strip_padding(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tree fields of one row of a collated batch without the collator's trailing padding."""
    parts = dict(parts)
    parts[CU_SEQLENS_Q] = _strip_offsets_padding(parts[CU_SEQLENS_Q])
    if CU_SEQLENS_K in parts:
        parts[CU_SEQLENS_K] = _strip_offsets_padding(parts[CU_SEQLENS_K])
        if KV_INDEX in parts and parts[CU_SEQLENS_K].numel():
            parts[KV_INDEX] = _strip_tail(parts[KV_INDEX], max(int(parts[CU_SEQLENS_K][-1]), 0))
    elif KV_INDEX in parts:
        tail = (parts[KV_INDEX] == -1).flip(0).cumprod(0).sum()  # kv entries are >= 0: trailing -1s are padding
        parts[KV_INDEX] = parts[KV_INDEX][: parts[KV_INDEX].numel() - int(tail)]
    segments = parts[CU_SEQLENS_Q].numel() - 1
    for name in (SEGMENT_PARENTS, SEGMENT_DEPTHS):
        if name in parts:
            parts[name] = _strip_tail(parts[name], max(segments, 0))
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
        sizes = _strip_tail(sizes, plan.num_levels)  # a collator's padding (0 or -1)
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


# Host work (the plan is built and cached on the host from the index tensors' values): under
# torch.compile it runs eagerly, a graph break, instead of being traced with fake tensors.
@torch.compiler.disable
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
    # The cache key: every tree field by identity and version (an in-place edit or a different
    # companion tensor rebuilds the plan).
    fields = TREE_FIELDS + LEVEL_FIELDS
    key = tuple((name, id(kwargs[name]), _version(kwargs[name])) for name in fields if kwargs.get(name) is not None)
    key += ((LEVEL_COUNT, _level_count(kwargs)),)
    if isinstance(cu_q, torch.Tensor):
        cached = getattr(cu_q, _CACHE_ATTR, None)
        if cached is not None and cached[1] == key and (num_tokens is None or cached[0].num_tokens == num_tokens):
            return cached[0]
    device = cu_q.device if isinstance(cu_q, torch.Tensor) else None
    present = {name: _as_index_vector(name, kwargs[name], device) for name in fields if kwargs.get(name) is not None}
    if device is not None and device.type == "meta":
        raise ValueError(f"{CU_SEQLENS_Q}: is a meta tensor (no values); a tree plan is built from the tree's values: "
                         "pass real tensors (a model traced on the meta device runs its recurrent layers untouched)")
    sizes = [t.numel() for t in present.values()]
    host = torch.cat([t.to(torch.int64) for t in present.values()]).cpu()  # the one device->host copy
    parts = _strip_padding(dict(zip(present, torch.split(host, sizes))))  # a collated row's padding ignored

    def buffer(name):  # the core copies from buffer objects; it never takes an address
        t = parts.get(name)
        return None if t is None else t.contiguous().numpy()

    core = _core.TreePlan.build(
        buffer(CU_SEQLENS_Q), buffer(KV_INDEX), buffer(CU_SEQLENS_K), buffer(SEGMENT_PARENTS), buffer(SEGMENT_DEPTHS),
        -1 if num_tokens is None else int(num_tokens),
    )
    plan = TreePlan(core, device)
    _check_level_sizes(plan, parts, _level_count(kwargs))
    # The companions are kept alive with the entry so their ids cannot be reused while it is cached.
    setattr(cu_q, _CACHE_ATTR, (plan, key, [kwargs[name] for name in fields if kwargs.get(name) is not None]))
    return plan
