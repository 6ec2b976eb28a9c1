"""A bound fused Mamba2 kernel that declines (answers None), against every sample run alone.

transformers' Mamba2 mixers call ``mamba2_split_conv1d_scan_combined`` and take their split path
(conv seam, chunk-scan seam, their own gated norm, ``out_proj``) when it answers None: a library
kernel may refuse a layer (a quantized ``out_proj``). The samples alone then run the split path, so
the tree row must too (its split seams on the trie), and run the family's native fused semantics
only for layers whose bound kernel does not decline (plugins/mamba2/python/adapters.py). With
n_groups 2 the split path normalises over all channels and the fused one per group: a tree row
that ran the fused semantics where the samples alone declined would differ (mamba2 by ~1).

Here: the mamba-ssm / causal-conv1d stand-ins bound for the conv and the chunk scan, and a fused
kernel bound the way transformers binds mamba-ssm that declines for every layer, or only for
layers whose ``out_proj`` weight carries a mark; tiny fp32 models on the CPU, logits at every token
and every parameter's gradient (A_log, dt_bias, D included) against the samples alone through the
same bindings; the route each seam took; the probe's calls (once per layer per row, a few tokens).
"""

from __future__ import annotations

import functools

import pytest
import torch

import models as M
import tree_recurrence as tr
from test_mamba2_models import CONV, FAMILY, FUSED, GROUPS_KEY, MAMBA2, SCAN
from tree_recurrence import driver, stand_ins

MODEL_TYPES = ["mamba2", "nemotron_h", "bamba", "granitemoehybrid"]
REQUIRED = ("A_log", "dt_bias", ".D", "conv1d.weight")
FOREST = "groups"  # several roots, branches, a single sample, rows across the mixers' chunk of 8
MARK = "_test_fused_declines"  # set on a layer's out_proj weight: the kernel below declines that layer


class DecliningFused:
    """mamba-ssm's fused kernel (its stand-in, same signature) that answers None for every call
    (``always``) or for calls whose ``outproj_weight`` carries ``MARK``; records each call's
    (batch, tokens, declined)."""

    def __init__(self, always: bool):
        self.always, self.calls = always, []
        fused = stand_ins.mamba_split_conv1d_scan_combined

        @functools.wraps(fused)
        def kernel(zxbcdt, *args, outproj_weight=None, **kwargs):
            declined = self.always or getattr(outproj_weight, MARK, False)
            self.calls.append((zxbcdt.shape[0], zxbcdt.shape[1], declined))
            return None if declined else fused(zxbcdt, *args, outproj_weight=outproj_weight, **kwargs)

        self.fn = kernel


def bind(env, model_type: str, always: bool) -> DecliningFused:
    """The conv and chunk-scan stand-ins, and a declining fused kernel, bound into the model type's
    modeling module as transformers binds the libraries (restored by ``env`` at teardown)."""
    module = MAMBA2.module(model_type)
    env.bind(module, [CONV, SCAN])
    kernel = DecliningFused(always)
    previous = getattr(module, FUSED)
    setattr(module, FUSED, stand_ins.wrap_as_library(previous.__wrapped__, "mamba_ssm",
                                                     "mamba_split_conv1d_scan_combined", kernel.fn))
    env.restores.append(lambda: setattr(module, FUSED, previous))
    return kernel


def probe_tokens(plan) -> int:
    """The probe's length: the first sample's tokens, at most the mixers' chunk size (8 here)."""
    return min(int(plan.array("path_offsets")[1]), 8)


def per_layer(layers: list[list[tuple[str, str]]], forwards: int) -> list[tuple[str, str]]:
    """The (seam, strategy) decisions expected of each layer's calls, ``forwards`` times (a checkpoint
    replay runs every layer once more), sorted."""
    return sorted([d for layer in layers for d in layer] * forwards)


