"""The Python-side plan (tree_recurrence.tree_plan) on rows packed by TRL's real packer.

Every plan array is checked against facts derived independently from TRL's output (models.pack:
parents from the key paths, sample positions cross-checked with TRL's loss bookkeeping); the two
kwarg formats give equal plans; bad input is a ValueError naming the field; the cache lives on
tree_cu_seqlens_q and follows in-place changes.
"""

from __future__ import annotations

import re

import pytest
import torch

import models as M
import tree_recurrence as tr

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

ARRAYS = list(tr._core.TreePlan.array_names())
COUNTS = ["num_tokens", "num_segments", "num_leaves", "num_levels", "path_token_total", "saved_tokens", "max_path_length",
          "max_segment_length", "is_chains"]
FORESTS = M.FOREST_NAMES


@pytest.fixture(scope="module")
def packed():
    return {name: M.pack_forest(name) for name in FORESTS}


# ------------------------------------------------------------------------------------------------
# the forests have the shapes they claim (so the model tests cover what they say)
# ------------------------------------------------------------------------------------------------


def test_forest_shapes_are_what_they_claim(packed):
    def roots(t):
        return int((t.parents == -1).sum())

    def children(t):
        return torch.bincount(t.parents[t.parents >= 0], minlength=t.num_segments)

    fan, deep, tiny, groups, chain, mixed = (packed[n] for n in ("fan", "multiturn", "tiny", "groups", "chain", "mixed"))
    assert roots(fan) == 1 and int(children(fan).max()) >= 8  # one prompt, many completions
    assert int(deep.depths.max()) >= 5 and len(deep.samples) >= 6  # turn after turn on a shared history
    assert int((tiny.seg_lengths == 1).sum()) >= 4  # 1-token segments, leaves and inner ones
    assert bool(((tiny.seg_lengths == 1) & (children(tiny) > 0)).any())  # a 1-token segment with children
    assert int((tiny.seg_lengths < M.CONV_WIDTH).sum()) >= tiny.num_segments - 3  # shorter than the conv width
    assert roots(groups) >= 3 and any(int(children(groups)[s]) == 0 for s in torch.nonzero(groups.parents == -1).flatten())
    assert chain.num_segments == 1 and len(chain.samples) == 1
    assert roots(mixed) >= 4 and int(mixed.depths.max()) >= 3 and int((mixed.seg_lengths == 1).sum()) >= 4
    for t in packed.values():  # packing saves tokens whenever samples share a prefix
        total = sum(len(s) for s in t.samples)
        assert t.num_tokens == total if len(t.samples) == 1 else t.num_tokens < total


# ------------------------------------------------------------------------------------------------
# plan arrays vs independent derivation
# ------------------------------------------------------------------------------------------------


def _paths_by_leaf(plan):
    offsets, tokens = plan.array("path_offsets"), plan.array("path_tokens")
    return [tokens[offsets[p]:offsets[p + 1]] for p in range(plan.num_leaves)]


