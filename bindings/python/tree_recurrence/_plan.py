"""TreePlan: the host plan of one tree-packed row (the C++ core's) and the tables built from it, in
one cache with one rule (``TreePlan.cached``). Parsing a forward's ``tree_*`` kwargs into one (TRL's formats, a collator's
padding, int lists) is ``_tree_kwargs.py``; its names are re-exported here."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from . import _core


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


class CacheEntry(NamedTuple):
    """One entry of ``TreePlan.cache``: the value, the objects it was built from (identity), and the
    version of every tensor among those and in the value when it was cached."""

    value: Any
    depends: tuple
    stamps: tuple  # ((tensor, version), ...); inference tensors have no version (nor in-place writes outside
    # inference mode): their identity is what counts


class TreePlan:
    """Host plan of one tree-packed row (see docs/architecture.md for every array)."""

    def __init__(self, core: _core.TreePlan, device: torch.device):
        self._core = core
        self._counts = tuple(getattr(core, name) for name in self._COUNTS)
        self.device = device  # where the tree tensors came from
        # Everything built from this plan (host arrays, device tables, the attention masks, the
        # driver's routes and fork tables): key -> CacheEntry, one rule (``cached``).
        self.cache: dict[tuple, CacheEntry] = {}

    def cached(self, key: tuple, build, depends: tuple = ()) -> Any:
        """``build()``'s value for ``key``, built once and reused while every object in ``depends`` is
        the same object (identity) and no tensor among them or in the value (tuples, lists and dicts
        are looked into) has been written in place since (its version counter)."""
        entry = self.cache.get(key)
        if entry is not None:  # explicit loops: this is every seam call's path
            value, built_from, stamps = entry
            if len(built_from) == len(depends):
                for old, new in zip(built_from, depends):
                    if old is not new:
                        break
                else:
                    for tensor, version in stamps:
                        if tensor._version != version:
                            break
                    else:
                        return value
        value = build()
        self.cache[key] = CacheEntry(value, tuple(depends), tuple((t, t._version) for t in _tensors((value, depends))
                                                                  if not t.is_inference()))
        return value

    # counts (read-only; read once from the immutable C++ plan: a seam call reads num_tokens twice, and a
    # property over the core costs a pybind11 call each time)
    _COUNTS = ("num_tokens", "num_segments", "num_leaves", "num_levels", "path_token_total", "saved_tokens",
               "max_path_length", "max_segment_length", "is_chains")
    num_tokens = property(lambda self: self._counts[0])
    num_segments = property(lambda self: self._counts[1])
    num_leaves = property(lambda self: self._counts[2])
    num_levels = property(lambda self: self._counts[3])
    path_token_total = property(lambda self: self._counts[4])
    saved_tokens = property(lambda self: self._counts[5])
    max_path_length = property(lambda self: self._counts[6])
    max_segment_length = property(lambda self: self._counts[7])
    is_chains = property(lambda self: self._counts[8])

    @staticmethod
    def _wrap(buffer: bytearray) -> torch.Tensor:
        # The core hands out copies (bytearrays): nothing written here can reach the C++ plan.
        if len(buffer) == 0:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(buffer, dtype=torch.int64)

    def array(self, name: str) -> torch.Tensor:
        """A plan array as an int64 CPU tensor: a copy of the C++ plan's array, cached. Writing to
        it cannot change the plan: a copy written in place is replaced by a fresh one on next use."""
        return self.cached(("array", name), lambda: self._wrap(self._core.array(name)))

    def tensor(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """A plan array on ``device`` (default: the tree tensors' device), copied once (and again
        if it was written in place)."""
        device = torch.device(device) if device is not None else self.device
        return self.cached(("tensor", name, device), lambda: self._wrap(self._core.array(name)).to(device))

    def conv_tables(self, width: int, device: torch.device | str | None = None):
        """(ancestors (N, width-1), reader_offsets (N+1), readers) on ``device``, cached."""
        device = torch.device(device) if device is not None else self.device

        def build():
            ancestors, offsets, readers = (self._wrap(b) for b in self._core.conv_tables(width))
            return ancestors.view(self.num_tokens, width - 1).to(device), offsets.to(device), readers.to(device)

        return self.cached(("conv", width, device), build)

    def padded_paths(self, device: torch.device | str | None = None):
        """(gather (P, Lmax) token index with -1 padding, source (N) flat index into P*Lmax)."""
        device = torch.device(device) if device is not None else self.device

        def build():
            offsets = self.array("path_offsets")
            lengths = offsets[1:] - offsets[:-1]
            width = self.max_path_length
            position = torch.arange(width).expand(self.num_leaves, width)
            valid = position < lengths[:, None]
            gather = torch.full((self.num_leaves, width), -1, dtype=torch.int64)
            gather[valid] = self.array("path_tokens")
            leaf = self.array("segment_source_leaf")[self.array("token_segment")]
            source = leaf * width + self.array("token_position")
            return gather.to(device), source.to(device)

        return self.cached(("padded_paths", device), build)

    def padded_level(self, level: int, device: torch.device | str | None = None):
        """For one trie level: (segments, gather (n, Lmax) with -1 padding, scatter (tokens of the
        level), flat source index into n*Lmax for each of those tokens)."""
        device = torch.device(device) if device is not None else self.device

        def build():
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
            return segments, gather.to(device), tokens.to(device), source.to(device)

        return self.cached(("level", level, device), build)

    def chunk_tables(self, chunk_size: int, device: torch.device | str | None = None) -> ChunkTables:
        """Segment-aligned chunk tables for chunked recurrent kernels (``ChunkTables``), built by the C++
        plan (``TreePlan::chunk_tables``), wrapped as tensors and copied to ``device`` once, cached per
        chunk size and device (rebuilt if one of them was written in place). ``chunk_size`` in 1..65536
        (the core's kMaxChunkSize; larger is a ValueError)."""
        chunk_size = int(chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
        device = torch.device(device) if device is not None else self.device
        return self.cached(("chunks", chunk_size, device), lambda: self._build_chunk_tables(chunk_size, device))

    def chunk_op_args(self, chunk_size: int, device: torch.device) -> tuple:
        """A chunked native op's table arguments, ``(gather, scatter, *tables.state_args())`` of
        ``chunk_tables(chunk_size, device)``, as one cached tuple (a seam call's hot path)."""
        def build():
            tables = self.chunk_tables(chunk_size, device)
            return (tables.gather, tables.scatter) + tables.state_args()

        return self.cached(("chunk op args", chunk_size, device), build)

    def _build_chunk_tables(self, chunk_size: int, device: torch.device) -> ChunkTables:
        gather, scatter, seg_chunk_offsets, root_index, num_chunks = self._core.chunk_tables(chunk_size)
        own = [self._wrap(b).to(device) for b in (gather, scatter, seg_chunk_offsets, root_index)]  # fresh copies
        own[0] = own[0].view(num_chunks, chunk_size)
        shared = [self.array(name).to(device, copy=True) for name in ("parents", "level_segments", "child_offsets",
                                                                      "children")]  # the cached arrays: copied
        levels = [int(v) for v in self.array("level_offsets").tolist()]
        return ChunkTables(own[0], own[1], own[2], shared[0], own[3], shared[1], levels, shared[2], shared[3],
                           int(num_chunks))

    @classmethod
    def build(cls, arrays: Mapping[str, Any], num_tokens: int | None, device: torch.device) -> "TreePlan":
        """The plan of one row's tree fields (int64 host arrays by field name, padding stripped): the C++
        core checks them and builds every table (a ValueError naming the field on bad input)."""
        def buffer(name):  # the core copies from buffer objects; it never takes an address
            t = arrays.get(name)
            return None if t is None else t.contiguous().numpy()

        core = _core.TreePlan.build(
            buffer("tree_cu_seqlens_q"), buffer("tree_kv_index"), buffer("tree_cu_seqlens_k"),
            buffer("tree_segment_parents"), buffer("tree_segment_depths"), -1 if num_tokens is None else int(num_tokens))
        return cls(core, device)

    def __repr__(self) -> str:
        return (
            f"TreePlan(tokens={self.num_tokens}, segments={self.num_segments}, samples={self.num_leaves}, "
            f"levels={self.num_levels}, path_tokens={self.path_token_total}, saved={self.saved_tokens})"
        )


def _tensors(value: Any):
    """The tensors in ``value``, looking into tuples (named ones too), lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def tensor_version(value: Any) -> Any:
    """A tensor's version counter for the plan cache key (inference tensors have none: they cannot be
    written in place outside inference mode, so their identity is the key)."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_inference():
        return "inference"
    return value._version