@pytest.mark.parametrize("backend,strategy", [("auto", "native"), ("kernel", "rescan")])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_declining_fused_kernel_takes_the_split_seams(model_type, backend, strategy, env, decisions):
    """Every layer's fused kernel declines: the samples alone take the split path through the bound
    conv and scan; the tree row declines the fused seam too (native: the probe answers None, the
    kernel's only call per layer; kernel: the bound kernel over every path answers None) and runs the
    split seams on the trie: logits and every gradient equal the samples alone's."""
    tree = M.pack_forest(FOREST)
    fused = bind(env, model_type, always=True)
    model = MAMBA2.make_model(model_type)
    assert model.config.to_dict()[GROUPS_KEY[model_type]] == 2
    weights = M.loss_weights(tree.samples)
    alone = M.run_alone(model, tree.samples, weights)
    assert fused.calls and all(declined for _, _, declined in fused.calls)
    env.install(model, policy=tr.Policy(strategy=strategy), backends={FAMILY: backend})
    layers = len(MAMBA2.mixer_paths(model, model_type))
    fused.calls.clear()
    decisions.clear()
    kwargs = tree.trl_kwargs()
    result = M.run_tree(model, tree, weights, kwargs)
    M.assert_matches(result, alone, model, what=f"{model_type}: declining fused kernel ({backend})", required=REQUIRED)
    got = sorted((d[1], d[2]) for d in decisions if d[0] == FAMILY)
    assert got == per_layer([[(FUSED, "decline"), (CONV, strategy), (SCAN, strategy)]] * layers, 1), got
    plan = tr.tree_plan(kwargs)
    if strategy == "native":  # one probe per layer: batch 1, the first sample's opening tokens (chunk 8)
        assert fused.calls == [(1, probe_tokens(plan), True)] * layers, fused.calls
    else:  # the bound kernel over every root-to-leaf path, once per layer
        assert fused.calls == [(plan.num_leaves, plan.max_path_length, True)] * layers, fused.calls


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_fused_kernel_declining_one_layer_of_two(checkpointing, env, decisions):
    """One plan serves every layer: the bound kernel declines layer 0 (its out_proj weight marked) and
    runs layer 1. The samples alone take the split path in layer 0 and the fused kernel in layer 1;
    the tree row declines layer 0 (split seams, native) and runs layer 1's fused seam natively, with
    gradient checkpointing too (the replay takes the same routes). The kernel is asked once per
    layer per row (the replay reuses the answer)."""
    tree = M.pack_forest(FOREST)
    fused = bind(env, "mamba2", always=False)
    model = MAMBA2.make_model("mamba2")
    paths = MAMBA2.mixer_paths(model, "mamba2")
    assert len(paths) == 2
    setattr(model.get_submodule(paths[0]).out_proj.weight, MARK, True)
    if checkpointing:
        model.gradient_checkpointing_enable()
    weights = M.loss_weights(tree.samples)
    alone = M.run_alone(model, tree.samples, weights)
    assert {declined for _, _, declined in fused.calls} == {True, False}
    env.install(model)  # defaults: backend auto, the native kernels
    fused.calls.clear()
    decisions.clear()
    kwargs = tree.trl_kwargs()
    result = M.run_tree(model, tree, weights, kwargs)
    M.assert_matches(result, alone, model, what=f"mamba2: fused kernel declining layer 0 (ckpt={checkpointing})",
                     required=REQUIRED)
    got = sorted((d[1], d[2]) for d in decisions if d[0] == FAMILY)
    layers = [[(FUSED, "decline"), (CONV, "native"), (SCAN, "native")], [(FUSED, "native")]]
    if checkpointing:  # the replay repeats the routes (a replay stops once the tensors it needs are back,
        # before the fused adapter's record at its end: layer 1's native fused is logged once)
        assert sorted(set(got)) == per_layer(layers, 1) and got.count((FUSED, "decline")) == 2, got
    else:
        assert got == per_layer(layers, 1), got
    probe = probe_tokens(tr.tree_plan(kwargs))
    assert fused.calls == [(1, probe, True), (1, probe, False)], fused.calls


def test_decline_answer_follows_a_replaced_weight_on_the_same_row(env, decisions):
    """The answer is cached per layer on the row's plan and keyed by the layer's weights: forwarding
    the same row again after layer 1's out_proj weight was replaced by a marked one (as quantizing a
    layer replaces its weight) asks the kernel again for that layer and declines it, while layer 0's
    answer is reused."""
    tree = M.pack_forest("fan")
    fused = bind(env, "mamba2", always=False)
    model = MAMBA2.make_model("mamba2")
    paths = MAMBA2.mixer_paths(model, "mamba2")
    env.install(model)
    kwargs = tree.trl_kwargs()

    def forward():
        fused.calls.clear()
        decisions.clear()
        with torch.no_grad():
            model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **kwargs)
        return [(d[1], d[2]) for d in decisions if d[0] == FAMILY and d[1] == FUSED]

    assert forward() == [(FUSED, "native")] * 2
    assert [declined for _, _, declined in fused.calls] == [False, False]
    assert forward() == [(FUSED, "native")] * 2 and not fused.calls  # the same plan: answers reused
    out_proj = model.get_submodule(paths[1]).out_proj
    marked = torch.nn.Parameter(out_proj.weight.detach().clone())
    setattr(marked, MARK, True)
    out_proj.weight = marked
    assert forward() == [(FUSED, "native"), (FUSED, "decline")]
    assert [declined for _, _, declined in fused.calls] == [True]


@pytest.mark.parametrize("fused_binding", ["torch", "declining"])
def test_backend_stand_ins_declines_where_the_bound_kernel_declines(fused_binding, env, decisions):
    """Backend ``stand_ins`` runs the library stand-ins in the bound kernels' place, but the samples
    alone call the bound fused kernel: bound to transformers' torch fallback, or to a library kernel
    that declines, they take the split path. So does the tree row (the fused stand-in, which never
    declines, does not run): the split seams over the conv and scan stand-ins."""
    tree = M.pack_forest(FOREST)
    module = MAMBA2.module("mamba2")
    fused = bind(env, "mamba2", always=True) if fused_binding == "declining" else None
    model = MAMBA2.make_model("mamba2")
    weights = M.loss_weights(tree.samples)
    alone = M.run_alone(model, tree.samples, weights)
    env.install(model, policy=tr.Policy(strategy="rescan"), backends={FAMILY: "stand_ins"})
    if fused is not None:
        fused.calls.clear()
    decisions.clear()
    kwargs = tree.trl_kwargs()
    result = M.run_tree(model, tree, weights, kwargs)
    M.assert_matches(result, alone, model, what=f"mamba2: backend stand_ins, fused {fused_binding}", required=REQUIRED)
    got = sorted((d[1], d[2]) for d in decisions if d[0] == FAMILY)
    assert got == per_layer([[(FUSED, "decline"), (CONV, "rescan"), (SCAN, "rescan")]] * 2, 1), got
    if fused is not None:  # asked once per layer, on a probe
        assert fused.calls == [(1, probe_tokens(tr.tree_plan(kwargs)), True)] * 2, fused.calls
    else:  # the seam is transformers' own: its torch fallback
        assert not driver.bound_implementation(getattr(module, FUSED).__tree_recurrence_original__)[2]
