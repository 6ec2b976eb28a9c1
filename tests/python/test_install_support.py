"""install(): what it answers (tree / chains / none) and what it changes (hooks shared per modeling
module, idempotent, restored by identity), backends (run-time swap, errors listing the choices, the
"trl" backend), and the "chains" support mode.

"none": a model with a recurrent layer no family covers (an ``A_log`` module or a causal depthwise
``nn.Conv1d`` outside every covered mixer, or a real model whose family plugin is absent, here
switched off with TREE_RECURRENCE_DISABLE_FAMILIES in a fresh process: the package's plugin folder
is always searched). "chains": a family that declares ``follows: chains`` (a Python-registered
family, and the gated_delta_net manifest with its entries changed) claims its layers, a row of
whole samples (TRL-format chains, ``ChainRow``) runs and equals the samples alone, and a row that
branches raises a ValueError naming the layer.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import plugins, seams
from tree_recurrence._tree_kwargs import tree_plan

install_mod = importlib.import_module("tree_recurrence.install")  # the module (the package exports the function)

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

FAMILY = "gated_delta_net"
MODEL_TYPE = "qwen3_5_text"
SEAMS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


def _module():
    return importlib.import_module(M.MODELING_MODULES[MODEL_TYPE])


def _tree_forward(model, tree: M.PackedTree, kwargs=None):
    kwargs = tree.trl_kwargs() if kwargs is None else kwargs
    return model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **kwargs).logits[0]


# ------------------------------------------------------------------------------------------------
# "none"
# ------------------------------------------------------------------------------------------------


class _HiddenDecay(torch.nn.Module):
    """A state-space-like layer no family knows: it holds A_log."""

    def __init__(self, dim):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.zeros(dim))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x) * torch.exp(-torch.exp(self.A_log))


class _Block(torch.nn.Module):
    def __init__(self, dim, inner):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.inner = inner


class _CustomModel(torch.nn.Module):
    def __init__(self, inner, dim=16):
        super().__init__()
        self.embed = torch.nn.Embedding(32, dim)
        self.blocks = torch.nn.ModuleList([_Block(dim, torch.nn.Linear(dim, dim)), _Block(dim, inner)])


def test_custom_model_with_a_log_layer_is_none(installed):
    support = installed(_CustomModel(_HiddenDecay(16)))
    assert support.mode == "none" and not support
    assert "blocks.1.inner (_HiddenDecay)" in support.reason and "A_log" in support.reason, support.reason


@pytest.mark.parametrize("width", [2, 4])
def test_custom_model_with_causal_depthwise_conv_is_none(installed, width):
    conv = torch.nn.Conv1d(16, 16, width, groups=16, padding=width - 1)
    support = installed(_CustomModel(conv))
    assert support.mode == "none"
    assert "blocks.1.inner (Conv1d)" in support.reason and f"causal depthwise conv (width {width})" in support.reason


@pytest.mark.parametrize("conv", [
    pytest.param(lambda: torch.nn.Conv1d(16, 16, 3, groups=16, padding=1), id="centered"),
    pytest.param(lambda: torch.nn.Conv1d(16, 32, 3, padding=2), id="dense"),
    pytest.param(lambda: torch.nn.Conv1d(16, 16, 1, groups=16), id="pointwise"),
])
def test_convs_that_do_not_mix_causally_are_not_refused(installed, conv):
    assert installed(_CustomModel(conv())).mode == "tree"


def test_real_model_with_an_uncovered_conv_outside_its_mixers_is_none(installed):
    """Covered GDN layers do not make up for a causal depthwise conv added elsewhere; and a
    refused model gets no hooks at all."""
    model = M.make_model(MODEL_TYPE)
    model.model.extra_conv = torch.nn.Conv1d(64, 64, 4, groups=64, padding=3)
    support = installed(model)
    assert support.mode == "none" and "model.extra_conv (Conv1d)" in support.reason, support.reason
    assert M.MODELING_MODULES[MODEL_TYPE] not in seams.owners


_ABSENT_PLUGIN_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import models as M
    import tree_recurrence as tr
    from tree_recurrence import plugins, seams
    from tree_recurrence.__main__ import doctor_report
    model = M.make_model("qwen3_5_text")
    support = tr.install(model)
    report = doctor_report()
    print(json.dumps({{"mode": support.mode, "reason": support.reason, "families": sorted(plugins.families()),
                      "patched": sorted(seams.owners),
                      "refused": [r for r in report["refused"] if r["family"] == "gated_delta_net"]}}))
""")


