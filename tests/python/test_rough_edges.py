"""Rough edges users hit: a script that installs and exits without uninstall
exits cleanly; the tree fields as Python int lists are accepted wherever an index tensor is read,
with the same validation; a collated row's padding must be exactly padding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence.integrations.trl import tree_kwargs_from_batch

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

MODEL_TYPE = "qwen3_5_text"
ARRAYS = ("seg_offsets", "parents", "level_offsets", "level_segments", "path_offsets", "path_tokens", "token_position")


def _same_plan(a, b):
    assert (a.num_tokens, a.num_segments, a.num_leaves, a.num_levels) == (b.num_tokens, b.num_segments, b.num_leaves,
                                                                          b.num_levels)
    for name in ARRAYS:
        assert torch.equal(a.array(name), b.array(name)), name


# ------------------------------------------------------------------------------------------------
# a clean interpreter exit
# ------------------------------------------------------------------------------------------------


def test_install_then_exit_without_uninstall_prints_nothing():
    """The weak-reference callbacks of installed models (install.py's and seams.py's) used to run after
    module teardown at exit and print two 'Exception ignored' tracebacks."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {here!r})
        import torch
        import models as M
        import tree_recurrence as tr

        model = M.make_model({MODEL_TYPE!r})
        support = tr.install(model)
        assert support.mode == "tree", support
        other = M.make_model({MODEL_TYPE!r}, seed=1)
        tr.install(other)
        tree = M.pack_forest("fan")
        with torch.no_grad():
            model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.rich_kwargs())
        print("ran")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "", done.stderr


def test_collected_model_still_releases_its_modules():
    """The exit guard leaves the ordinary path alone: a model collected without uninstall releases its hooks."""
    import gc

    from tree_recurrence import seams

    model = M.make_model(MODEL_TYPE)
    support = tr.install(model)
    name = support.modules[0]
    assert name in seams.owners
    del model, support
    gc.collect()
    seams.sweep()
    assert name not in seams.owners


# ------------------------------------------------------------------------------------------------
# the tree fields as Python int lists
# ------------------------------------------------------------------------------------------------


def _as_lists(kwargs: dict, nested: bool = False) -> dict:
    return {k: ([v.tolist()] if nested else v.tolist()) if isinstance(v, torch.Tensor) and k.startswith("tree_") else v
            for k, v in kwargs.items()}


@pytest.mark.parametrize("fmt", ["trl", "rich", "minimal"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "one row"])
def test_int_lists_build_the_same_plan(fmt, nested):
    tree = M.pack_forest("mixed")
    kwargs = getattr(tree, f"{fmt}_kwargs")()
    lists = _as_lists(kwargs, nested)
    assert isinstance(lists["tree_cu_seqlens_q"], list)
    plan = tr.tree_plan(lists)
    _same_plan(plan, tr.tree_plan(kwargs))
    assert tr.tree_plan(lists) is plan  # cached while the lists are unchanged
    offsets = lists["tree_cu_seqlens_q"][0] if nested else lists["tree_cu_seqlens_q"]
    offsets.append(offsets[-1])  # changed in place (padding: the same tree): a new plan
    again = tr.tree_plan(lists)
    assert again is not plan
    _same_plan(again, plan)


def test_int_lists_mixed_with_tensors_and_tuples():
    kwargs = M.pack_forest("fan").trl_kwargs()
    mixed = dict(kwargs, tree_cu_seqlens_q=tuple(kwargs["tree_cu_seqlens_q"].tolist()),
                 tree_kv_index=kwargs["tree_kv_index"].tolist())
    _same_plan(tr.tree_plan(mixed), tr.tree_plan(kwargs))


def test_int_lists_are_validated_like_tensors():
    kwargs = M.pack_forest("fan").minimal_kwargs()
    lists = _as_lists(kwargs)
    floats = dict(lists, tree_segment_parents=[float(p) for p in lists["tree_segment_parents"]])
    with pytest.raises(ValueError, match=r"tree_segment_parents: expected a sequence of ints.*entry 0 is -1\.0"):
        tr.tree_plan(floats)
    bools = dict(lists, tree_cu_seqlens_q=[True, False])
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: expected a sequence of ints.*entry 0 is True"):
        tr.tree_plan(bools)
    ragged = dict(lists, tree_cu_seqlens_q=[[0, 3], [0]])
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: expected a sequence of ints"):
        tr.tree_plan(ragged)
    rows = dict(lists, tree_cu_seqlens_q=[lists["tree_cu_seqlens_q"]] * 2)
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: .*\(a collated batch of 2 rows\)"):
        tr.tree_plan(rows)
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: expected a torch.Tensor or a sequence of ints, got str"):
        tr.tree_plan(dict(lists, tree_cu_seqlens_q="0, 3"))
    bad = dict(lists, tree_segment_parents=[-1] + [5] * (len(lists["tree_segment_parents"]) - 1))
    with pytest.raises(ValueError, match="tree_segment_parents"):  # the core's checks, as for tensors
        tr.tree_plan(bad)


