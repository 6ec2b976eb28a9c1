"""Rows as trainers really send them: a collated row's padded tree fields (TRL 1.16 pads
with -1, huggingface/trl#7686 with 0, offsets may repeat their final value), a batch of several rows
(refused, saying how to split it), tree kwargs made under ``torch.inference_mode()``, and meta
tensors (a clear ValueError for a plan; a model traced on the meta device runs)."""

from __future__ import annotations

import pytest
import torch

import models as M
import tree_recurrence as tr

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

MODEL_TYPE = "qwen3_5_text"
ARRAYS = ("seg_offsets", "parents", "level_offsets", "level_segments", "path_offsets", "path_tokens")


def _pad(kwargs: dict, value: int, extra: int = 3, repeat_offsets: bool = False) -> dict:
    """The kwargs as one row of a collated batch whose longest row has more of everything."""
    out = dict(kwargs)
    for name, t in kwargs.items():
        if not isinstance(t, torch.Tensor):
            continue
        if repeat_offsets and name.startswith("tree_cu_seqlens"):
            fill = t[-1].item()
        else:
            fill = value
        out[name] = torch.cat([t, torch.full((extra + (2 if name == "tree_kv_index" else 0),), fill, dtype=t.dtype)])
    return out


def _same_plan(a, b):
    assert (a.num_tokens, a.num_segments, a.num_leaves, a.num_levels) == (b.num_tokens, b.num_segments, b.num_leaves,
                                                                          b.num_levels)
    for name in ARRAYS:
        assert torch.equal(a.array(name), b.array(name)), name


@pytest.mark.parametrize("fmt", ["trl", "rich", "minimal"])
@pytest.mark.parametrize("padding", ["-1", "0", "repeated offsets"])
def test_padded_tree_fields_are_ignored(fmt, padding):
    tree = M.pack_forest("mixed")
    kwargs = getattr(tree, f"{fmt}_kwargs")()
    padded = _pad(kwargs, -1 if padding == "-1" else 0, repeat_offsets=padding == "repeated offsets")
    _same_plan(tr.tree_plan(padded), tr.tree_plan(kwargs))


def test_padded_row_runs_like_the_unpadded_row():
    M.assert_rewritten_kwargs_run_alike(MODEL_TYPE, lambda kwargs: _pad(kwargs, 0))


def test_padding_that_is_not_padding_is_still_refused():
    kwargs = M.pack_forest("fan").trl_kwargs()
    cu = kwargs["tree_cu_seqlens_q"]
    kwargs["tree_cu_seqlens_q"] = torch.cat([cu, torch.tensor([-1, 5], dtype=cu.dtype)])  # not a trailing run
    with pytest.raises(ValueError, match="tree_cu_seqlens_q"):
        tr.tree_plan(kwargs)


def test_batch_of_several_rows_is_refused_saying_how_to_split_it():
    a, b = M.pack_forest("fan").trl_kwargs(), _pad(M.pack_forest("fan").trl_kwargs(), -1)
    batch = {name: torch.stack([torch.cat([a[name], torch.full((b[name].numel() - a[name].numel(),), -1,
                                                              dtype=a[name].dtype)]), b[name]])
             for name in ("tree_cu_seqlens_q", "tree_kv_index", "tree_cu_seqlens_k")}
    ids = M.pack_forest("fan").input_ids[0]
    batch["input_ids"] = torch.stack([ids, ids])
    with pytest.raises(ValueError, match=r"tree_cu_seqlens_q: .*shape \(2, \d+\) \(a collated batch of 2 rows\); "
                                         r"forward one row at a time: .*tree_kwargs_from_batch\(batch, row=i\)"):
        tr.tree_plan(batch)
    from tree_recurrence.integrations.trl import tree_kwargs_from_batch

    for row in range(2):  # what the message says works
        _same_plan(tr.tree_plan(tree_kwargs_from_batch(batch, row=row)), tr.tree_plan(a))


# ------------------------------------------------------------------------------------------------
# 15. inference tensors and meta tensors
# ------------------------------------------------------------------------------------------------


def test_tree_kwargs_made_under_inference_mode():
    model = M.make_model(MODEL_TYPE)
    tr.install(model)
    try:
        tree = M.pack_forest("fan")
        with torch.no_grad():
            expected = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False,
                             **tree.trl_kwargs()).logits
        with torch.inference_mode():
            kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tree.trl_kwargs().items()}
            assert kwargs["tree_cu_seqlens_q"].is_inference()
            plan = tr.tree_plan(kwargs)
            assert tr.tree_plan(kwargs) is plan  # cached like any other
            out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **kwargs).logits
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    finally:
        tr.uninstall(model)


def test_meta_tree_kwargs_get_a_clear_error():
    kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in M.pack_forest("fan").trl_kwargs().items()}
    with pytest.raises(ValueError, match="tree_cu_seqlens_q: is a meta tensor"):
        tr.tree_plan(kwargs)