def test_real_model_without_its_family_plugin_is_none():
    """A fresh process with TREE_RECURRENCE_DISABLE_FAMILIES=gated_delta_net: the package folder
    still holds the plugin, but the family is absent; Qwen3.5's linear layers are then covered by
    nothing and install answers "none" naming them (the A_log and the causal conv of every mixer)."""
    env = {**os.environ, plugins.DISABLE_ENV: f"{FAMILY},not_a_family", "HF_HUB_OFFLINE": "1"}
    env.pop("TREE_RECURRENCE_PLUGIN_PATH", None)
    script = _ABSENT_PLUGIN_SCRIPT.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mode"] == "none"
    assert FAMILY not in out["families"] and {"mamba2", "short_conv"} <= set(out["families"])
    # (its layer_types value "linear_attention" is implemented by the mamba2 family too, so the
    # modules are what give it away)
    assert "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet) has a state-space decay (A_log)" in out["reason"]
    assert "model.layers.0.linear_attn.conv1d (Conv1d) is a causal depthwise conv (width 4)" in out["reason"]
    assert out["patched"] == []
    assert out["refused"] and out["refused"][0]["reason"] == f"disabled by {plugins.DISABLE_ENV}"


def test_disable_families_is_read_at_each_call(monkeypatch, installed):
    monkeypatch.setenv(plugins.DISABLE_ENV, FAMILY)
    assert FAMILY not in plugins.families()
    assert installed(M.make_model(MODEL_TYPE)).mode == "none"
    monkeypatch.delenv(plugins.DISABLE_ENV)
    assert FAMILY in plugins.families()
    assert installed(M.make_model(MODEL_TYPE)).mode == "tree"


# ------------------------------------------------------------------------------------------------
# shared hooks, idempotence, restore by identity
# ------------------------------------------------------------------------------------------------


def test_install_twice_is_idempotent(installed):
    module = _module()
    model = M.make_model(MODEL_TYPE)
    first = installed(model)
    wrappers = {s: getattr(module, s) for s in SEAMS}
    second = installed(model)
    assert second.mode == first.mode == "tree"
    assert [(l.path, l.family, l.backend) for l in second.layers] == [(l.path, l.family, l.backend) for l in first.layers]
    assert second.modules == first.modules == [module.__name__]
    assert all(getattr(module, s) is wrappers[s] for s in SEAMS), "a second install must not wrap the wrappers"
    assert set(seams.owners[module.__name__].models) == {id(model)}
    tree = M.pack_forest("fan")
    alone = M.run_alone(model, tree.samples, M.loss_weights(tree.samples))
    M.assert_matches(M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs()), alone, what="installed twice")


def test_models_of_one_architecture_share_the_module_hooks(installed):
    module = _module()
    a, b = M.make_model(MODEL_TYPE, seed=0), M.make_model(MODEL_TYPE, seed=1)
    installed(a)
    wrappers = {s: getattr(module, s) for s in SEAMS}
    support_b = installed(b)
    assert all(getattr(module, s) is wrappers[s] for s in SEAMS)
    assert support_b.modules == [module.__name__]
    assert set(seams.owners[module.__name__].models) == {id(a), id(b)}
    assert len(seams.owners) == 1


