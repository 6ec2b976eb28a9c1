"""The "reference" backend (fork / rescan over tree_recurrence.reference, bound as a library) and
hot-swapping a family's backend at run time: every backend gives the samples-alone outputs."""

from __future__ import annotations

import importlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tree_recurrence
from tree_recurrence import driver
from tree_recurrence.attention import register_tree_attention


def tiny_qwen():
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_tree_attention()).double().eval()


def test_reference_backend_and_hot_swap_match_the_samples_alone():
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
                                      backends={"gated_delta_net": "reference"})
    try:
        assert support.families == {"gated_delta_net": "reference"}
        for backend, strategy in (("reference", "fork"), ("kernel", "fork"), ("native", "native"), ("reference", "fork")):
            tree_recurrence.set_backend(model, "gated_delta_net", backend)
            driver.decisions.clear()
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=position_ids, use_cache=False, **kw).logits[0]
            scan = [d for d in driver.decisions if d[1] == "torch_chunk_gated_delta_rule"]
            assert scan and all(d[2] == strategy for d in scan), (backend, scan)
            for p, want in zip(paths, alone):
                # transformers' torch GDN reference (the samples alone) computes in fp32 even for a
                # float64 model; the reference kernels keep float64: agreement to the fp32 floor
                assert (logits[p] - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item()), backend
    finally:
        tree_recurrence.uninstall(model)
    assert (modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule) == seams_before


def test_reference_backend_forks_through_the_varlen_reference(monkeypatch):
    """With the torch reference bound (no varlen), "kernel" forks on a padded batch; "reference"
    forks through the reference's cu_seqlens, as FLA would."""
    from tree_recurrence import reference

    import functools

    calls = []
    family_reference = reference.family_reference("gated_delta_net")
    real = family_reference.chunk_gated_delta_rule

    @functools.wraps(real)  # keeps the signature transformers filters keywords by
    def spy(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(family_reference, "chunk_gated_delta_rule", spy)
    reference._wrapped_references.clear()
    torch.manual_seed(1)
    model = tiny_qwen()
    kw = {"tree_cu_seqlens_q": torch.tensor([0, 5, 8, 12]), "tree_segment_parents": torch.tensor([-1, 0, 0])}
    tree_recurrence.install(model, policy=tree_recurrence.Policy(strategy="fork"), backends={"gated_delta_net": "reference"})
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 64, (1, 12)), use_cache=False, **kw)
    finally:
        tree_recurrence.uninstall(model)
        reference._wrapped_references.clear()
    assert calls and all(calls), calls
