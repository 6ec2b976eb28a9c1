"""install() answers what the model really does: a mixer's class forward must call the seams its family
hooks (through helpers too), else "none"; re-installing a model with other backends re-routes its modules
between this package's hooks and TRL's own tree kernel (faked: huggingface/trl#7686's ``patch_tree_gdn``)
and back, leaving them as transformers made them once uninstalled; a Python family that follows chains
needs no marked forward."""

from __future__ import annotations

import functools
import gc
import importlib
import sys
import textwrap
import types

import pytest
import torch

import models as M
import tree_recurrence as tr
from conftest import pristine_seams
from tree_recurrence import seams
from tree_recurrence._tree_kwargs import tree_plan

install_mod = importlib.import_module("tree_recurrence.install")

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

FAMILY = "gated_delta_net"
MODEL_TYPE = "qwen3_5_text"
CONV, SCAN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
SEAMS = (CONV, SCAN)
NAME = M.MODELING_MODULES[MODEL_TYPE]


def _module():
    return importlib.import_module(NAME)


def _functions(source: str, namespace: dict) -> dict:
    """The functions ``source`` defines, with ``namespace`` (a modeling module's, say) as their globals."""
    found: dict = {}
    exec(textwrap.dedent(source), namespace, found)  # noqa: S102 -- test code, fixed source
    return found


def _tree_forward(model, tree):
    with torch.no_grad():
        return model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False,
                     **tree.trl_kwargs()).logits[0]


# ------------------------------------------------------------------------------------------------
# a mixer's class forward must call its family's seams
# ------------------------------------------------------------------------------------------------

_GDN_FORWARDS = {
    # an older or patched transformers: the mixer computes without the module's seams
    "calls_no_seam": ("""
        def forward(self, hidden_states, **kwargs):
            return self.out_proj(torch.cumsum(hidden_states, dim=1))
        """, SEAMS, True),
    # the conv through the seam, the scan straight from a library
    "calls_only_the_conv": ("""
        def forward(self, hidden_states, **kwargs):
            x = causal_conv1d_fn(hidden_states.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)
            return self.out_proj(torch.cumsum(x.transpose(1, 2), dim=1))
        """, (SCAN,), True),
    # the seams' names, but another module's globals (``from modeling import causal_conv1d_fn`` there):
    # it calls the objects it copied, which install does not hook
    "calls_copies_of_the_seams": ("""
        def forward(self, hidden_states, **kwargs):
            x = causal_conv1d_fn(hidden_states.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)
            return torch_chunk_gated_delta_rule(x, x, x, x, x)
        """, SEAMS, False),
}


@pytest.mark.parametrize("case", sorted(_GDN_FORWARDS))
def test_class_forward_that_misses_a_seam_is_none(installed, monkeypatch, case):
    source, missing, own_globals = _GDN_FORWARDS[case]
    module = _module()
    namespace = vars(module) if own_globals else {"__builtins__": __builtins__, **{s: getattr(module, s) for s in SEAMS}}
    model = M.make_model(MODEL_TYPE)
    assert installed(model).mode == "tree"  # transformers' own forward (and the answer is not kept past a change)
    tr.uninstall(model)
    monkeypatch.setattr(module.Qwen3_5GatedDeltaNet, "forward", _functions(source, namespace)["forward"])
    support = installed(model)
    assert support.mode == "none", support.reason
    assert "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet)" in support.reason and NAME in support.reason
    assert f"does not call the seam(s) {list(missing)}" in support.reason, support.reason
    assert NAME not in seams.owners  # a refusal patches nothing
    monkeypatch.undo()
    assert installed(model).mode == "tree"


def test_forward_reaching_the_seams_through_a_module_level_helper(installed, monkeypatch):
    """The modeling module's own functions the forward calls are followed (not a seam's body), and a
    helper replaced since is read again."""
    module = _module()
    functions = _functions("""
        def _parity_helper(self, x):
            x = causal_conv1d_fn(x.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)
            return torch_chunk_gated_delta_rule(x, x, x, x, x)

        def _parity_helper_without_the_scan(self, x):
            return causal_conv1d_fn(x.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)

        def forward(self, hidden_states, **kwargs):
            return self.out_proj(_parity_helper(self, hidden_states)[0])
        """, vars(module))
    monkeypatch.setattr(module, "_parity_helper", functions["_parity_helper"], raising=False)
    monkeypatch.setattr(module.Qwen3_5GatedDeltaNet, "forward", functions["forward"])
    model = M.make_model(MODEL_TYPE)
    assert installed(model).mode == "tree"
    tr.uninstall(model)
    monkeypatch.setattr(module, "_parity_helper", functions["_parity_helper_without_the_scan"])
    support = installed(model)
    assert support.mode == "none" and f"does not call the seam(s) {[SCAN]}" in support.reason, support.reason


