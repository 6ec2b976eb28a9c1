"""The "stand_ins" backend (fork / rescan over the families' library stand-ins, bound as libraries),
its deprecated name "reference" and the deprecated module tree_recurrence.reference, and
hot-swapping a family's backend at run time: every backend gives the samples-alone outputs."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tree_recurrence
from tree_recurrence import driver
from tree_recurrence._engine import ENGINE
from tree_recurrence.attention import register_tree_attention


def tiny_qwen():
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_tree_attention()).double().eval()


def test_stand_ins_backend_and_hot_swap_match_the_samples_alone():
    torch.manual_seed(0)
    model = tiny_qwen()
    modeling = importlib.import_module(type(model).__module__)
    seams_before = (modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule)
    # a prompt of 6 tokens, completions of 3, 1 and 5 tokens (segments shorter than the conv width)
    kw = {"tree_cu_seqlens_q": torch.tensor([0, 6, 9, 10, 15]), "tree_segment_parents": torch.tensor([-1, 0, 0, 0])}
    ids = torch.randint(0, 64, (1, 15))
    plan = tree_recurrence.tree_plan(kw)
    position_ids = plan.array("token_position")[None]
    offsets = plan.array("path_offsets").tolist()
    paths = [plan.array("path_tokens")[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    with torch.no_grad():
        alone = [model(input_ids=ids[:, p], use_cache=False).logits[0] for p in paths]
    support = tree_recurrence.install(model, policy=tree_recurrence.Policy(strategy="fork", fork_min_saved_tokens=0),
                                      backends={"gated_delta_net": "stand_ins"})
    try:
        assert support.families == {"gated_delta_net": "stand_ins"}
        for backend, strategy in (("stand_ins", "fork"), ("kernel", "fork"), ("native", "native"), ("stand_ins", "fork")):
            tree_recurrence.set_backend(model, "gated_delta_net", backend)
            driver.decisions.clear()
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=position_ids, use_cache=False, **kw).logits[0]
            scan = [d for d in driver.decisions if d[1] == "torch_chunk_gated_delta_rule"]
            assert scan and all(d[2] == strategy for d in scan), (backend, scan)
            for p, want in zip(paths, alone):
                # transformers' torch GDN (the samples alone) computes in fp32 even for a float64
                # model; the stand-ins keep float64: agreement to the fp32 floor
                assert (logits[p] - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item()), backend
    finally:
        tree_recurrence.uninstall(model)
    assert (modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule) == seams_before


def test_stand_ins_backend_forks_through_the_varlen_stand_in(monkeypatch):
    """With transformers' torch function bound (no varlen), "kernel" forks on a padded batch;
    "stand_ins" forks through the stand-in's cu_seqlens, as FLA would."""
    from tree_recurrence import stand_ins

    import functools

    calls = []
    family_stand_ins = stand_ins.family_stand_ins("gated_delta_net")
    real = family_stand_ins.chunk_gated_delta_rule

    @functools.wraps(real)  # keeps the signature transformers filters keywords by
    def spy(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(family_stand_ins, "chunk_gated_delta_rule", spy)
    ENGINE.reset("wrapped_stand_ins")
    torch.manual_seed(1)
    model = tiny_qwen()
    kw = {"tree_cu_seqlens_q": torch.tensor([0, 5, 8, 12]), "tree_segment_parents": torch.tensor([-1, 0, 0])}
    tree_recurrence.install(model, policy=tree_recurrence.Policy(strategy="fork"), backends={"gated_delta_net": "stand_ins"})
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 64, (1, 12)), use_cache=False, **kw)
    finally:
        tree_recurrence.uninstall(model)
        ENGINE.reset("wrapped_stand_ins")
    assert calls and all(calls), calls


def test_the_old_backend_name_reference_still_works_with_a_deprecation_warning():
    model = tiny_qwen()
    with pytest.warns(DeprecationWarning, match="backend 'reference' is deprecated, use 'stand_ins'"):
        support = tree_recurrence.install(model, backends={"gated_delta_net": "reference"})
    try:
        assert support.families == {"gated_delta_net": "stand_ins"}
        with pytest.warns(DeprecationWarning, match="backend 'reference' is deprecated"):
            tree_recurrence.set_backend(model, "gated_delta_net", "reference")
        assert support.families == {"gated_delta_net": "stand_ins"}
    finally:
        tree_recurrence.uninstall(model)


def test_the_old_module_tree_recurrence_reference_warns_and_forwards():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import tree_recurrence.reference\nexcept DeprecationWarning as e:\n    print('warned', e)\n"
            "warnings.simplefilter('ignore')\nimport tree_recurrence.reference as old, tree_recurrence.stand_ins as new\n"
            "assert old.bind_reference_kernels is new.bind_stand_ins and old.causal_conv1d_fn is new.causal_conv1d_fn\n"
            "assert old.family_reference('gated_delta_net') is new.family_stand_ins('gated_delta_net')\n"
            "assert old.chunk_gated_delta_rule is new.chunk_gated_delta_rule\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "warned tree_recurrence.reference is deprecated: use tree_recurrence.stand_ins" in out.stdout
    assert out.stdout.strip().endswith("ok"), out.stdout
