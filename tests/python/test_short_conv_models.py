"""Gated short conv models (LFM2, LFM2-MoE) on tree-packed rows, against every sample run alone.

LFM2's decoder layer calls its short conv without the model's kwargs, so the conv seam gets no
tree kwargs: the manifest's ``plan_carriers`` (the decoder layer classes) read the plan from the
layer's kwargs and hand it to the seam through a context, also when gradient checkpointing
replays the layer in backward. For tiny real models and every forest shape (TRL's packer), every
token's logits and every parameter's gradient must equal the samples run alone, for each strategy
(native tree conv; rescan over transformers' torch conv; rescan over the causal-conv1d stand-in
bound as transformers binds the library), with checkpointing on and off.
"""

from __future__ import annotations

import pytest

import family_harness as H
import models as M
import tree_recurrence as tr
from tree_recurrence import stand_ins, seams

CONV = "causal_conv1d_fn"
CONV_WIDTH = 3  # conv_L_cache: the forests' 1- and 2-token segments are shorter than it

_B = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
_LFM2 = dict(**_B, num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
             conv_L_cache=CONV_WIDTH)
SHORT_CONV = H.Family(
    "short_conv",
    configs={"lfm2": _LFM2,
             "lfm2_moe": dict(**_LFM2, num_dense_layers=1, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)},
    mixers={"lfm2": "Lfm2ShortConv", "lfm2_moe": "Lfm2MoeShortConv"},
    carriers={"lfm2": ("Lfm2DecoderLayer",), "lfm2_moe": ("Lfm2MoeDecoderLayer",)},
    seams=(CONV,), redraw=(), required=("conv.conv.weight",))
FAMILY, MODEL_TYPES = SHORT_CONV.name, SHORT_CONV.model_types
make_model, alone_reference = SHORT_CONV.make_model, SHORT_CONV.alone


def conv_parameter_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(("conv.conv.weight", "conv.conv.bias"))]


CASES = [pytest.param("native", "torch", id="native"),
         pytest.param("rescan", "torch", id="rescan-torch"),
         pytest.param("rescan", "causal_conv1d", id="rescan-causal_conv1d")]


def check_tree_run(model_type, forest, strategy, binding, env, decisions, checkpointing=False, overrides=None, fmt="trl"):
    bind = (lambda: env.bind(SHORT_CONV.module(model_type), [CONV])) if binding == "causal_conv1d" else None
    run = H.run_case(SHORT_CONV, model_type, forest, strategy, install=env.install, alone=alone_reference,
                     decisions=decisions, bind=bind, checkpointing=checkpointing, overrides=overrides, fmt=fmt,
                     what=f"{model_type}/{forest}/{strategy}/{binding}/ckpt={checkpointing}")
    names = conv_parameter_names(run.model)
    assert names and all(float(run.alone.grads[n].abs().max()) > 0 for n in names)
    assert run.decided and set(run.decided) == {(CONV, strategy)}, run.decided
    # once per conv layer and forward; checkpointing replays each layer (through the carrier) once more
    assert len(run.decided) == len(run.layers) * (2 if checkpointing else 1), run.decided


