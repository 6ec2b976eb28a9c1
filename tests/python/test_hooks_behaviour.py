"""Hooks that behave like a well-mannered library: who owns a modeling module's seams
(foreign wrappers survive uninstall, our stale wrappers are replaced and never wrapped, models that
die without uninstall release the module, installs from several threads), what install refuses
(a missing seam, an instance forward that bypasses the seams, an unmarked Python-family mixer),
``use_cache`` on a tree row, and the reasons install gives.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import driver, seams
from tree_recurrence._engine import ENGINE

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

FAMILY = "gated_delta_net"
MODEL_TYPE = "qwen3_5_text"
CONV, SCAN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
NAME = M.MODELING_MODULES[MODEL_TYPE]


def _module():
    return importlib.import_module(NAME)


def _forward(model, tree, **kw):
    with torch.no_grad():
        return model(input_ids=tree.input_ids, position_ids=tree.position_ids, **kw, **tree.trl_kwargs()).logits[0]


def _seam_decisions(seam):
    return [d for d in driver.decisions if d[1] == seam]


# ------------------------------------------------------------------------------------------------
# 1. foreign wrappers survive uninstall; a later install finds our wrapper again
# ------------------------------------------------------------------------------------------------


def test_foreign_wrapper_survives_uninstall_and_is_found_again(installed):
    module = _module()
    pristine = getattr(module, CONV)
    tree = M.pack_forest("fan")
    model = M.make_model(MODEL_TYPE)
    installed(model)
    ours = getattr(module, CONV)
    spied = []

    @functools.wraps(ours)  # copies our wrapper's marks too: it must still count as foreign
    def spy(*args, **kwargs):
        spied.append(len(args))
        return ours(*args, **kwargs)

    setattr(module, CONV, spy)
    try:
        tr.uninstall(model)
        assert getattr(module, CONV) is spy, "uninstall wrote transformers' original over a foreign wrapper"
        assert NAME not in seams.owners
        driver.decisions.clear()
        _forward(model, tree, use_cache=False)
        assert spied and not _seam_decisions(CONV), "our wrapper under the foreign one did not step aside"

        installed(model)
        assert getattr(module, CONV) is spy, "install wrapped the foreign wrapper instead of finding ours in it"
        assert seams.owners[NAME].originals[CONV] is pristine
        driver.decisions.clear()
        spied.clear()
        _forward(model, tree, use_cache=False)
        assert len(spied) == 1 and len(_seam_decisions(CONV)) == 1  # one GDN layer, through the spy, once
        tr.uninstall(model)
        assert getattr(module, CONV) is spy
    finally:
        setattr(module, CONV, pristine)


# ------------------------------------------------------------------------------------------------
# 2. a stale wrapper of ours is replaced, never wrapped
# ------------------------------------------------------------------------------------------------


def test_stale_wrapper_is_unwrapped_not_wrapped(installed):
    module = _module()
    pristine = {s: getattr(module, s) for s in (CONV, SCAN)}
    model = M.make_model(MODEL_TYPE)
    installed(model)
    stale = {s: getattr(module, s) for s in (CONV, SCAN)}
    tr.uninstall(model)
    for seam, wrapper in stale.items():  # a copy of the module's state still holding our wrappers
        setattr(module, seam, wrapper)
    installed(model)
    for seam in (CONV, SCAN):
        current = getattr(module, seam)
        assert current is not stale[seam] and seams.is_wrapper(current)
        assert current.__tree_recurrence_original__ is pristine[seam], f"{seam}: our stale wrapper was wrapped"
    driver.decisions.clear()
    _forward(model, M.pack_forest("fan"), use_cache=False)
    assert len(_seam_decisions(SCAN)) == 1
    tr.uninstall(model)
    assert all(getattr(module, s) is pristine[s] for s in (CONV, SCAN))


# ------------------------------------------------------------------------------------------------
# 4. refusals
# ------------------------------------------------------------------------------------------------


def test_module_lacking_a_needed_seam_is_none(installed, monkeypatch):
    monkeypatch.delattr(_module(), SCAN)
    support = installed(M.make_model(MODEL_TYPE))
    assert support.mode == "none"
    assert NAME in support.reason and SCAN in support.reason and "Qwen3_5GatedDeltaNet" in support.reason, support.reason
    assert NAME not in seams.owners


def test_instance_forward_that_bypasses_the_seams_is_none(installed):
    model = M.make_model(MODEL_TYPE)
    mixer = model.model.layers[0].linear_attn

    def kernel_forward(hidden_states, **kwargs):  # what kernelize puts on the instance
        return hidden_states

    mixer.forward = kernel_forward
    support = installed(model)
    assert support.mode == "none" and "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet)" in support.reason
    assert "kernel_forward" in support.reason and "bypasses the module's seams" in support.reason, support.reason
    assert NAME not in seams.owners


def test_instance_forward_that_still_calls_the_class_forward_is_accepted(installed):
    """accelerate's hooks put a partial over the class forward on the instance (update_wrapper'd)."""
    model = M.make_model(MODEL_TYPE)
    mixer = model.model.layers[0].linear_attn
    old = mixer.forward

    def new_forward(module, *args, **kwargs):
        return module._old_forward(*args, **kwargs)

    mixer._old_forward = old
    mixer.forward = functools.update_wrapper(functools.partial(new_forward, mixer), old)
    assert installed(model).mode == "tree"


class _Unmarked(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, **kwargs):
        return self.proj(x)


class _Marked(_Unmarked):
    @tr.mark_tree_forward
    def forward(self, x, **kwargs):
        return self.proj(x)


class _ToyLM(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer


@pytest.fixture
def toy_family():
    tr.register_family("test_toy_marked", model_types=["toy"], mixer_classes=[_Unmarked, _Marked],
                       layer_types=["linear_attention"])
    yield
    tr.unregister_family("test_toy_marked")


def test_python_family_claims_only_marked_mixers(installed, toy_family):
    support = installed(_ToyLM(_Unmarked()))
    assert support.mode == "none"
    assert "mixer (_Unmarked)" in support.reason and "not marked with mark_tree_forward" in support.reason, support.reason
    assert installed(_ToyLM(_Marked())).mode == "tree"


# ------------------------------------------------------------------------------------------------
# 5. threads
# ------------------------------------------------------------------------------------------------


def test_install_and_uninstall_from_several_threads(monkeypatch):
    module = _module()
    pristine = getattr(module, CONV)
    models = [M.make_model(MODEL_TYPE, seed=i) for i in range(4)]
    problems: list[str] = []
    start = threading.Barrier(len(models))
    # Widen the windows a thread switch needs to hit: right after a module is patched, right before it
    # is restored (install and uninstall must hold the owner table across them).
    real_patch, real_unpatch = seams.patch_module, seams.unpatch_module

    def slow_patch(*args, **kwargs):
        owner = real_patch(*args, **kwargs)
        time.sleep(0.0005)
        return owner

    def slow_unpatch(name):
        time.sleep(0.0005)
        return real_unpatch(name)

    monkeypatch.setattr(seams, "patch_module", slow_patch)
    monkeypatch.setattr(seams, "unpatch_module", slow_unpatch)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def work(model):
        try:
            start.wait()
            for _ in range(30):
                tr.install(model)
                if getattr(getattr(module, CONV), seams.WRAPPER_MARK, None) is None or NAME not in seams.owners:
                    problems.append("the module is unpatched while a model of it is installed")
                tr.uninstall(model)
        except Exception as error:  # noqa: BLE001 -- any exception is the failure
            problems.append(repr(error))

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not problems, sorted(set(problems))
    assert getattr(module, CONV) is pristine and NAME not in seams.owners


# ------------------------------------------------------------------------------------------------
# 6. models collected without uninstall
# ------------------------------------------------------------------------------------------------


def test_module_is_restored_when_the_last_installed_model_is_collected():
    module = _module()
    pristine = {s: getattr(module, s) for s in (CONV, SCAN)}
    a, b = M.make_model(MODEL_TYPE), M.make_model(MODEL_TYPE, seed=1)
    tr.install(a)
    tr.install(b)
    del a
    gc.collect()
    assert NAME in seams.owners and set(seams.owners[NAME].models) == {id(b)}
    assert seams.is_wrapper(getattr(module, SCAN))
    del b
    gc.collect()
    assert NAME not in seams.owners, "a module stays patched after every model using it was collected"
    assert all(getattr(module, s) is pristine[s] for s in (CONV, SCAN))


# ------------------------------------------------------------------------------------------------
# 11. use_cache on a tree row
# ------------------------------------------------------------------------------------------------


def test_tree_row_without_use_cache_false_builds_no_cache(installed, caplog):
    model = M.make_model(MODEL_TYPE)
    model.config.use_cache = True  # transformers' default: the forward would build a cache
    installed(model)
    tree = M.pack_forest("fan")
    expected = _forward(model, tree, use_cache=False)
    ENGINE.reset("told_use_cache")
    with caplog.at_level(logging.INFO, logger="tree_recurrence"):
        with torch.no_grad():
            out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, **tree.trl_kwargs())
            again = model(input_ids=tree.input_ids, position_ids=tree.position_ids, **tree.trl_kwargs())
    assert out.past_key_values is None and again.past_key_values is None
    torch.testing.assert_close(out.logits[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(again.logits[0], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="use_cache=False"):  # asked for explicitly: refused with the reason
        model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=True, **tree.trl_kwargs())
    told = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    with torch.no_grad():  # an ordinary row keeps its cache
        plain = model(input_ids=tree.input_ids[:, :5], use_cache=True)
    assert plain.past_key_values is not None


# ------------------------------------------------------------------------------------------------
# 17. reasons
# ------------------------------------------------------------------------------------------------


def test_attention_only_model_says_it_has_no_recurrent_layers(installed):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    support = installed(AutoModelForCausalLM.from_config(config))
    assert support.mode == "tree" and support.reason == "no recurrent layers" and support.modules == []


class _NotAMixer(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states


def test_missing_mixer_classes_are_named(installed):
    model = M.make_model(MODEL_TYPE)
    model.model.layers[0].linear_attn = _NotAMixer()  # the config still says linear_attention
    support = installed(model)
    assert support.mode == "none"
    assert "family 'gated_delta_net' mixers ['Qwen3_5GatedDeltaNet']" in support.reason
    assert "the model has none of them" in support.reason, support.reason


# ------------------------------------------------------------------------------------------------
# 8. TRL's own tree GDN kernel (huggingface/trl#7686's patch_tree_gdn), faked
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_trl_gdn(monkeypatch):
    """A TRL with #7686's API: ``patch_tree_gdn(model)`` wraps the GDN modeling modules' scan with its
    own tree kernel, once per module, recording each in its patched set."""
    import trl.experimental.async_grpo  # noqa: F401 -- the parent package

    fake = types.ModuleType("trl.experimental.async_grpo.tree_gdn")
    fake._PATCHED_MODULES = set()
    fake.calls = []
    replaced = {}

    def patch_tree_gdn(model):
        fake.calls.append(model)
        for m in model.modules():
            name = type(m).__module__
            if type(m).__name__.endswith("GatedDeltaNet") and name not in fake._PATCHED_MODULES:
                module = sys.modules[name]
                original = getattr(module, SCAN)

                def trl_tree_kernel(*args, **kwargs):
                    return original(*args, **kwargs)

                replaced[name] = original
                setattr(module, SCAN, trl_tree_kernel)
                fake._PATCHED_MODULES.add(name)

    fake.patch_tree_gdn = patch_tree_gdn
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    yield fake
    for name, original in replaced.items():
        setattr(sys.modules[name], SCAN, original)


def test_module_trl_patched_first_is_left_to_trl(fake_trl_gdn, installed):
    module = _module()
    fake_trl_gdn.patch_tree_gdn(M.make_model(MODEL_TYPE))
    trl_kernel = getattr(module, SCAN)
    support = installed(M.make_model(MODEL_TYPE, seed=1))
    assert support.mode == "tree" and support.families == {FAMILY: "trl"} and support.modules == []
    assert [layer.backend for layer in support.layers] == ["trl"]
    assert getattr(module, SCAN) is trl_kernel and NAME not in seams.owners, "TRL's kernel was wrapped"


def test_module_patched_here_is_recorded_in_trls_patched_set(fake_trl_gdn, installed):
    module = _module()
    pristine = getattr(module, SCAN)
    model = M.make_model(MODEL_TYPE)
    installed(model)
    ours = getattr(module, SCAN)
    assert NAME in fake_trl_gdn._PATCHED_MODULES
    fake_trl_gdn.patch_tree_gdn(model)  # TRL's patcher sees the module taken
    assert getattr(module, SCAN) is ours
    tr.uninstall(model)
    assert NAME not in fake_trl_gdn._PATCHED_MODULES and getattr(module, SCAN) is pristine


def test_backend_trl_hands_the_family_to_trl(fake_trl_gdn, installed):
    module = _module()
    model = M.make_model(MODEL_TYPE)
    support = installed(model, backends={FAMILY: "trl"})
    assert fake_trl_gdn.calls == [model]
    assert support.mode == "tree" and support.families == {FAMILY: "trl"} and support.modules == []
    assert NAME in fake_trl_gdn._PATCHED_MODULES and getattr(module, SCAN).__name__ == "trl_tree_kernel"
    assert NAME not in seams.owners
    installed(M.make_model(MODEL_TYPE, seed=1), backends={FAMILY: "trl"})  # TRL has it already: not patched twice
    assert len(fake_trl_gdn.calls) == 1


def test_backend_trl_without_trls_kernel_falls_back_with_a_warning(installed):
    with pytest.warns(UserWarning, match=r"has no patch_tree_gdn \(TRL's own tree kernel, huggingface/trl#7686.*"
                                         r"using 'auto' \(tree_recurrence's own hooks\) instead"):
        support = installed(M.make_model(MODEL_TYPE), backends={FAMILY: "trl"})
    assert support.mode == "tree" and support.families == {FAMILY: "auto"} and support.modules == [NAME]


# ------------------------------------------------------------------------------------------------
# 16. the TRL integration imports neither transformers nor trl until used
# ------------------------------------------------------------------------------------------------


def test_importing_the_trl_integration_is_light():
    code = textwrap.dedent("""
        import sys
        import tree_recurrence.integrations.trl as T
        heavy = sorted(m for m in ("transformers", "trl") if m in sys.modules)
        assert not heavy, heavy
        assert callable(T.tree_recurrent_models) and callable(T.tree_kwargs_from_batch)
        print("ok")  # (T.ChainRow, which subclasses TRL's TreeRow, imports TRL: test_trl_integration uses it)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# 14. library stand-ins accept and ignore extra keywords, as the libraries do
