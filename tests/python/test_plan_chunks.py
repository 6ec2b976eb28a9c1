"""The chunk tables the C++ plan builds (``TreePlan::chunk_tables``, through ``TreePlan.chunk_tables``)
are bitwise the tables of the vectorised Python builder they replaced (kept here as the oracle), on the
fuzzed tries of test_plan_fuzz.py's generator (same seed, both tree formats) and a spread of chunk
sizes; bad chunk sizes are a ValueError; the tables are the plan cache's, and their own copies."""

from __future__ import annotations

import random

import pytest
import torch

import tree_recurrence as tr
from tree_recurrence._plan import ChunkTables
from tries import random_forest

CHUNKS = (1, 2, 3, 4, 5, 7, 16, 64)


def python_chunk_tables(plan, chunk_size: int) -> ChunkTables:
    """The builder TreePlan.chunk_tables used before the C++ plan built the tables (CPU, the oracle)."""
    seg_offsets = plan.array("seg_offsets")[: plan.num_segments + 1]
    lengths = plan.array("seg_lengths")
    parents = plan.array("parents")
    chunks = (lengths + chunk_size - 1) // chunk_size
    seg_chunk_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(chunks, 0)])
    num_chunks = int(seg_chunk_offsets[-1])
    chunk_segment = torch.repeat_interleave(torch.arange(plan.num_segments), chunks)
    local = torch.arange(num_chunks) - seg_chunk_offsets[chunk_segment]
    start = seg_offsets[chunk_segment] + local * chunk_size
    position = start[:, None] + torch.arange(chunk_size)
    valid = position < (seg_offsets[chunk_segment] + lengths[chunk_segment])[:, None]
    gather = torch.where(valid, position, torch.full_like(position, -1))
    scatter = valid.reshape(-1).nonzero().reshape(-1)
    is_root = parents < 0
    root_index = torch.where(is_root, torch.cumsum(is_root, 0) - 1, torch.full_like(parents, -1))
    return ChunkTables(gather, scatter, seg_chunk_offsets, parents.clone(), root_index,
                       plan.array("level_segments").clone(), [int(v) for v in plan.array("level_offsets").tolist()],
                       plan.array("child_offsets").clone(), plan.array("children").clone(), num_chunks)


def kwargs_of(lengths, parents, trl_format: bool) -> dict:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if not trl_format:
        return {"tree_cu_seqlens_q": torch.tensor(cu), "tree_segment_parents": torch.tensor(parents)}
    paths = []
    for s, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + list(range(cu[s], cu[s + 1])))
    cu_k = [0]
    for path in paths:
        cu_k.append(cu_k[-1] + len(path))
    return {"tree_cu_seqlens_q": torch.tensor(cu), "tree_kv_index": torch.tensor([t for p in paths for t in p]),
            "tree_cu_seqlens_k": torch.tensor(cu_k)}


def assert_same(got: ChunkTables, want: ChunkTables, what: str) -> None:
    for name in ChunkTables._fields:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), (what, name, a, b)
        else:
            assert type(a) is type(b) and a == b, (what, name, a, b)


def test_cpp_chunk_tables_are_the_python_builders_on_fuzzed_tries():
    rng = random.Random(20261201)
    cases = 0
    for case in range(300):
        lengths, parents = random_forest(rng)
        plan = tr.tree_plan(kwargs_of(lengths, parents, trl_format=case % 2 == 0))
        for chunk in CHUNKS:
            assert_same(plan.chunk_tables(chunk, "cpu"), python_chunk_tables(plan, chunk), (lengths, parents, chunk))
            cases += 1
    assert cases == 300 * len(CHUNKS)


def test_chunk_tables_of_long_segments_and_many_roots():
    lengths, parents = [130, 1, 64, 65, 3, 200], [-1, 0, 0, -1, 3, -1]
    plan = tr.tree_plan(kwargs_of(lengths, parents, trl_format=False))
    for chunk in (1, 63, 64, 65, 128, 256, 1000):
        assert_same(plan.chunk_tables(chunk, "cpu"), python_chunk_tables(plan, chunk), chunk)


@pytest.mark.parametrize("chunk", [0, -1, 2**16 + 1, 2**40])
def test_bad_chunk_sizes_are_value_errors(chunk):
    plan = tr.tree_plan(kwargs_of([3, 2], [-1, 0], trl_format=False))
    with pytest.raises(ValueError, match="chunk_size"):
        plan.chunk_tables(chunk, "cpu")


def test_chunk_tables_are_cached_and_their_own_copies():
    plan = tr.tree_plan(kwargs_of([3, 2, 4], [-1, 0, 0], trl_format=False))
    tables = plan.chunk_tables(2, "cpu")
    assert plan.chunk_tables(2, "cpu") is tables  # the plan cache's entry
    parents = plan.array("parents").clone()
    tables.parents.fill_(7)  # writing the tables never reaches the plan's arrays
    assert torch.equal(plan.array("parents"), parents)
    fresh = plan.chunk_tables(2, "cpu")  # ... and a table written in place is rebuilt
    assert fresh is not tables and torch.equal(fresh.parents, parents)