@pytest.mark.parametrize("forest", FORESTS)
def test_plan_matches_independent_derivation(forest, packed):
    t = packed[forest]
    plan = tr.tree_plan(t.trl_kwargs())
    cu_q = t.packed["tree_cu_seqlens_q"].long()
    S, N = t.num_segments, t.num_tokens
    assert (plan.num_tokens, plan.num_segments, plan.num_leaves) == (N, S, len(t.samples))
    assert torch.equal(plan.array("seg_offsets"), cu_q)
    assert torch.equal(plan.array("seg_lengths"), t.seg_lengths)
    assert torch.equal(plan.array("parents"), t.parents)
    assert torch.equal(plan.array("levels"), t.depths)
    assert plan.num_levels == int(t.depths.max()) + 1
    token_segment = torch.repeat_interleave(torch.arange(S), t.seg_lengths)
    assert torch.equal(plan.array("token_segment"), token_segment)
    assert torch.equal(plan.array("token_position"), t.position_ids[0])
    assert torch.equal(plan.array("segment_start"), t.position_ids[0][cu_q[:-1]])
    # levels CSR: segments grouped by level, increasing inside a level
    lo, segs = plan.array("level_offsets"), plan.array("level_segments")
    for level in range(plan.num_levels):
        assert segs[lo[level]:lo[level + 1]].tolist() == torch.nonzero(t.depths == level).flatten().tolist()
    # children CSR
    co, ch = plan.array("child_offsets"), plan.array("children")
    for s in range(S):
        assert ch[co[s]:co[s + 1]].tolist() == torch.nonzero(t.parents == s).flatten().tolist()
    # leaves and their paths: exactly the samples' positions (one per sample), leaves in increasing order
    is_parent = torch.zeros(S, dtype=torch.bool)
    is_parent[t.parents[t.parents >= 0]] = True
    assert plan.array("leaves").tolist() == torch.nonzero(~is_parent).flatten().tolist()
    paths = _paths_by_leaf(plan)
    assert sorted(tuple(p.tolist()) for p in paths) == sorted(tuple(p.tolist()) for p in t.sample_positions)
    assert plan.path_token_total == sum(len(s) for s in t.samples)
    assert plan.saved_tokens == plan.path_token_total - N
    assert plan.max_path_length == max(len(s) for s in t.samples)
    assert plan.max_segment_length == int(t.seg_lengths.max())
    assert plan.is_chains == bool((t.parents == -1).all())
    # token_source: a position in path_tokens holding the token, on the first path through it
    source = plan.array("token_source")
    assert torch.equal(plan.array("path_tokens")[source], torch.arange(N))
    first_leaf = [min(i for i, p in enumerate(paths) if tok in p.tolist()) for tok in range(N)]
    leaf_of_position = torch.repeat_interleave(torch.arange(plan.num_leaves), torch.tensor([len(p) for p in paths]))
    assert leaf_of_position[source].tolist() == first_leaf
    # segment_source_leaf: the path a segment's outputs come from passes through it
    for s, leaf in enumerate(plan.array("segment_source_leaf").tolist()):
        assert set(range(int(cu_q[s]), int(cu_q[s + 1]))) <= set(paths[leaf].tolist())


@pytest.mark.parametrize("forest", FORESTS)
def test_both_formats_give_equal_plans(forest, packed):
    t = packed[forest]
    plans = {fmt: tr.tree_plan(getattr(t, f"{fmt}_kwargs")()) for fmt in ("trl", "rich", "minimal")}
    # int64 everywhere, and a (1, L) batch of one row, are the same input
    wide = {k: (v.long()[None] if isinstance(v, torch.Tensor) else v) for k, v in t.rich_kwargs().items()}
    plans["int64-2d"] = tr.tree_plan(wide)
    ref = plans.pop("trl")
    for fmt, plan in plans.items():
        for name in ARRAYS:
            assert torch.equal(plan.array(name), ref.array(name)), f"{fmt}: {name}"
        for count in COUNTS:
            assert getattr(plan, count) == getattr(ref, count), f"{fmt}: {count}"
        for width in (2, 4):
            assert all(torch.equal(a, b) for a, b in zip(plan.conv_tables(width), ref.conv_tables(width)))


def test_no_tree_is_none():
    assert tr.tree_plan({}) is None
    assert tr.tree_plan({"input_ids": torch.zeros(1, 3, dtype=torch.long), "tree_cu_seqlens_q": None}) is None
    assert not tr.has_tree({"tree_kv_index": None})


# ------------------------------------------------------------------------------------------------
# errors: ValueError naming the field
# ------------------------------------------------------------------------------------------------


def _set(name, fn):
    def mutate(kw):
        kw[name] = fn(kw[name])
        return kw
    return mutate


def _poke(name, index, value):
    def mutate(kw):
        kw[name] = kw[name].clone()
        kw[name][index(kw) if callable(index) else index] = value(kw) if callable(value) else value
        return kw
    return mutate


def _drop(name):
    def mutate(kw):
        del kw[name]
        return kw
    return mutate


def _set_depths_to_token_offsets(kw):
    """Megatron's "depth": the segment's first token offset in its path (path length - own length)."""
    cu_q, cu_k = kw["tree_cu_seqlens_q"].long(), kw["tree_cu_seqlens_k"].long()
    kw["tree_segment_depths"] = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
    return kw


def _end_of_path(seg):
    return lambda kw: int(kw["tree_cu_seqlens_k"][seg + 1]) - 1