# ------------------------------------------------------------------------------------------------


def test_stand_ins_ignore_extra_keywords():
    """Granite-4 hybrid passes output_router_logits down to its mixer, whose seams pass it on."""
    from tree_recurrence import stand_ins as R

    extra = {"output_router_logits": False}
    x, w = torch.randn(1, 4, 6), torch.randn(4, 3)
    torch.testing.assert_close(R.causal_conv1d_fn(x, w, activation="silu", **extra), R.causal_conv1d_fn(x, w, activation="silu"))
    zxbcdt, cw, cb = torch.randn(1, 5, 14), torch.randn(8, 4), torch.randn(8)  # 2 heads x 2, 1 group, state 2
    dt_bias, A, D = torch.randn(2), -torch.rand(2), torch.randn(2)
    fused = R.mamba_split_conv1d_scan_combined
    torch.testing.assert_close(fused(zxbcdt, cw, cb, dt_bias, A, D, 4, headdim=2, **extra),
                               fused(zxbcdt, cw, cb, dt_bias, A, D, 4, headdim=2))
    xs, dt, B, C = torch.randn(1, 5, 2, 2), torch.randn(1, 5, 2), torch.randn(1, 5, 1, 2), torch.randn(1, 5, 1, 2)
    scan = R.mamba_chunk_scan_combined
    torch.testing.assert_close(scan(xs, dt, A, B, C, 4, **extra), scan(xs, dt, A, B, C, 4))


# ------------------------------------------------------------------------------------------------
# 1. (carriers) a foreign wrapper over a plan carrier's forward survives too
# ------------------------------------------------------------------------------------------------


def test_foreign_wrapper_over_a_carrier_forward_survives_uninstall():
    from test_short_conv_models import make_model as make_short_conv_model

    module = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
    carrier = module.Lfm2DecoderLayer
    own = carrier.__dict__["forward"]
    model = make_short_conv_model("lfm2")
    tr.install(model)
    ours = carrier.__dict__["forward"]
    assert getattr(ours, seams.WRAPPER_MARK) == "carrier"

    @functools.wraps(ours)
    def profiled(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    carrier.forward = profiled
    try:
        tr.uninstall(model)
        assert carrier.__dict__["forward"] is profiled, "uninstall wrote the class's own forward over a foreign wrapper"
        tr.install(model)
        assert carrier.__dict__["forward"] is profiled and seams.owners[module.__name__].carriers[carrier] is own
        tree = M.pack_forest("fan")
        driver.decisions.clear()
        with torch.no_grad():
            model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
        assert driver.decisions, "our carrier under the foreign wrapper did not set the plan context"
        tr.uninstall(model)
    finally:
        carrier.forward = own