@pytest.mark.parametrize("forward", [
    pytest.param(lambda: functools.partial(torch.add, alpha=1), id="partial_of_a_builtin"),
    pytest.param(lambda: torch.relu, id="c_function"),
])
def test_class_forward_that_is_not_python_code_is_none(installed, monkeypatch, forward):
    monkeypatch.setattr(_module().Qwen3_5GatedDeltaNet, "forward", forward())
    support = installed(M.make_model(MODEL_TYPE))
    assert support.mode == "none", support.reason
    assert "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet)" in support.reason
    assert "is not Python code" in support.reason and NAME in support.reason and SCAN in support.reason, support.reason
    assert NAME not in seams.owners


def test_marked_class_forward_needs_no_seam(installed, monkeypatch):
    """mark_tree_forward says the forward follows trees in its own code."""
    module = _module()
    forward = _functions("""
        def forward(self, hidden_states, **kwargs):
            return self.out_proj(hidden_states)
        """, vars(module))["forward"]
    monkeypatch.setattr(module.Qwen3_5GatedDeltaNet, "forward", tr.mark_tree_forward(forward))
    assert installed(M.make_model(MODEL_TYPE)).mode == "tree"


# Mamba2-family mixers of other transformers releases: forward -> self.cuda_kernels_forward (the fused
# seam) / self.torch_forward (the split seams). The fused seam stands beside the split path: not required.
_MAMBA2_HELPERS = """
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if self.training and cache_params is None:
            fused = self.cuda_kernels_forward(hidden_states, **kwargs)
            if fused is not None:
                return fused
        return self.torch_forward(hidden_states, cache_params, attention_mask, **kwargs)

    def cuda_kernels_forward(self, hidden_states, **kwargs):
        FUSED_CALL

    def torch_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        x = causal_conv1d_fn(self.in_proj(hidden_states).transpose(1, 2), self.conv1d.weight.squeeze(1))
        SCAN_CALL
        return self.out_proj(x)
"""
_SCAN_CALL = "x = mamba2_chunk_scan(x, x, self.A_log, x, x, chunk_size=self.chunk_size)"
_FUSED_CALL = "return mamba2_split_conv1d_scan_combined(self.in_proj(hidden_states), self.conv1d.weight, self.A_log)"
MAMBA2_CONFIG = dict(vocab_size=M.VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, expand=2,
                     state_size=16, n_groups=2, chunk_size=8)


@pytest.mark.parametrize("fused_call,scan_call,expected", [
    pytest.param(_FUSED_CALL, _SCAN_CALL, None, id="fused_and_split"),
    pytest.param("return None", _SCAN_CALL, None, id="split_only"),
    pytest.param(_FUSED_CALL, "pass", "mamba2_chunk_scan", id="split_without_the_scan"),
])
def test_mamba2_forward_reaching_the_seams_through_helper_methods(installed, monkeypatch, fused_call, scan_call,
                                                                   expected):
    module = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    source = _MAMBA2_HELPERS.replace("FUSED_CALL", fused_call).replace("SCAN_CALL", scan_call)
    for name, function in _functions(source, vars(module)).items():
        monkeypatch.setattr(module.Mamba2Mixer, name, function, raising=False)
    support = installed(M.make_tiny_model("mamba2", MAMBA2_CONFIG, attention=False))
    if expected is None:
        assert support.mode == "tree" and support.families == {"mamba2": "auto"}, support.reason
    else:
        assert support.mode == "none" and f"does not call the seam(s) ['{expected}']" in support.reason, support.reason
        assert module.__name__ not in seams.owners


# ------------------------------------------------------------------------------------------------
# re-installing with other backends: this package's hooks <-> TRL's own tree kernel (faked)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_trl(monkeypatch):
    """A TRL with #7686's API (as test_hooks_behaviour fakes it): ``patch_tree_gdn(model)`` wraps the GDN
    modules' scan once per module (``wrapped``: what it wrapped); ``fail = True``: it raises after that."""
    import trl.experimental.async_grpo  # noqa: F401 -- the parent package

    fake = types.ModuleType("trl.experimental.async_grpo.tree_gdn")
    fake._PATCHED_MODULES = set()
    fake.calls, fake.wrapped, fake.fail = [], {}, False

    def patch_tree_gdn(model):
        fake.calls.append(model)
        for m in model.modules():
            name = type(m).__module__
            if type(m).__name__.endswith("GatedDeltaNet") and name not in fake._PATCHED_MODULES:
                module = sys.modules[name]
                original = getattr(module, SCAN)

                def trl_tree_kernel(*args, **kwargs):
                    return original(*args, **kwargs)

                fake.wrapped[name] = original
                setattr(module, SCAN, trl_tree_kernel)
                if fake.fail:
                    raise RuntimeError("patch_tree_gdn failed")
                fake._PATCHED_MODULES.add(name)

    fake.patch_tree_gdn = patch_tree_gdn
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    yield fake
    for name, original in fake.wrapped.items():
        if getattr(sys.modules[name], SCAN).__name__ == "trl_tree_kernel":
            setattr(sys.modules[name], SCAN, original)


