"""TreePlan's one cache with one rule: everything built from a plan (host arrays,
device tables, chunk / conv / fork tables, attention masks, the driver's routes) lives in
``plan.cache`` and is reused while what it was built from is the same object and no tensor in it
has been written in place."""

from __future__ import annotations

import torch

import tree_recurrence as tr
from tree_recurrence import attention
from tree_recurrence._plan import CacheEntry, TreePlan
from tree_recurrence._scan_strategies import fork_tables


def plan() -> TreePlan:
    return tr.tree_plan({"tree_cu_seqlens_q": torch.tensor([0, 5, 8, 12, 13]),
                         "tree_segment_parents": torch.tensor([-1, 0, 0, 2])})


def test_one_cache_holds_every_table():
    p = plan()
    assert not any(hasattr(p, name) for name in ("_host", "_tables", "_on_device", "routes"))
    p.array("parents"), p.tensor("seg_offsets", "cpu"), p.conv_tables(4, "cpu"), p.chunk_tables(4, "cpu")
    p.padded_paths("cpu"), p.padded_level(1, "cpu"), fork_tables(p, torch.device("cpu"))
    attention.tree_attention_mask(p, "cpu"), attention.segments_in_preorder(p)
    kinds = {key[0] for key in p.cache}
    assert {"array", "tensor", "conv", "chunks", "padded_paths", "level", "fork levels", "attention_mask",
            "preorder"} <= kinds, kinds
    assert all(isinstance(entry, CacheEntry) for entry in p.cache.values())


def test_an_entry_is_reused_until_a_tensor_of_it_is_written_in_place():
    p = plan()
    tables = p.chunk_tables(4, "cpu")
    assert p.chunk_tables(4, "cpu") is tables
    tables.gather.fill_(0)  # a caller writes into a table it was handed
    fresh = p.chunk_tables(4, "cpu")
    assert fresh is not tables and int(fresh.gather[0, 0]) == 0 and int(fresh.gather.min()) == -1
    levels = fork_tables(p, torch.device("cpu"))
    assert fork_tables(p, torch.device("cpu")) is levels
    levels.levels[1].cu_seqlens.add_(1)  # a tensor nested in the named tuples counts too
    assert fork_tables(p, torch.device("cpu")) is not levels


def test_an_entry_is_rebuilt_when_what_it_depends_on_is_another_object():
    p, built = plan(), []
    a, b = object(), object()
    build = lambda: built.append(1) or len(built)  # noqa: E731
    assert p.cached(("k",), build, depends=(a,)) == 1
    assert p.cached(("k",), build, depends=(a,)) == 1
    assert p.cached(("k",), build, depends=(b,)) == 2
    assert p.cached(("k",), build, depends=(b, a)) == 3


def test_fork_tables_in_order_exactly_when_the_levels_tokens_are():
    """The fork skips its gathers when the levels' tokens are already in token order (segments numbered
    level by level); a trie in DFS pre-order is not, and its order / inverse are each other's inverse."""
    cu = torch.tensor([0, 3, 5, 6, 8])
    by_level = tr.tree_plan({"tree_cu_seqlens_q": cu, "tree_segment_parents": torch.tensor([-1, 0, 0, 1])})
    dfs = tr.tree_plan({"tree_cu_seqlens_q": cu.clone(), "tree_segment_parents": torch.tensor([-1, 0, 1, 0])})
    chains = tr.tree_plan({"tree_cu_seqlens_q": cu.clone(), "tree_segment_parents": torch.tensor([-1, -1, -1, -1])})
    for plan, in_order in ((by_level, True), (dfs, False), (chains, True)):
        tables = fork_tables(plan, torch.device("cpu"))
        assert tables.in_order is in_order
        assert torch.equal(tables.order, torch.arange(8)) is in_order
        assert torch.equal(tables.order[tables.inverse], torch.arange(8))
