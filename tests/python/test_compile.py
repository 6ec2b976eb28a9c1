"""``torch.compile(model)`` on tree-packed rows: a tiny Qwen3.5 (gated delta net) and a tiny
Nemotron-H (Mamba2 family), installed, compiled with the default backend (inductor), forward and
backward on two rows of the same length but different trees, against the same model run eagerly.

The plan is host work: building it (``tree_plan``), the tree attention mask and the seam dispatch
run eagerly under compile (graph breaks at each seam call, by design); the rest of the model is
compiled. Two rows of equal length with different trees prove the compiled graphs do not keep one
row's plan: the second row would otherwise reuse the first one's (no recompile: same shapes)."""

from __future__ import annotations

import pytest
import torch

import models as M

# A tiny Nemotron-H: a Mamba2 mixer, an attention layer, an MLP (chunk 8: rows cross chunks).
NEMOTRON_H = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128,
                  layers_block_type=["linear_attention", "full_attention", "mlp"], num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16,
                  n_groups=2, chunk_size=8)


def make(model_type: str) -> torch.nn.Module:
    if model_type == "qwen3_5_text":
        return M.make_model(model_type)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **NEMOTRON_H)
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=M.tree_attention_name()).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
    return model.train()


def rows() -> list[tuple[str, M.PackedTree, dict]]:
    """The "mixed" forest in TRL's format, and the same tokens re-planned with every segment a root
    (the smallest format): same length, different recurrences."""
    tree = M.pack_forest("mixed")
    flat = {"tree_cu_seqlens_q": tree.packed["tree_cu_seqlens_q"].clone(),
            "tree_segment_parents": torch.full((tree.num_segments,), -1, dtype=torch.long)}
    return [("tree", tree, tree.trl_kwargs()), ("segments as roots", tree, flat)]


def strip_compile_prefix(result: M.Result) -> M.Result:
    result.grads = {name.replace("_orig_mod.", ""): g for name, g in result.grads.items()}
    return result


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_compiled_model_matches_eager_on_tree_rows(model_type, tree_install):
    torch._dynamo.reset()
    model = make(model_type)
    assert tree_install(model).mode == "tree"
    cases = rows()
    weights = M.loss_weights(cases[0][1].samples)
    eager = [M.run_tree(model, tree, weights, kw) for _, tree, kw in cases]
    # the two rows really differ, so a compiled graph that kept the first plan would be caught
    assert max(float((a - b).abs().max()) for a, b in zip(eager[0].logits, eager[1].logits)) > 1e-3

    compiled = torch.compile(model)
    try:
        for (what, tree, kw), want in zip(cases, eager):
            got = strip_compile_prefix(M.run_tree(compiled, tree, weights, {k: (v.clone() if isinstance(v, torch.Tensor)
                                                                                 else v) for k, v in kw.items()}))
            M.assert_matches(got, want, model, what=f"{model_type} compiled vs eager, {what}")
    finally:
        torch._dynamo.reset()