# ------------------------------------------------------------------------------------------------
# every model type x every forest x every strategy, checkpointing on and off
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("strategy,binding", CASES)
@pytest.mark.parametrize("forest", M.FOREST_NAMES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tree_matches_samples_alone(model_type, forest, strategy, binding, checkpointing, env, decisions):
    check_tree_run(model_type, forest, strategy, binding, env, decisions, checkpointing=checkpointing)


@pytest.mark.parametrize("fmt", ["rich", "minimal"])
@pytest.mark.parametrize("strategy", ["native", "rescan"])
def test_conv_bias_and_tree_formats(strategy, fmt, env, decisions):
    check_tree_run("lfm2", "mixed", strategy, "torch", env, decisions, checkpointing=True, fmt=fmt,
                   overrides={"conv_bias": True})


def test_rescan_runs_every_path_as_a_row_of_the_bound_kernel(env, decisions, monkeypatch):
    """Over causal-conv1d: one call per conv layer, a padded batch with one row per sample."""
    import functools

    batches = []
    real = stand_ins.causal_conv1d_fn

    @functools.wraps(real)
    def spy(x, *args, **kwargs):
        batches.append((x.shape[0], x.shape[2], kwargs.get("seq_idx")))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(stand_ins, "causal_conv1d_fn", spy)
    env.bind(SHORT_CONV.module("lfm2"), [CONV])
    tree = M.pack_forest("groups")
    model = make_model("lfm2")
    env.install(model, policy=tr.Policy(strategy="rescan"), backends={FAMILY: "kernel"})
    model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
    longest = max(len(s) for s in tree.samples)
    assert batches == [(len(tree.samples), longest, None)]


# ------------------------------------------------------------------------------------------------
# the carrier: the seam gets no kwargs, the plan comes from the decoder layer
# ------------------------------------------------------------------------------------------------


def test_conv_seam_gets_no_tree_kwargs_and_needs_the_carrier(env, decisions):
    """Without its carrier the installed seam sees no plan (it calls the original): the carrier is
    what makes LFM2 follow the tree."""
    module = SHORT_CONV.module("lfm2")
    tree = M.pack_forest("fan")
    seen = []
    model = make_model("lfm2")
    env.install(model)
    wrapper = getattr(module, CONV)

    def recording(*args, **kwargs):
        seen.append(sorted(kwargs))
        return wrapper(*args, **kwargs)

    module.causal_conv1d_fn = recording
    try:
        model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
        assert seen and all(not any(k.startswith("tree_") for k in kw) for kw in seen)
        assert [(d[1], d[2]) for d in decisions] == [(CONV, "native")]
        # the carrier's forward taken off: the seam has no plan and leaks across branches
        decisions.clear()
        owner = seams.owners[module.__name__]
        carrier = module.Lfm2DecoderLayer
        patched = carrier.forward
        carrier.forward = owner.carriers[carrier]
        try:
            model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
        finally:
            carrier.forward = patched
        assert not decisions
    finally:
        module.causal_conv1d_fn = wrapper


def test_checkpoint_replay_runs_through_the_carrier(env, decisions):
    """Under gradient checkpointing the conv runs again in backward, outside the forward's context:
    the decoder layer (the checkpointed unit) re-enters its carrier forward with the same kwargs."""
    from tree_recurrence import seams as S

    tree = M.pack_forest("tiny")
    model = make_model("lfm2")
    model.gradient_checkpointing_enable()
    env.install(model)
    out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs()).logits
    assert len(decisions) == 1 and S.current_plan() is None
    out.square().sum().backward()
    assert len(decisions) == 2 and S.current_plan() is None  # the replay decided again, with the plan


# ------------------------------------------------------------------------------------------------
# install, the failing control, uninstall, transparency
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_install_answers_tree(model_type, env):
    model = make_model(model_type)
    assert model.config.model_type == model_type
    assert list(model.config.layer_types) == ["conv", "full_attention"]
    support = env.install(model)
    assert support.mode == "tree", support.reason
    assert support.families == {FAMILY: "auto"}
    assert [layer.path for layer in support.layers] == ["model.layers.0.conv"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_unpatched_model_fails_the_comparison(model_type):
    # a width-3 conv leaks only its last two inputs across a branch: a small logit error, a large
    # one in the conv weight's gradient
    tree = M.pack_forest("mixed")
    H.check_unpatched_model_fails(SHORT_CONV, model_type, tree, alone_reference(model_type, "mixed", tree),
                                  logits_factor=2, grad_suffix="conv.conv.weight", grad_factor=10)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_uninstall_restores_module_and_carrier_by_identity(model_type):
    H.check_uninstall_restores_by_identity(SHORT_CONV, model_type)


def test_installed_model_is_bit_identical_without_tree(env):
    model = make_model("lfm2_moe")
    model.gradient_checkpointing_enable()
    H.check_bit_identical_without_tree(model, env.install)


def test_tree_row_with_cache_is_refused(env):
    H.check_tree_row_with_cache_is_refused(make_model("lfm2"), env.install)