ERRORS = [
    # (id, format, mutation, field the message must start with)
    ("float cu_seqlens_q", "trl", _set("tree_cu_seqlens_q", lambda t: t.float()), "tree_cu_seqlens_q"),
    ("float kv_index", "trl", _set("tree_kv_index", lambda t: t.double()), "tree_kv_index"),
    ("float cu_seqlens_k", "trl", _set("tree_cu_seqlens_k", lambda t: t.float()), "tree_cu_seqlens_k"),
    ("float parents", "rich", _set("tree_segment_parents", lambda t: t.float()), "tree_segment_parents"),
    ("float depths", "rich", _set("tree_segment_depths", lambda t: t.float()), "tree_segment_depths"),
    # int lists are accepted; a list of floats is refused like a float tensor
    ("float list kv_index", "trl", _set("tree_kv_index", lambda t: [float(x) for x in t.tolist()]), "tree_kv_index"),
    ("2 rows cu_seqlens_q", "trl", _set("tree_cu_seqlens_q", lambda t: torch.stack([t, t])), "tree_cu_seqlens_q"),
    ("2 rows kv_index", "trl", _set("tree_kv_index", lambda t: torch.stack([t, t])), "tree_kv_index"),
    ("2 rows cu_seqlens_k", "trl", _set("tree_cu_seqlens_k", lambda t: torch.stack([t, t])), "tree_cu_seqlens_k"),
    ("2 rows parents", "minimal", _set("tree_segment_parents", lambda t: torch.stack([t, t])), "tree_segment_parents"),
    ("meta kv_index", "trl", _set("tree_kv_index", lambda t: t.to("meta")), "tree_kv_index"),
    ("meta cu_seqlens_k", "trl", _set("tree_cu_seqlens_k", lambda t: t.to("meta")), "tree_cu_seqlens_k"),
    ("meta parents", "minimal", _set("tree_segment_parents", lambda t: t.to("meta")), "tree_segment_parents"),
    ("meta depths", "rich", _set("tree_segment_depths", lambda t: t.to("meta")), "tree_segment_depths"),
    ("missing cu_seqlens_q (trl)", "trl", _drop("tree_cu_seqlens_q"), "tree_cu_seqlens_q"),
    ("missing cu_seqlens_q (minimal)", "minimal", _drop("tree_cu_seqlens_q"), "tree_cu_seqlens_q"),
    ("kv_index without cu_seqlens_k", "trl", _drop("tree_cu_seqlens_k"), "tree_cu_seqlens_k"),
    ("cu_seqlens_k without kv_index", "trl", _drop("tree_kv_index"), "tree_kv_index"),
    ("no structure at all", "minimal", _drop("tree_segment_parents"), "tree_segment_parents"),
    ("cu_seqlens_q not from 0", "trl", _poke("tree_cu_seqlens_q", 0, 1), "tree_cu_seqlens_q"),
    ("empty segment", "trl", _poke("tree_cu_seqlens_q", 3, lambda kw: int(kw["tree_cu_seqlens_q"][2])), "tree_cu_seqlens_q"),
    ("cu_seqlens_k decreasing", "trl", _poke("tree_cu_seqlens_k", 3, lambda kw: int(kw["tree_cu_seqlens_k"][2]) - 1),
     "tree_cu_seqlens_k"),
    ("kv path out of the row", "trl", _poke("tree_kv_index", -1, 10**6), "tree_kv_index"),
    ("kv path negative", "trl", _poke("tree_kv_index", 0, -1), "tree_kv_index"),
    ("kv path short", "trl", _set("tree_kv_index", lambda t: t[:-1]), "tree_cu_seqlens_k"),
    ("kv path not ending in its segment", "trl", _poke("tree_kv_index", _end_of_path(1), 0), "tree_kv_index"),
    ("kv path prefix not the parent's", "trl", _poke("tree_kv_index", lambda kw: int(kw["tree_cu_seqlens_k"][1]), 3),
     "tree_kv_index"),
    ("parents disagree with kv", "rich", _poke("tree_segment_parents", 3, 2), "tree_segment_parents"),
    ("depths disagree with kv", "rich", _poke("tree_segment_depths", 3, lambda kw: int(kw["tree_segment_depths"][3]) + 1),
     "tree_segment_depths"),
    ("depths as token offsets (Megatron)", "rich", _set_depths_to_token_offsets, "tree_segment_depths"),
    ("parent after its child", "minimal", _poke("tree_segment_parents", 3, 7), "tree_segment_parents"),
    ("parent out of range", "minimal", _poke("tree_segment_parents", 3, -2), "tree_segment_parents"),
    ("parents too short", "minimal", _set("tree_segment_parents", lambda t: t[:-1]), "tree_segment_parents"),
]