def test_uninstall_restores_only_when_no_installed_model_uses_the_hooks(installed):
    module = _module()
    originals = {s: getattr(module, s) for s in SEAMS}
    a, b = M.make_model(MODEL_TYPE, seed=0), M.make_model(MODEL_TYPE, seed=1)
    installed(a)
    installed(b)
    wrappers = {s: getattr(module, s) for s in SEAMS}
    tr.uninstall(a)
    assert all(getattr(module, s) is wrappers[s] for s in SEAMS), "b still uses the hooks"
    assert not hasattr(a, "_tree_recurrence_support") and b._tree_recurrence_support.mode == "tree"
    tree = M.pack_forest("groups")
    alone = M.run_alone(b, tree.samples, M.loss_weights(tree.samples))
    M.assert_matches(M.run_tree(b, tree, M.loss_weights(tree.samples), tree.trl_kwargs()), alone, what="after a's uninstall")
    tr.uninstall(a)  # twice: nothing happens
    tr.uninstall(b)
    assert all(getattr(module, s) is originals[s] for s in SEAMS), "the very objects must come back"
    assert module.__name__ not in seams.owners


def test_uninstall_restores_carrier_classes_by_identity(installed):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("lfm2", vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                                  conv_L_cache=3)
    model = AutoModelForCausalLM.from_config(config)
    module = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
    forward = module.Lfm2DecoderLayer.__dict__["forward"]
    conv = module.causal_conv1d_fn
    support = installed(model)
    assert support.mode == "tree" and support.families == {"short_conv": "auto"}
    assert module.Lfm2DecoderLayer.__dict__["forward"] is not forward
    tr.uninstall(model)
    assert module.Lfm2DecoderLayer.__dict__["forward"] is forward and module.causal_conv1d_fn is conv


# ------------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------------


def test_set_backend_swaps_at_run_time_with_equal_outputs(installed, decisions):
    model = M.make_model(MODEL_TYPE, dtype=torch.float64)
    support = installed(model, backends={FAMILY: "native"})
    assert support.families == {FAMILY: "native"} and {l.backend for l in support.layers} == {"native"}
    tree = M.pack_forest("mixed")
    with torch.no_grad():
        native = _tree_forward(model, tree)
        assert {d[2] for d in decisions if d[0] == FAMILY} == {"native"}
        decisions.clear()
        tr.set_backend(model, FAMILY, "kernel")
        assert support.families == {FAMILY: "kernel"} and {l.backend for l in support.layers} == {"kernel"}
        assert seams.owners[M.MODELING_MODULES[MODEL_TYPE]].backend == "kernel"
        kernel = _tree_forward(model, tree)
        assert {d[2] for d in decisions if d[0] == FAMILY} <= {"fork", "rescan"} and decisions
        decisions.clear()
        tr.set_backend(model, FAMILY, "native")
        again = _tree_forward(model, tree)
        assert {d[2] for d in decisions if d[0] == FAMILY} == {"native"}
    # transformers' torch reference computes the scan in fp32, the native op in the model's float64
    assert float((native - kernel).abs().max()) < 1e-6 * max(1.0, float(native.abs().max()))
    assert torch.equal(native, again)


def test_unknown_backend_and_family_list_the_choices(installed):
    model = M.make_model(MODEL_TYPE)
    with pytest.raises(ValueError, match=r"unknown backend 'fast' for family 'gated_delta_net', choose one of "
                                         r"\['auto', 'native', 'kernel', 'stand_ins', 'trl'\]"):
        installed(model, backends={FAMILY: "fast"})
    with pytest.raises(ValueError, match=r"unknown family 'gdn', loaded families: \['gated_delta_net', 'mamba2', "
                                         r"'short_conv'\]"):
        installed(model, backends={"gdn": "auto"})
    assert M.MODELING_MODULES[MODEL_TYPE] not in seams.owners
    with pytest.raises(ValueError, match="call install"):
        tr.set_backend(model, FAMILY, "kernel")
    installed(model)
    with pytest.raises(ValueError, match=r"choose one of \['auto', 'native', 'kernel', 'stand_ins', 'trl'\]"):
        tr.set_backend(model, FAMILY, "fast")
    with pytest.raises(ValueError, match=r"no layer of family 'mamba2' \(has \['gated_delta_net'\]\)"):
        tr.set_backend(model, "mamba2", "kernel")