def test_int_lists_run_the_model_like_tensors():
    M.assert_rewritten_kwargs_run_alike(MODEL_TYPE, _as_lists)


def test_tree_kwargs_from_batch_takes_int_lists():
    tree = M.pack_forest("fan")
    row = {"input_ids": tree.input_ids[0], **tree.trl_kwargs()}
    expected = tree_kwargs_from_batch(row)
    lists = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in row.items()}
    got = tree_kwargs_from_batch(lists)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key
    with pytest.raises(ValueError, match=r"tree_kwargs_from_batch: tree_kv_index: expected a sequence of ints"):
        tree_kwargs_from_batch(dict(lists, tree_kv_index=[0.5] * len(lists["tree_kv_index"])))


# ------------------------------------------------------------------------------------------------
# padding is exactly padding
# ------------------------------------------------------------------------------------------------


def test_offsets_with_a_mixed_tail_are_refused():
    """[0, 3, 0, 3] with one parent built a one-segment plan and dropped the rest."""
    kwargs = {"tree_cu_seqlens_q": torch.tensor([0, 3, 0, 3]), "tree_segment_parents": torch.tensor([-1])}
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: malformed padding after the row's end \(3, entry 1\): "
                                         r"entry 2 is 0 but entry 3 is 3"):
        tr.tree_plan(kwargs)
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: malformed padding"):
        tr.tree_plan({"tree_cu_seqlens_q": [0, 3, 0, 3], "tree_segment_parents": [-1]})
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: malformed padding .* entry 2 is -1 but entry 3 is 0"):
        tr.tree_plan({"tree_cu_seqlens_q": [0, 3, -1, 0], "tree_segment_parents": [-1]})
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: entry 2 is 2 after the row's end"):
        tr.tree_plan({"tree_cu_seqlens_q": [0, 3, 2], "tree_segment_parents": [-1, 0]})


@pytest.mark.parametrize("tail", [[-1, -1], [0, 0], [3, 3]], ids=["-1", "0", "end"])
def test_offsets_with_a_uniform_tail_are_padding(tail):
    plan = tr.tree_plan({"tree_cu_seqlens_q": [0, 3] + tail, "tree_segment_parents": [-1]})
    assert (plan.num_segments, plan.num_tokens) == (1, 3)


def test_segment_fields_with_a_mixed_tail_are_refused():
    tree = M.pack_forest("mixed")
    kwargs = tree.minimal_kwargs()
    parents = kwargs["tree_segment_parents"]
    segments = parents.numel()
    for tail in ([0, -1], [-1, 0, 0], [2]):
        bad = dict(kwargs, tree_segment_parents=torch.cat([parents, torch.tensor(tail, dtype=parents.dtype)]))
        with pytest.raises(ValueError, match=rf"tree_segment_parents: (malformed padding )?(entry {segments} is \d+ )?"
                                             rf"after the {segments} segments of tree_cu_seqlens_q"):
            tr.tree_plan(bad)
    for pad in (-1, 0):
        good = dict(kwargs, tree_segment_parents=torch.cat([parents, torch.full((3,), pad, dtype=parents.dtype)]))
        _same_plan(tr.tree_plan(good), tr.tree_plan(kwargs))


def test_kv_index_and_level_sizes_with_a_mixed_tail_are_refused():
    tree = M.pack_forest("mixed")
    kwargs = tree.trl_kwargs()
    kv = kwargs["tree_kv_index"]
    bad = dict(kwargs, tree_kv_index=torch.cat([kv, torch.tensor([-1, 4], dtype=kv.dtype)]))
    with pytest.raises(ValueError, match=rf"tree_kv_index: malformed padding after the {kv.numel()} entries "
                                         rf"tree_cu_seqlens_k ends at: entry {kv.numel()} is -1 but entry "
                                         rf"{kv.numel() + 1} is 4"):
        tr.tree_plan(bad)
    plan = tr.tree_plan(kwargs)
    offsets = plan.array("level_offsets")
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    bad = dict(kwargs, tree_level_sizes=sizes + [0, 2])
    with pytest.raises(ValueError, match=rf"tree_level_sizes: malformed padding after the tree's {len(sizes)} levels"):
        tr.tree_plan(bad)
    _same_plan(tr.tree_plan(dict(kwargs, tree_level_sizes=sizes + [0, 0])), plan)
