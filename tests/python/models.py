"""Tiny real transformers models, tree-shaped sample sets, TRL packing and the "every sample alone"
reference, for the model-level tests of tree_recurrence.

Nothing here uses the library's plan: sample positions, segment parents and depths are derived
from TRL's packed output (``TreeRow.pack()``) and checked against TRL's own loss bookkeeping
(``token_index`` / ``segment_id``), so a plan bug cannot hide in the harness.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

warnings.filterwarnings("ignore", message=".*trl.experimental.*")

VOCAB = 128
CONV_WIDTH = 4

# ------------------------------------------------------------------------------------------------
# tiny models (docs/transformers-seams.md section 5)
# ------------------------------------------------------------------------------------------------

_B = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
_GDN = dict(linear_conv_kernel_dim=CONV_WIDTH, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4)
_LT = ["linear_attention", "full_attention"]
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

GDN_CONFIGS = {
    "qwen3_5_text": dict(**_B, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_GDN, layer_types=_LT),
    "qwen3_5_moe_text": dict(**_B, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_GDN, layer_types=_LT, **_MOE),
    "qwen3_next": dict(**_B, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_GDN, layer_types=_LT, **_MOE),
    "olmo_hybrid": dict(**_B, num_attention_heads=4, num_key_value_heads=2, **_GDN, layer_types=_LT, pad_token_id=0,
                        eos_token_id=1),
    "qwen4_exp_text": dict(**_B, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_GDN, layer_types=_LT, **_MOE,
                           hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           # a budget above every path length: QSA's sparse selection keeps every visible
                           # token, the only regime tree attention can reproduce (see
                           # test_gdn_models.test_qwen4_exp_sparse_selection_is_not_tree_aware)
                           indexer_budget=128, indexer_compress_ratio=4),
}
GDN_MODEL_TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid"]

# The modeling module of each GDN model type (where its seams live).
MODELING_MODULES = {
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "qwen4_exp_text": "transformers.models.qwen4_exp.modeling_qwen4_exp",
}


def tree_attention_name() -> str:
    from tree_recurrence.attention import register_tree_attention

    return register_tree_attention()


# parameter-name suffixes re-drawn uniformly in a range, in parameter order: (suffixes, low, high)
GDN_REDRAW = ((("A_log", "dt_bias"), -1.0, 1.0),)


def make_tiny_model(model_type: str, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32,
                    redraw: tuple = (), attention: bool = True) -> torch.nn.Module:
    """A tiny randomly initialised CausalLM of ``model_type`` from ``config`` in train mode, dropout
    0, tree attention where the model has attention (``attention``; transformers refuses an
    attention implementation for models without).

    Deterministic: the same (model_type, config, seed) gives the same weights. The parameters named
    by ``redraw`` (``((suffixes, low, high), ...)``) are re-drawn uniformly in their range, so that
    e.g. the heads decay at clearly different rates and the state carried across a segment boundary
    matters (test_unpatched_model_fails_the_comparison checks it does)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config)
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    config.use_cache = False
    torch.manual_seed(seed)
    attn = {"attn_implementation": tree_attention_name()} if attention else {}
    model = AutoModelForCausalLM.from_config(config, **attn).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffixes, low, high in redraw:
                if name.endswith(suffixes):
                    p.copy_(torch.empty(p.shape).uniform_(low, high, generator=gen).to(p.dtype))
                    break
    model.train()
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout)), "dropout must be off"
    assert getattr(config, "attention_dropout", 0.0) == 0.0
    return model


