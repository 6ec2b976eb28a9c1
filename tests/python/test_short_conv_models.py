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

import importlib

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import reference, seams

FAMILY = "short_conv"
CONV = "causal_conv1d_fn"
CONV_WIDTH = 3  # conv_L_cache: the forests' 1- and 2-token segments are shorter than it

_B = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
_LFM2 = dict(**_B, num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
             conv_L_cache=CONV_WIDTH)
CONFIGS = {
    "lfm2": _LFM2,
    "lfm2_moe": dict(**_LFM2, num_dense_layers=1, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}
MODEL_TYPES = list(CONFIGS)
MODULES = {t: f"transformers.models.{t}.modeling_{t}" for t in MODEL_TYPES}
MIXERS = {"lfm2": "Lfm2ShortConv", "lfm2_moe": "Lfm2MoeShortConv"}
CARRIERS = {"lfm2": "Lfm2DecoderLayer", "lfm2_moe": "Lfm2MoeDecoderLayer"}


def _module(model_type):
    return importlib.import_module(MODULES[model_type])


def make_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **overrides})
    for attr in ("attention_dropout", "hidden_dropout", "dropout"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    config.use_cache = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=M.tree_attention_name()).float()
    model.train()
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout)), "dropout must be off"
    return model


def conv_parameter_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(("conv.conv.weight", "conv.conv.bias"))]


_ALONE: dict[tuple, M.Result] = {}


def alone_reference(model_type: str, forest: str, tree: M.PackedTree, **overrides) -> M.Result:
    key = (model_type, forest, tuple(sorted(overrides.items())))
    if key not in _ALONE:
        assert MODULES[model_type] not in seams.owners, "alone references run on unpatched modules"
        _ALONE[key] = M.run_alone(make_model(model_type, **overrides), tree.samples, M.loss_weights(tree.samples))
    return _ALONE[key]


@pytest.fixture
def env(decisions):
    class Env:
        def __init__(self):
            self.models, self.restores = [], []

        def bind(self, model_type, names):
            self.restores.append(reference.bind_reference_kernels(_module(model_type), seams=names))

        def install(self, model, **kw):
            self.models.append(model)
            return tr.install(model, **kw)

    e = Env()
    yield e
    for model in e.models:
        tr.uninstall(model)
    for restore in reversed(e.restores):
        restore()


CASES = [pytest.param("native", "torch", id="native"),
         pytest.param("rescan", "torch", id="rescan-torch"),
         pytest.param("rescan", "causal_conv1d", id="rescan-causal_conv1d")]


def check_tree_run(model_type, forest, strategy, binding, env, decisions, checkpointing=False, overrides=None, fmt="trl"):
    overrides = overrides or {}
    tree = M.pack_forest(forest)
    alone = alone_reference(model_type, forest, tree, **overrides)
    if binding == "causal_conv1d":
        env.bind(model_type, [CONV])
    bound = getattr(_module(model_type), CONV)
    model = make_model(model_type, **overrides)
    if checkpointing:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    backend = "auto" if strategy == "native" else "kernel"
    support = env.install(model, policy=tr.Policy(strategy=strategy), backends={FAMILY: backend})
    assert support.mode == "tree", support.reason
    layers = [n for n, m in model.named_modules() if type(m).__name__ == MIXERS[model_type]]
    assert sorted(layer.path for layer in support.layers) == sorted(layers) and layers
    carrier = getattr(_module(model_type), CARRIERS[model_type])
    assert getattr(carrier.forward, seams.WRAPPER_MARK) == "carrier"
    assert getattr(_module(model_type), CONV).__tree_recurrence_original__ is bound

    kwargs = {"trl": tree.trl_kwargs, "rich": tree.rich_kwargs, "minimal": tree.minimal_kwargs}[fmt]()
    decisions.clear()
    result = M.run_tree(model, tree, M.loss_weights(tree.samples), kwargs)
    M.assert_matches(result, alone, what=f"{model_type}/{forest}/{strategy}/{binding}/ckpt={checkpointing}")
    names = conv_parameter_names(model)
    assert names and all(float(alone.grads[n].abs().max()) > 0 for n in names)
    got = [(d[1], d[2]) for d in decisions if d[0] == FAMILY]
    assert got and set(got) == {(CONV, strategy)}, got
    # once per conv layer and forward; checkpointing replays each layer (through the carrier) once more
    assert len(got) == len(layers) * (2 if checkpointing else 1), got


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
    real = reference.causal_conv1d_fn

    @functools.wraps(real)
    def spy(x, *args, **kwargs):
        batches.append((x.shape[0], x.shape[2], kwargs.get("seq_idx")))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(reference, "causal_conv1d_fn", spy)
    env.bind("lfm2", [CONV])
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
    module = _module("lfm2")
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
    tree = M.pack_forest("mixed")
    alone = alone_reference(model_type, "mixed", tree)
    model = make_model(model_type)
    tr.install(model)
    tr.uninstall(model)
    result = M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs())
    err, tol = M.logits_error(result, alone)
    # a width-3 conv leaks only its last two inputs across a branch: a small logit error, a large
    # one in the conv weight's gradient
    assert err > 2 * tol, f"unpatched {model_type}: error {err:.2e} does not exceed the tolerance {tol:.2e}"
    grad_err = M.grad_errors(result, alone)
    assert any(e > 10 * t for n, (e, t) in grad_err.items() if n.endswith("conv.conv.weight"))
    with pytest.raises(AssertionError):
        M.assert_matches(result, alone)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_uninstall_restores_module_and_carrier_by_identity(model_type):
    module = _module(model_type)
    attrs = dict(vars(module))
    carrier = getattr(module, CARRIERS[model_type])
    forward = carrier.__dict__["forward"]
    first, second = make_model(model_type), make_model(model_type, seed=1)
    try:
        assert tr.install(first).mode == "tree" and tr.install(second).mode == "tree"
        assert carrier.__dict__["forward"] is not forward
        tr.uninstall(first)
        assert getattr(carrier.forward, seams.WRAPPER_MARK) == "carrier"
        tr.uninstall(second)
        assert carrier.__dict__["forward"] is forward
        assert module.__name__ not in seams.owners
        assert not [n for n, obj in vars(module).items() if attrs.get(n) is not obj]
    finally:
        tr.uninstall(first)
        tr.uninstall(second)


def test_installed_model_is_bit_identical_without_tree(env):
    ids = torch.randint(2, M.VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    model = make_model("lfm2_moe")
    model.gradient_checkpointing_enable()

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False).logits
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = run()
    env.install(model)
    hooked = run()
    assert torch.equal(plain[0], hooked[0])
    assert all(torch.equal(plain[1][n], hooked[1][n]) for n in plain[1])


def test_tree_row_with_cache_is_refused(env):
    tree = M.pack_forest("fan")
    model = make_model("lfm2")
    env.install(model)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=True, **tree.trl_kwargs())