@pytest.fixture(autouse=True)
def no_handoff_left():
    """Every test leaves no module recorded as handed off (a leak would change later tests' routing)."""
    from tree_recurrence._engine import ENGINE

    yield
    left = sorted(ENGINE.handoffs)
    ENGINE.reset("handoffs")
    assert not left, f"test left modules handed off: {left}"


def _pristine() -> dict:
    """transformers' own seam objects of the module, captured before any test ran (conftest)."""
    return pristine_seams(MODEL_TYPE)


def test_reinstall_hands_a_hooked_module_to_trl_and_takes_it_back(fake_trl, installed):
    module = _module()
    pristine = _pristine()
    model = M.make_model(MODEL_TYPE, dtype=torch.float64)
    tree = M.pack_forest("mixed")
    assert installed(model).families == {FAMILY: "auto"} and NAME in seams.owners
    before = _tree_forward(model, tree)

    support = installed(model, backends={FAMILY: "trl"})  # this model alone used our hooks: handed over
    assert support.mode == "tree" and support.families == {FAMILY: "trl"} and support.modules == []
    assert fake_trl.calls == [model] and NAME in fake_trl._PATCHED_MODULES
    assert fake_trl.wrapped == {NAME: pristine[SCAN]}, "TRL wrapped our wrapper, not transformers' scan"
    assert NAME not in seams.owners and getattr(module, CONV) is pristine[CONV]
    assert getattr(module, SCAN).__name__ == "trl_tree_kernel"

    assert installed(model).families == {FAMILY: "trl"}  # without backends: the routing stays
    assert len(fake_trl.calls) == 1  # TRL has the module already

    support = installed(model, backends={FAMILY: "native"})  # taken back from TRL
    assert support.families == {FAMILY: "native"} and support.modules == [NAME]
    assert seams.owners[NAME].backend == "native"
    assert all(seams.is_wrapper(getattr(module, s)) and seams.unwrap_ours(getattr(module, s)) is pristine[s]
               for s in SEAMS), "our hooks must wrap transformers' own objects, not TRL's kernel"
    assert NAME in fake_trl._PATCHED_MODULES  # now as this package's, so TRL leaves it alone
    after = _tree_forward(model, tree)
    assert float((after - before).abs().max()) < 1e-6 * max(1.0, float(before.abs().max()))

    tr.uninstall(model)
    assert all(getattr(module, s) is pristine[s] for s in SEAMS) and NAME not in seams.owners
    assert NAME not in fake_trl._PATCHED_MODULES


def test_uninstalling_a_model_handed_to_trl_restores_transformers_objects(fake_trl, installed):
    module = _module()
    pristine = _pristine()
    model = M.make_model(MODEL_TYPE)
    installed(model, backends={FAMILY: "trl"})
    assert getattr(module, SCAN).__name__ == "trl_tree_kernel"
    tr.uninstall(model)
    assert all(getattr(module, s) is pristine[s] for s in SEAMS) and NAME not in fake_trl._PATCHED_MODULES
    installed(model, backends={FAMILY: "trl"})  # again: TRL patches the module afresh
    assert len(fake_trl.calls) == 2 and getattr(module, SCAN).__name__ == "trl_tree_kernel"
    assert installed(model, backends={FAMILY: "kernel"}).families == {FAMILY: "kernel"}
    tr.uninstall(model)
    assert all(getattr(module, s) is pristine[s] for s in SEAMS) and NAME not in seams.owners


def test_collected_model_handed_to_trl_gives_the_module_back(fake_trl):
    module = _module()
    pristine = _pristine()
    model = M.make_model(MODEL_TYPE)
    tr.install(model, backends={FAMILY: "trl"})
    assert getattr(module, SCAN).__name__ == "trl_tree_kernel"
    fake_trl.calls.clear()  # the fake's record of the model
    del model
    gc.collect()
    seams.sweep()
    assert all(getattr(module, s) is pristine[s] for s in SEAMS) and NAME not in fake_trl._PATCHED_MODULES