@pytest.mark.parametrize("fmt,mutate,field", [pytest.param(f, m, n, id=i) for i, f, m, n in ERRORS])
def test_bad_input_is_a_value_error_naming_the_field(fmt, mutate, field, packed):
    t = packed["mixed"]
    kw = mutate(getattr(t, f"{fmt}_kwargs")())
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}\b") as info:
        tr.tree_plan(kw)
    assert "Traceback" not in str(info.value)


def test_cu_seqlens_q_on_another_device_is_named(packed):
    kw = packed["mixed"].trl_kwargs()
    kw["tree_cu_seqlens_q"] = kw["tree_cu_seqlens_q"].to("meta")
    with pytest.raises(ValueError, match="tree_cu_seqlens_q is on meta"):
        tr.tree_plan(kw)


def test_row_length_mismatch_is_named(packed):
    t = packed["mixed"]
    with pytest.raises(ValueError, match=r"^tree_cu_seqlens_q\b.*%d" % (t.num_tokens + 1)):
        tr.tree_plan(t.trl_kwargs(), num_tokens=t.num_tokens + 1)
    assert tr.tree_plan(t.trl_kwargs(), num_tokens=t.num_tokens).num_tokens == t.num_tokens


# ------------------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------------------


def test_plan_is_cached_on_cu_seqlens_q(packed):
    t = packed["mixed"]
    kw = t.trl_kwargs()
    plan = tr.tree_plan(kw)
    assert tr.tree_plan(kw) is plan
    assert tr.tree_plan(dict(kw)) is plan  # a new dict holding the same tensors (a checkpoint replay)
    assert tr.tree_plan(t.trl_kwargs()) is not plan  # equal values in new tensors: a new row
    # device copies are made once
    assert plan.tensor("path_tokens") is plan.tensor("path_tokens", "cpu")
    assert plan.conv_tables(4) is plan.conv_tables(4)


def test_in_place_change_of_cu_seqlens_q_rebuilds(packed):
    t = packed["groups"]
    kw = t.minimal_kwargs()
    cu_q = kw["tree_cu_seqlens_q"]
    plan = tr.tree_plan(kw)
    assert plan.array("seg_lengths")[:2].tolist() == t.seg_lengths[:2].tolist()
    cu_q[1] -= 1  # the root segment loses its last token to its first child
    rebuilt = tr.tree_plan(kw)
    assert rebuilt is not plan and tr.tree_plan(kw) is rebuilt
    assert rebuilt.array("seg_lengths")[:2].tolist() == [int(t.seg_lengths[0]) - 1, int(t.seg_lengths[1]) + 1]
    assert torch.equal(rebuilt.array("seg_offsets"), cu_q.long())
    cu_q.zero_()  # an in-place change to garbage is validated again, not served from the cache
    with pytest.raises(ValueError, match="^tree_cu_seqlens_q"):
        tr.tree_plan(kw)


def test_plan_follows_the_other_tree_fields(packed):
    """The plan must describe the tree fields actually passed. It is cached on the
    tree_cu_seqlens_q tensor alone, so another structure passed with the same cu_seqlens_q tensor
    (a reused buffer, an in-place update of the parents or key paths only) gets the stale plan of
    the first tree, unvalidated."""
    t = packed["groups"]
    kw = t.minimal_kwargs()
    first = tr.tree_plan(kw)
    chains = {**kw, "tree_segment_parents": torch.full_like(kw["tree_segment_parents"], -1)}  # every segment a root
    chains.pop("tree_segment_depths", None)  # the old levels would (rightly) be refused for the new parents
    plan = tr.tree_plan(chains)
    assert plan.array("parents").tolist() == [-1] * t.num_segments, "stale plan served for new tree_segment_parents"
    assert plan is not first