def make_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A tiny GDN model of ``model_type`` (GDN_CONFIGS): make_tiny_model with A_log and dt_bias re-drawn."""
    return make_tiny_model(model_type, {**GDN_CONFIGS[model_type], **overrides}, seed=seed, dtype=dtype, redraw=GDN_REDRAW)


# ------------------------------------------------------------------------------------------------
# forests of samples
# ------------------------------------------------------------------------------------------------


@dataclass
class Node:
    """A tree spec: ``length`` tokens, then children. ``ends``: a sample also ends here (a leaf
    always ends one). Siblings get distinct first tokens, so they really diverge."""

    length: int
    children: list["Node"] = field(default_factory=list)
    ends: bool = False


def _fill(spec: list[Node], gen: torch.Generator) -> list[torch.Tensor]:
    samples: list[torch.Tensor] = []

    def walk(node: Node, prefix: torch.Tensor, first: int):
        body = torch.randint(2, VOCAB, (node.length,), generator=gen)
        body[0] = first
        path = torch.cat([prefix, body])
        if node.ends or not node.children:
            samples.append(path)
        firsts = torch.randperm(VOCAB - 2, generator=gen)[: len(node.children)] + 2
        for child, f in zip(node.children, firsts.tolist()):
            walk(child, path, f)

    firsts = torch.randperm(VOCAB - 2, generator=gen)[: len(spec)] + 2
    for root, f in zip(spec, firsts.tolist()):
        walk(root, torch.empty(0, dtype=torch.long), f)
    return samples


def _fan(prompt=10, lengths=(1, 2, 3, 5, 8, 1, 4, 6)):
    return Node(prompt, [Node(n) for n in lengths])


def _multiturn(turns=(6, 4, 3, 5, 2, 4), side=(1, 3)):
    """Turn after turn sharing the history: one sample per turn (the conversation so far), and an
    alternative reply branching off at the turns in ``side``."""
    node = None
    for depth in reversed(range(len(turns))):
        children = [] if node is None else [node]
        if depth in side:
            children.append(Node(3))
        node = Node(turns[depth], children, ends=True)
    return node


def _tiny():
    """1-token segments and segments shorter than the conv width everywhere."""
    return Node(5, [
        Node(1, [Node(1), Node(2, [Node(1), Node(3)], ends=True)], ends=True),
        Node(2),
        Node(1, [Node(1, [Node(1), Node(2)])]),
    ], ends=True)


def _groups():
    """Several roots (prompt groups) in one row, one of them a single sample."""
    return [Node(7, [Node(3), Node(5), Node(1)]), Node(4, [Node(6), Node(2)]), Node(9)]


FOREST_SPECS = {
    "fan": lambda: [_fan()],
    "multiturn": lambda: [_multiturn()],
    "tiny": lambda: [_tiny()],
    "groups": _groups,
    "chain": lambda: [Node(23)],
    # everything at once, several roots: the forest of the per-model strategy tests
    "mixed": lambda: [_fan(6, (1, 3, 5)), _multiturn((4, 3, 2, 4), (1, 2)), _tiny(), Node(5)],
}
FOREST_NAMES = list(FOREST_SPECS)


def make_forest(name: str, seed: int = 0) -> list[torch.Tensor]:
    """The samples (1-D int64 token tensors) of forest ``name``; deterministic, no duplicates."""
    gen = torch.Generator().manual_seed(1000 + seed + FOREST_NAMES.index(name))
    samples = _fill(FOREST_SPECS[name](), gen)
    assert len({tuple(s.tolist()) for s in samples}) == len(samples), "duplicate samples"
    return samples


# ------------------------------------------------------------------------------------------------
# packing (TRL's real packer) and the two kwarg formats
# ------------------------------------------------------------------------------------------------


@dataclass
class PackedTree:
    samples: list[torch.Tensor]
    packed: dict  # TreeRow.pack() output
    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    sample_positions: list[torch.Tensor]  # packed position of every token of every sample
    parents: torch.Tensor  # (S,) int64, -1 for a root, derived from TRL's kv paths
    depths: torch.Tensor  # (S,) int64, level of each segment, root 0
    seg_lengths: torch.Tensor  # (S,)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_segments(self) -> int:
        return self.parents.numel()

    def trl_kwargs(self, with_max=True) -> dict:
        """What TRL's trainer passes (fresh tensor objects each call: no plan cache carried over)."""
        p = self.packed
        kw = {k: p[k].clone() for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        if with_max:
            kw["tree_max_seqlen_q"] = int(p["tree_max_seqlens"][0])
            kw["tree_max_seqlen_k"] = int(p["tree_max_seqlens"][1])
        return kw

    def rich_kwargs(self) -> dict:
        """TRL's format plus tree_segment_parents / tree_segment_depths."""
        kw = self.trl_kwargs()
        kw["tree_segment_parents"] = self.parents.clone()
        kw["tree_segment_depths"] = self.depths.clone()
        return kw

    def minimal_kwargs(self) -> dict:
        """The richer format alone: segment bounds, parents and depths (no kv paths)."""
        return {"tree_cu_seqlens_q": self.packed["tree_cu_seqlens_q"].clone(),
                "tree_segment_parents": self.parents.clone(), "tree_segment_depths": self.depths.clone()}


def pack(samples: list[torch.Tensor], groups: list | None = None) -> PackedTree:
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for i, s in enumerate(samples):
        row.add({"input_ids": s, "completion_mask": torch.ones_like(s), "old_log_probs": torch.zeros(len(s)),
                 "advantage": float(i), "group_id": 0 if groups is None else groups[i]})
    packed = row.pack()
    ids = packed["input_ids"]
    cu_q = packed["tree_cu_seqlens_q"].long()
    cu_k = packed["tree_cu_seqlens_k"].long()
    kv = packed["tree_kv_index"]
    S = cu_q.numel() - 1
    seg_len = cu_q[1:] - cu_q[:-1]
    token_segment = torch.repeat_interleave(torch.arange(S), seg_len)
    # parent: the segment holding the path token just before the segment (docs/transformers-seams.md 6)
    parents = torch.full((S,), -1, dtype=torch.long)
    depths = torch.zeros(S, dtype=torch.long)
    paths = []
    for s in range(S):
        path = kv[cu_k[s]:cu_k[s + 1]]
        paths.append(path)
        assert torch.equal(path[path.numel() - seg_len[s]:], torch.arange(cu_q[s], cu_q[s + 1])), "kv path must end in its segment"
        if path.numel() > seg_len[s]:
            parents[s] = token_segment[path[path.numel() - seg_len[s] - 1]]
            assert parents[s] < s
            depths[s] = depths[parents[s]] + 1
    is_parent = torch.zeros(S, dtype=torch.bool)
    is_parent[parents[parents >= 0]] = True
    # each sample is the kv path of exactly one leaf segment (its last token is keyed on None)
    by_content = {}
    for s in range(S):
        if not is_parent[s]:
            by_content.setdefault(tuple(ids[paths[s]].tolist()), []).append(s)
    positions = []
    for i, sample in enumerate(samples):
        leaves = by_content.get(tuple(sample.tolist()), [])
        assert len(leaves) == 1, f"sample {i} matches leaf segments {leaves}"
        positions.append(paths[leaves[0]].clone())
    # cross-check with TRL's own loss bookkeeping: target p of sample i is predicted at the packed
    # position of its token p - 1
    for i, pos in enumerate(positions):
        assert torch.equal(packed["token_index"][packed["segment_id"] == i], pos[:-1]), f"sample {i}"
        assert torch.equal(packed["position_ids"][pos], torch.arange(pos.numel()))
        assert torch.equal(ids[pos], samples[i])
    return PackedTree(samples, packed, ids[None], packed["position_ids"][None], positions, parents, depths, seg_len)


def pack_forest(name: str, seed: int = 0) -> PackedTree:
    return pack(make_forest(name, seed))


# ------------------------------------------------------------------------------------------------
# the comparison: tree-packed row vs every sample alone
# ------------------------------------------------------------------------------------------------


def gdn_inputs(n: int, key_heads: int, value_heads: int, gen: torch.Generator, dim: int = 8,
               dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Random gated delta rule inputs of one row of ``n`` tokens: q, k (1, n, key_heads, dim), v
    (1, n, value_heads, dim), g (log decays, <= 0) and beta (1, n, value_heads), drawn in that order."""
    q, k = (torch.randn(1, n, key_heads, dim, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(1, n, value_heads, dim, generator=gen, dtype=dtype)
    g = -torch.rand(1, n, value_heads, generator=gen, dtype=dtype)
    beta = torch.rand(1, n, value_heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def loss_weights(samples: list[torch.Tensor], seed: int = 7, vocab: int = VOCAB) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s), vocab, generator=gen) for s in samples]


@dataclass
class Result:
    logits: list[torch.Tensor]  # per sample (L_i, V), detached
    grads: dict[str, torch.Tensor]  # parameter name -> gradient of the summed loss


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def run_alone(model, samples: list[torch.Tensor], weights: list[torch.Tensor]) -> Result:
    """Every sample forwarded on its own (no tree kwargs); loss = sum_i <logits_i, W_i>."""
    model.zero_grad(set_to_none=True)
    logits = []
    for sample, w in zip(samples, weights):
        out = model(input_ids=sample[None], use_cache=False).logits[0]
        (out * w.to(out.dtype)).sum().backward()
        logits.append(out.detach())
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return Result(logits, grads)


def run_tree(model, tree: PackedTree, weights: list[torch.Tensor], tree_kwargs: dict, backward: bool = True) -> Result:
    """One forward of the packed row; loss = sum_i <logits[positions_i], W_i> (a shared position
    counts once per sample through it)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree_kwargs).logits[0]
    per_sample = [out[pos] for pos in tree.sample_positions]
    if backward:
        loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(per_sample, weights))
        loss.backward()
    grads = _grads(model) if backward else {}
    model.zero_grad(set_to_none=True)
    return Result([o.detach() for o in per_sample], grads)