def test_reinstall_is_refused_while_another_model_uses_the_module(fake_trl, installed):
    module = _module()
    first, second = M.make_model(MODEL_TYPE), M.make_model(MODEL_TYPE, seed=1)
    installed(first)
    hooks = {s: getattr(module, s) for s in SEAMS}
    with pytest.raises(ValueError, match=rf"{NAME} is already hooked by tree_recurrence \(family '{FAMILY}', backend "
                                         rf"'auto'\) for another installed model \({type(first).__name__}\); uninstall "
                                         r"that model before handing the module to backend 'trl'"):
        installed(second, backends={FAMILY: "trl"})
    assert fake_trl.calls == [] and {s: getattr(module, s) for s in SEAMS} == hooks
    tr.uninstall(first)

    installed(first, backends={FAMILY: "trl"})
    installed(second, backends={FAMILY: "trl"})  # both through TRL
    with pytest.raises(ValueError, match=rf"{NAME} is handed to backend 'trl' for another installed model "
                                         rf"\({type(second).__name__}\); uninstall that model before installing "
                                         r"with backend 'native'"):
        installed(first, backends={FAMILY: "native"})
    assert getattr(module, SCAN).__name__ == "trl_tree_kernel" and NAME not in seams.owners
    tr.uninstall(second)
    assert installed(first, backends={FAMILY: "native"}).families == {FAMILY: "native"}


def test_failed_hand_off_leaves_the_model_uninstalled_and_the_module_pristine(fake_trl, installed):
    module = _module()
    pristine = _pristine()
    model = M.make_model(MODEL_TYPE)
    installed(model)
    fake_trl.fail = True
    with pytest.raises(RuntimeError, match="patch_tree_gdn failed"):
        installed(model, backends={FAMILY: "trl"})
    assert all(getattr(module, s) is pristine[s] for s in SEAMS) and NAME not in seams.owners
    assert install_mod._support_of(model) is None and not hasattr(model, "_tree_recurrence_support")


# ------------------------------------------------------------------------------------------------
# a Python-registered family that follows chains needs no marked forward
# ------------------------------------------------------------------------------------------------


class UnmarkedChainSum(torch.nn.Module):
    """A running sum restarted at every segment start of the row (``tree_cu_seqlens_q``): it reads the
    sample boundaries in its own code, without mark_tree_forward."""

    def forward(self, x, **kwargs):
        plan = tree_plan(kwargs)
        bounds = plan.array("seg_offsets").tolist() if plan is not None else [0, x.shape[1]]
        return torch.cat([x[:, a:b].cumsum(1) for a, b in zip(bounds[:-1], bounds[1:])], 1)


class UnmarkedChainLM(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.embed, self.mixer, self.head = torch.nn.Embedding(M.VOCAB, dim), UnmarkedChainSum(), torch.nn.Linear(dim, 4)

    def forward(self, input_ids, **kwargs):
        return self.head(self.mixer(self.embed(input_ids), **kwargs))


@pytest.fixture
def unmarked_family():
    record = tr.register_family("test_unmarked_chains", model_types=["chain_lm"], mixer_classes=[UnmarkedChainSum],
                                layer_types=["linear_attention"])
    yield record
    tr.unregister_family("test_unmarked_chains")


def test_python_chains_family_needs_no_marked_forward(installed, unmarked_family):
    from tree_recurrence.integrations.trl import ChainRow

    model = UnmarkedChainLM()
    support = installed(model)  # follows trees (the default) without a mark: refused
    assert support.mode == "none" and "not marked with mark_tree_forward" in support.reason, support.reason
    for entry in unmarked_family.models:
        entry["follows"] = "chains"
    support = installed(model)
    assert support.mode == "chains", support.reason
    assert [(layer.path, layer.follows) for layer in support.layers] == [("mixer", "chains")]
    samples = M.make_forest("fan")
    row = ChainRow()
    for s in samples:
        row.add({"input_ids": s, "completion_mask": torch.ones_like(s), "old_log_probs": torch.zeros(len(s)),
                 "advantage": 0.0, "group_id": 0})
    packed = row.pack()
    with torch.no_grad():
        out = model(packed["input_ids"][None], **{k: v for k, v in packed.items() if k.startswith("tree_")})[0]
        start = 0
        for s in samples:  # the chain row equals every sample alone
            assert torch.allclose(out[start:start + len(s)], model(s[None])[0], atol=1e-6)
            start += len(s)
        tree = M.pack_forest("fan")
        with pytest.raises(ValueError, match=r"mixer \(UnmarkedChainSum, family 'test_unmarked_chains'\) follows "
                                             r"packed samples only as separate chains"):
            model(tree.input_ids, **tree.trl_kwargs())