def test_trl_backend_falls_back_with_trl_1_16(installed):
    """TRL 1.16 has no tree kernel of its own (huggingface/trl#7686's patch_tree_gdn): asking for it warns,
    naming what is missing, and this package's own hooks serve the family (test_hooks_behaviour has the
    hand-off to a TRL that has it)."""
    import trl

    model = M.make_model(MODEL_TYPE)
    with pytest.warns(UserWarning, match=rf"backend 'trl' is not available for family '{FAMILY}': trl {trl.__version__} "
                                         r"has no patch_tree_gdn .*using 'auto'"):
        support = installed(model, backends={FAMILY: "trl"})
    assert support.mode == "tree" and support.families == {FAMILY: "auto"}
    assert M.MODELING_MODULES[MODEL_TYPE] in seams.owners
    with pytest.warns(UserWarning, match="has no patch_tree_gdn"):
        tr.set_backend(model, FAMILY, "trl")
    assert support.families == {FAMILY: "auto"}


def test_available_handoff_backend_leaves_the_module_to_its_owner(installed, monkeypatch):
    """A hand-off backend whose library has the kernel (faked here) gets the modeling module: install
    patches nothing there, and the backend cannot be swapped at run time."""
    handed = []
    monkeypatch.setitem(install_mod.BACKENDS, "trl", lambda family: None)
    monkeypatch.setitem(install_mod.HANDOFF_ACTIONS, "trl", lambda model, family, names: handed.append((family, names)))
    module = _module()
    originals = {s: getattr(module, s) for s in SEAMS}
    model = M.make_model(MODEL_TYPE)
    support = installed(model, backends={FAMILY: "trl"})
    assert support.mode == "tree" and support.families == {FAMILY: "trl"} and support.modules == []
    assert handed == [(FAMILY, [module.__name__])]
    assert all(getattr(module, s) is originals[s] for s in SEAMS)
    with pytest.raises(ValueError, match="choose it at install"):
        tr.set_backend(model, FAMILY, "kernel")
    other = M.make_model(MODEL_TYPE, seed=1)
    installed(other)  # our hooks for another model: the module can no longer be handed off
    with pytest.raises(ValueError, match="already hooked by tree_recurrence"):
        installed(M.make_model(MODEL_TYPE, seed=2), backends={FAMILY: "trl"})


# ------------------------------------------------------------------------------------------------
# "chains"
# ------------------------------------------------------------------------------------------------


class ChainDecay(torch.nn.Module):
    """A recurrent mixer that follows packed samples only as separate chains: a decayed running sum
    restarted at every segment start of the row (``tree_cu_seqlens_q``). Right for a row of whole
    samples, wrong for a trie (a child segment must start from its parent's state)."""

    def __init__(self, dim):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.linspace(-1.0, 1.0, dim))
        self.proj = torch.nn.Linear(dim, dim)

    @tr.mark_tree_forward
    def forward(self, x, **kwargs):
        plan = tree_plan(kwargs)
        bounds = plan.array("seg_offsets").tolist() if plan is not None else [0, x.shape[1]]
        decay = torch.exp(-torch.exp(self.A_log))
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            state = torch.zeros_like(x[:, 0])
            for t in range(start, end):
                state = decay * state + x[:, t]
                outs.append(state)
        return self.proj(torch.stack(outs, 1))