def test_model_traced_on_the_meta_device_with_tree_kwargs():
    """A model on the meta device (shape tracing, FLOPs counting) forwards its recurrent layers with meta
    tree kwargs: the hooks let them run untouched. (The whole model cannot run on meta in transformers
    5.17: its packed-sequence detection reads position values; its layers can.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(MODEL_TYPE, **M.GDN_CONFIGS[MODEL_TYPE])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert tr.install(model).mode == "tree"
    try:
        tree = M.pack_forest("fan")
        meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in tree.trl_kwargs().items()}
        hidden = torch.empty(1, tree.num_tokens, config.hidden_size, device="meta")
        with torch.no_grad():
            out = model.model.layers[0].linear_attn(hidden, **meta)
        assert out.is_meta and out.shape == hidden.shape
    finally:
        tr.uninstall(model)


# ------------------------------------------------------------------------------------------------
# 10. huggingface/trl#7686's format in full: parents, depths and level sizes
# ------------------------------------------------------------------------------------------------


def _level_sizes(tree) -> torch.Tensor:
    """Segments per level, counted from the harness's own depths (derived from TRL's key paths)."""
    return torch.bincount(tree.depths)


def test_level_sizes_are_read_and_checked_against_the_key_paths():
    """tree_level_sizes: the level sizes alone (tree_sizes, with its header, and tree_n_chunks, a chunk count
    that never cuts them: test_formats_7686_and_padding.py)."""
    name = "tree_level_sizes"
    tree = M.pack_forest("mixed")
    sizes = _level_sizes(tree)
    kwargs = {**tree.rich_kwargs(), name: sizes.clone()}
    plan = tr.tree_plan(kwargs)
    offsets = plan.array("level_offsets")
    assert (offsets[1:] - offsets[:-1]).tolist() == sizes.tolist()
    padded = {**tree.rich_kwargs(), name: torch.cat([sizes, torch.zeros(4, dtype=sizes.dtype)])}
    _same_plan(tr.tree_plan(padded), plan)
    with pytest.raises(ValueError, match=rf"{name}: entry {len(sizes)} is 7 after the tree's {len(sizes)} levels"):
        tr.tree_plan({**tree.rich_kwargs(), name: torch.cat([sizes, torch.full((2,), 7)]), "tree_n_chunks": len(sizes)})

    wrong = sizes.clone()
    wrong[1] += 1
    with pytest.raises(ValueError, match=rf"{name}: level 1: {int(wrong[1])} segments, but the key paths put "
                                         rf"{int(sizes[1])} segments at level 1"):
        tr.tree_plan({**tree.rich_kwargs(), name: wrong})
    with pytest.raises(ValueError, match=rf"{name}: {len(sizes) - 1} levels"):
        tr.tree_plan({**tree.trl_kwargs(), name: sizes[:-1].clone()})


def test_7686_format_runs_like_trls_format():
    model = M.make_model(MODEL_TYPE)
    tr.install(model)
    try:
        tree = M.pack_forest("multiturn")
        full = {**tree.rich_kwargs(), "tree_level_sizes": _level_sizes(tree)}
        with torch.no_grad():
            expected = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False,
                             **tree.trl_kwargs()).logits
            out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **full).logits
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    finally:
        tr.uninstall(model)


def test_tree_kwargs_from_batch_reads_the_level_sizes():
    from tree_recurrence.integrations.trl import tree_kwargs_from_batch

    trees = [M.pack_forest("fan"), M.pack_forest("mixed")]
    rows = [{**t.rich_kwargs(), "tree_level_sizes": _level_sizes(t), "input_ids": t.input_ids[0]} for t in trees]
    batch = {}
    for key in ("tree_cu_seqlens_q", "tree_kv_index", "tree_cu_seqlens_k", "tree_segment_parents",
                "tree_segment_depths", "tree_level_sizes", "input_ids"):
        width = max(r[key].numel() for r in rows)
        pad = -1 if key in ("tree_cu_seqlens_q", "tree_kv_index", "tree_cu_seqlens_k") else 0  # TRL 1.16 / #7686
        batch[key] = torch.stack([torch.cat([r[key], torch.full((width - r[key].numel(),), pad, dtype=r[key].dtype)])
                                  for r in rows])
    for i, tree in enumerate(trees):
        kwargs = tree_kwargs_from_batch(batch, row=i)
        assert torch.equal(kwargs["tree_level_sizes"], _level_sizes(tree))
        _same_plan(tr.tree_plan({k: v for k, v in kwargs.items() if k.startswith("tree_")}), tr.tree_plan(tree.rich_kwargs()))
    batch["tree_n_chunks"] = torch.tensor([len(_level_sizes(t)) for t in trees])
    assert tree_kwargs_from_batch(batch, row=0)["tree_n_chunks"] == len(_level_sizes(trees[0]))


# ------------------------------------------------------------------------------------------------
# 9. a row longer than the plan: padding tokens after the tree's tokens
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["native", "fork", "rescan"])
def test_recurrent_layer_on_a_row_longer_than_the_plan(strategy):
    """A collator pads input_ids past the tree's tokens: the recurrent layer runs its seams on the plan's
    tokens; the real tokens' outputs equal the unpadded row's and get no gradient from the padding, and the
    seams give the padding tokens zeros."""
    model = M.make_model(MODEL_TYPE)
    policy = tr.Policy(strategy="auto" if strategy == "native" else strategy)
    tr.install(model, policy=policy, backends={"gated_delta_net": "auto" if strategy == "native" else "kernel"})
    try:
        mixer = model.model.layers[0].linear_attn
        tree = M.pack_forest("fan")
        n = tree.num_tokens
        hidden = torch.randn(1, n, model.config.hidden_size)
        padded = torch.cat([hidden, torch.randn(1, 5, model.config.hidden_size)], 1).requires_grad_()
        expected = mixer(hidden, **tree.trl_kwargs())
        out = mixer(padded, **tree.trl_kwargs())
        assert out.shape == padded.shape
        torch.testing.assert_close(out[:, :n], expected, rtol=1e-5, atol=1e-5)
        out[:, :n].sum().backward()
        assert torch.count_nonzero(padded.grad[:, n:]) == 0, "gradient leaked from the padding into real tokens"
    finally:
        tr.uninstall(model)