def scale(tensors) -> float:
    return max(1.0, max(float(t.abs().max()) for t in tensors if t.numel()))


def logits_error(tree: Result, alone: Result) -> tuple[float, float]:
    """(max abs error over every token of every sample, tolerance 1e-4 * max(1, output scale))."""
    err = max(float((a - b).abs().max()) for a, b in zip(tree.logits, alone.logits))
    return err, 1e-4 * scale(alone.logits)


def grad_errors(tree: Result, alone: Result) -> dict[str, tuple[float, float]]:
    """Per parameter: (max abs error, tolerance 1e-4 * max(1, gradient scale))."""
    out = {}
    for name, ref in alone.grads.items():
        got = tree.grads[name]
        out[name] = (float((got - ref).abs().max()), 1e-4 * scale([ref]))
    return out


def assert_matches(tree: Result, alone: Result, model=None, what: str = "",
                   required: tuple[str, ...] = ("A_log", "dt_bias", "conv1d.weight")):
    """Logits within tolerance at every token of every sample; every parameter's gradient within
    tolerance. With ``model``: each parameter-name suffix in ``required`` must name parameters of
    the model, and gradient must reach each of them (the recurrent layer's own parameters)."""
    err, tol = logits_error(tree, alone)
    assert err <= tol, f"{what}: logits max abs error {err:.3e} > {tol:.3e}"
    if alone.grads:
        assert set(tree.grads) == set(alone.grads)
        if model is not None:
            names = [n for n, _ in model.named_parameters()]
            for suffix in required:
                matching = [n for n in names if n.endswith(suffix)]
                assert matching, f"{what}: the model has no parameter named *{suffix}"
                for n in matching:
                    assert n in alone.grads and float(alone.grads[n].abs().max()) > 0, f"{n}: no gradient reaches it"
        bad = {n: e for n, e in grad_errors(tree, alone).items() if e[0] > e[1]}
        assert not bad, f"{what}: gradients differ: " + ", ".join(f"{n} {e:.2e}>{t:.2e}" for n, (e, t) in sorted(bad.items()))


def assert_rewritten_kwargs_run_alike(model_type: str, rewrite, forest: str = "fan") -> None:
    """A fresh model with the hooks installed gives bitwise the same logits on ``forest``'s row with its
    tree kwargs as they are and as ``rewrite(kwargs)`` gives them (int lists, padding, ...)."""
    import tree_recurrence as tr

    model = make_model(model_type)
    tr.install(model)
    try:
        tree = pack_forest(forest)
        with torch.no_grad():
            logits = [model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **kwargs).logits
                      for kwargs in (tree.rich_kwargs(), rewrite(tree.rich_kwargs()))]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    finally:
        tr.uninstall(model)