class ChainLM(torch.nn.Module):
    def __init__(self, vocab=M.VOCAB, dim=8):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mixer = ChainDecay(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.head(self.mixer(self.embed(input_ids), **kwargs))


@pytest.fixture
def chain_family():
    record = tr.register_family("test_chain_decay", model_types=["chain_lm"], mixer_classes=[ChainDecay],
                                layer_types=["linear_attention"])
    for entry in record.models:
        entry["follows"] = "chains"
    yield record
    tr.unregister_family("test_chain_decay")


def _chain_row(samples):
    from tree_recurrence.integrations.trl import ChainRow

    row = ChainRow()
    for i, s in enumerate(samples):
        row.add({"input_ids": s, "completion_mask": torch.ones_like(s), "old_log_probs": torch.zeros(len(s)),
                 "advantage": 0.0, "group_id": 0})
    packed = row.pack()
    return packed, {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}


def test_python_family_following_chains(installed, chain_family):
    model = ChainLM()
    support = installed(model)
    assert support.mode == "chains" and bool(support)
    assert "mixer (ChainDecay, family 'test_chain_decay')" in support.reason and "one chain per sample" in support.reason
    assert [(l.path, l.follows) for l in support.layers] == [("mixer", "chains")]
    samples = M.make_forest("fan")
    packed, kwargs = _chain_row(samples)
    assert tree_plan(kwargs).is_chains
    out = model(packed["input_ids"][None], **kwargs)[0]
    start = 0
    for s in samples:  # the chain-packed row equals every sample alone
        alone = model(s[None])[0]
        assert torch.allclose(out[start:start + len(s)], alone, atol=1e-6)
        start += len(s)
    tree = M.pack_forest("fan")
    with pytest.raises(ValueError, match=r"mixer \(ChainDecay, family 'test_chain_decay'\) follows packed samples only "
                                         r"as separate chains, but this row is a tree \(2 levels"):
        model(tree.input_ids, **tree.trl_kwargs())
    tr.uninstall(model)
    model(tree.input_ids, **tree.trl_kwargs())  # the guard is gone with the hooks (and the result would be wrong)


def test_unknown_follows_value_is_none(installed, chain_family):
    for entry in chain_family.models:
        entry["follows"] = "sideways"
    support = installed(ChainLM())
    assert support.mode == "none" and "follows 'sideways'" in support.reason and "['tree', 'chains']" in support.reason


def test_manifest_family_following_chains(installed, gdn_follows_chains):
    model = M.make_model(MODEL_TYPE)
    support = installed(model)
    assert support.mode == "chains"
    assert "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet, family 'gated_delta_net')" in support.reason
    samples = M.make_forest("groups")
    packed, kwargs = _chain_row(samples)
    with torch.no_grad():
        out = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None], use_cache=False,
                    **kwargs).logits[0]
        start = 0
        for s in samples:
            alone = model(input_ids=s[None], use_cache=False).logits[0]
            assert float((out[start:start + len(s)] - alone).abs().max()) < 1e-4 * max(1.0, float(alone.abs().max()))
            start += len(s)
        tree = M.pack_forest("groups")
        with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn \(Qwen3_5GatedDeltaNet, family "
                                             r"'gated_delta_net'\) follows packed samples only as separate chains"):
            _tree_forward(model, tree)
        with pytest.raises(ValueError, match="separate chains"):  # the richer format is judged the same
            _tree_forward(model, tree, tree.rich_kwargs())
    installed(model)  # install twice: one guard per layer, not two
    assert len(install_mod._guards[id(model)]) == len(support.layers)


def test_leftovers_name_the_family_detector_that_found_them(installed):
    """Families ship the detectors (sdk/detectors.h): a leftover is named with the detector and the first
    family whose detector recognised it; the generic Python check is only the fallback."""
    support = installed(_CustomModel(_HiddenDecay(16)))
    assert "[detector state_space_decay of family " in support.reason, support.reason
    support = installed(_CustomModel(torch.nn.Conv1d(16, 16, 3, groups=16, padding=2)))
    assert "[detector causal_depthwise_conv of family " in support.reason, support.reason
    from tree_recurrence import plugins

    for family in ("gated_delta_net", "mamba2"):
        claimed, role, why = plugins.detect(family, {"path": "x", "class_name": "Other", "model_type": "",
                                                     "params": [("A_log", [4])], "conv": None})
        assert (claimed, role) == (False, "recurrent") and why.endswith(f"of family {family}]"), why
    claimed, role, why = plugins.detect("short_conv", {"path": "x", "class_name": "Other", "model_type": "",
                                                       "params": [("A_log", [4])], "conv": None})
    assert (claimed, role, why) == (False, "", "")  # short_conv knows convs, not decays


def test_generic_fallback_detector_when_no_family_recognises(installed, monkeypatch):
    from tree_recurrence import plugins

    monkeypatch.setattr(plugins, "detect", lambda family, desc: (False, "", ""))
    support = installed(_CustomModel(_HiddenDecay(16)))
    assert support.mode == "none" and "generic fallback detector" in support.reason, support.reason
