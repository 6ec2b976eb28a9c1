"""TRL 1.16's AsyncGRPOTrainer on a hybrid model (tree_recurrence.integrations.trl).

The trainer is really constructed, offline: a tiny Qwen3.5 saved with save_pretrained to a temporary
folder (HF_HUB_OFFLINE=1), a word-level tokenizer built in memory, and stubs for what is external:
the rollout worker (TRL's spawns a process that talks to a vLLM server; the stub's queue is fed
RolloutSamples here), the weight transfer (NCCL to vLLM) and ``get_peak_flops_per_device`` (TRL
1.16 calls ``torch.cuda.get_device_name`` in the constructor, which raises without an NVIDIA
driver). Rollouts go through the trainer's own data path (RolloutQueueDataset -> TRL's batcher or
ours -> TRL's collator -> accelerate's dispatcher); the trainer's ``compute_loss`` runs forward and
backward (gradient checkpointing on, as ``train()`` turns it on), and loss and gradients are
checked against the same rollouts run one sample at a time, TRL's per-token loss terms summed the
same way. One optimizer step of ``trainer.train()`` runs on a MoE hybrid, whose FLOPs estimate
TRL 1.16 cannot compute.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import numpy as np
import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import seams

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":
    pytest.skip(f"written against trl 1.16.0, found {trl.__version__}", allow_module_level=True)

from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer as agt  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl.trainer.utils import compute_flops_per_token  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
# what replaces the vLLM server in the example's --smoke run: a rollout worker without generation, no weight sync
from train_async_grpo import LocalRollouts, NoWeightSync  # noqa: E402

from tree_recurrence.integrations import trl as T  # noqa: E402

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

FAMILY = "gated_delta_net"
MODEL_TYPE = "qwen3_5_text"
PATCHED_NAMES = ("create_model_from_path", "add_fused_lm_head", "compute_flops_per_token", "TokenBudgetBatcher",
                 "FixedCountBatcher")


# ------------------------------------------------------------------------------------------------
# offline trainer
# ------------------------------------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(M.VOCAB)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0", eos_token="t1")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """model type -> folder of a tiny model saved with save_pretrained (float64 for the exact checks)."""
    folders = {}
    for model_type, dtype in ((MODEL_TYPE, torch.float64), ("qwen3_5_moe_text", torch.float32)):
        folder = tmp_path_factory.mktemp(model_type)
        M.make_model(model_type, dtype=dtype).save_pretrained(folder)
        folders[model_type] = str(folder)
    return folders


@pytest.fixture
def no_gpu_probe(monkeypatch):
    """trl 1.16's constructor asks CUDA for the device name (raises without a driver): MFU off."""
    monkeypatch.setattr(agt, "get_peak_flops_per_device", lambda accelerator, dtype: None)


@pytest.fixture
def built(no_gpu_probe, tmp_path):
    """``built(folder, **config)`` -> (trainer, worker); every trainer's model is uninstalled at teardown."""
    from datasets import Dataset

    trainers = []

    def build(folder, **config):
        config = {"output_dir": str(tmp_path / "out"), "bf16": False, "use_cpu": True, "report_to": "none",
                  "save_strategy": "no", "dtype": "auto", "max_steps": 1, "token_budget": 0,
                  "per_device_train_batch_size": len(ROLLOUTS), **config}
        worker = LocalRollouts([])  # the test fills its queue
        trainer = AsyncGRPOTrainer(model=folder, args=AsyncGRPOConfig(**config),
                                   train_dataset=Dataset.from_dict({"prompt": ["t2 t3"] * 4}),
                                   processing_class=_tokenizer(), rollout_worker=worker, weight_transfer=NoWeightSync())
        trainers.append(trainer)
        return trainer, worker

    yield build
    for trainer in trainers:
        tr.uninstall(trainer.model)


# ------------------------------------------------------------------------------------------------
# rollouts: two GRPO groups sharing their prompts, and a multi-turn conversation
# ------------------------------------------------------------------------------------------------


def _rollouts() -> list[RolloutSample]:
    gen = torch.Generator().manual_seed(11)
    noise = np.random.RandomState(5)

    def tokens(n):
        return torch.randint(2, M.VOCAB, (n,), generator=gen).tolist()

    def sample(ids, prompt_len, advantage, group):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.int64)
        mask[prompt_len:] = 1
        # old log-probs near the model's (about -log 128), so some ratios clip and some do not
        old = (-np.log(M.VOCAB) + 0.3 * noise.randn(len(ids))).astype(np.float32)
        return RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask, old_log_probs=old,
                             advantage=advantage, model_version=0, group_id=group, metrics={"reward": advantage})

    out = []
    prompt = tokens(9)
    for n, advantage in ((6, 1.0), (3, -0.7), (8, 0.4), (1, -1.2)):
        out.append(sample(prompt + tokens(n), len(prompt), advantage, 0))
    prompt = tokens(5)
    for n, advantage in ((4, 0.9), (7, -0.3)):
        out.append(sample(prompt + tokens(n), len(prompt), advantage, 1))
    turn1 = tokens(6) + tokens(4)  # a conversation: each turn's sample repeats the turns before it
    out.append(sample(turn1, 6, 0.5, 2))
    out.append(sample(turn1 + tokens(3) + tokens(5), len(turn1) + 3, -0.2, 2))
    return out


ROLLOUTS = _rollouts()


def _feed(worker, copies=2):
    for _ in range(copies):  # accelerate's dispatcher fetches one micro-batch ahead
        for sample in ROLLOUTS:
            worker.rollout_buffer.put(sample)


def _alone_loss(model, trainer, global_n_tokens: float) -> torch.Tensor:
    """The loss compute_loss takes over the packed row, sample by sample: every sample forwarded
    alone (no tree kwargs), TRL's clipped per-token terms summed and normalised the same way."""
    total = 0.0
    for s in ROLLOUTS:
        ids = torch.as_tensor(s.input_ids)[None]
        mask = torch.as_tensor(s.completion_mask).bool()
        labels = torch.full_like(ids, -100)
        labels[0, :-1] = torch.where(mask[1:], ids[0, 1:], torch.full_like(ids[0, 1:], -100))
        out = model(input_ids=ids, shift_labels=labels, fused_lm_head=True)
        targets = mask[1:].nonzero()[:, 0] + 1  # trained tokens p, scored at position p - 1
        log_probs = out.log_probs[0][targets - 1]
        old = torch.as_tensor(s.old_log_probs)[targets]
        coef_1 = torch.exp(log_probs - old)
        coef_2 = torch.clamp(coef_1, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        total = total - torch.min(coef_1 * s.advantage, coef_2 * s.advantage).sum()
    return total / max(global_n_tokens, 1.0)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------
# the trainer
# ------------------------------------------------------------------------------------------------


def test_trainer_refuses_the_hybrid_model_on_its_own(saved_models, no_gpu_probe, built):
    with pytest.raises(ValueError, match=r"has \['linear_attention'\] layers"):
        built(saved_models[MODEL_TYPE])


def test_trainer_is_built_and_everything_is_restored(saved_models, built, monkeypatch):
    originals = {name: getattr(agt, name) for name in PATCHED_NAMES}
    loaded = {}

    def spy(model_id, *args, **kwargs):  # what the trainer's loader returns, before our hooks
        model = originals["create_model_from_path"](model_id, *args, **kwargs)
        loaded["config"], loaded["layer_types"] = model.config, model.config.layer_types
        loaded["class"] = type(model.config)
        return model

    monkeypatch.setattr(agt, "create_model_from_path", spy)
    with T.tree_recurrent_models(attn_implementation="tree_sdpa") as supports:
        assert agt.compute_flops_per_token is T._trainer_flops
        trainer, _ = built(saved_models[MODEL_TYPE])
        assert agt.TokenBudgetBatcher is originals["TokenBudgetBatcher"]  # a "tree" model keeps TRL's batchers
    assert [s.mode for s in supports] == ["tree"] and supports[0].families == {FAMILY: "auto"}
    config = trainer.model.config
    assert config is loaded["config"] and type(config) is loaded["class"]
    assert config.layer_types is loaded["layer_types"] and config.layer_types == ["linear_attention", "full_attention"]
    assert config._attn_implementation == "tree_sdpa"
    assert trainer.model._tree_recurrence_support is supports[0]  # the hooks stay with the model
    assert agt.create_model_from_path is spy
    assert all(getattr(agt, name) is originals[name] for name in PATCHED_NAMES if name != "create_model_from_path")


def test_everything_is_restored_on_errors(saved_models, built, monkeypatch):
    originals = {name: getattr(agt, name) for name in PATCHED_NAMES}
    with pytest.raises(RuntimeError, match="boom"):
        with T.tree_recurrent_models(packing="chains"):
            assert agt.TokenBudgetBatcher is T.ChainTokenBudgetBatcher
            raise RuntimeError("boom")
    assert all(getattr(agt, name) is originals[name] for name in PATCHED_NAMES)

    # a model no family covers is refused with the reason, and nothing stays patched
    from tree_recurrence import plugins

    monkeypatch.setenv(plugins.DISABLE_ENV, FAMILY)
    with pytest.raises(ValueError, match=r"cannot take tree-packed rows: layer_types \['linear_attention'\] of qwen3_5_text "
                                         r"are implemented by no family plugin found.*model.layers.0.linear_attn "
                                         r"\(Qwen3_5GatedDeltaNet\) has a state-space decay"):
        with T.tree_recurrent_models(attn_implementation="tree_sdpa"):
            built(saved_models[MODEL_TYPE])
    assert all(getattr(agt, name) is originals[name] for name in PATCHED_NAMES)

    # the trainer failing while layer_types is hidden (between its loader and its refusal: liger kernels
    # are refused there): the config gets its class and layer_types back on exit
    monkeypatch.delenv(plugins.DISABLE_ENV)
    seen = {}

    def spy(model_id, *args, **kwargs):
        seen["model"] = originals["create_model_from_path"](model_id, *args, **kwargs)
        seen["class"], seen["layer_types"] = type(seen["model"].config), seen["model"].config.layer_types
        return seen["model"]

    monkeypatch.setattr(agt, "create_model_from_path", spy)
    with pytest.raises(NotImplementedError, match="use_liger_kernel"):
        with T.tree_recurrent_models(attn_implementation="tree_sdpa"):
            try:
                built(saved_models[MODEL_TYPE], use_liger_kernel=True)
            finally:
                assert seen["model"].config.layer_types is None  # still hidden inside the block
    config = seen["model"].config
    assert type(config) is seen["class"] and config.layer_types is seen["layer_types"]
    # ... and the model installed inside the block is uninstalled: its modeling module is restored
    assert not hasattr(seen["model"], "_tree_recurrence_support")
    assert M.MODELING_MODULES[MODEL_TYPE] not in seams.owners


def test_unavailable_backend_fails_before_anything_is_patched(no_gpu_probe):
    originals = {name: getattr(agt, name) for name in PATCHED_NAMES}
    with pytest.raises(ValueError, match=r"unknown backend 'fast' for family 'gated_delta_net', choose one of "
                                         r"\['auto', 'native', 'kernel', 'stand_ins', 'trl'\]"):
        with T.tree_recurrent_models(backends={FAMILY: "fast"}):
            pass
    assert all(getattr(agt, name) is originals[name] for name in PATCHED_NAMES)
    with pytest.raises(ValueError, match="packing must be"):
        with T.tree_recurrent_models(packing="trie"):
            pass


@pytest.mark.parametrize("packing", ["tree", "chains"])
def test_compute_loss_matches_the_samples_alone(saved_models, built, packing):
    with T.tree_recurrent_models(attn_implementation="tree_sdpa", packing=packing) as supports:
        trainer, worker = built(saved_models[MODEL_TYPE])
        _feed(worker)
        batch = next(iter(trainer.get_train_dataloader()))
    assert supports[0].mode == "tree"
    model = trainer.model
    assert model.dtype == torch.float64
    kwargs = T.tree_kwargs_from_batch(batch)
    plan = tr.tree_plan(kwargs)
    assert plan.num_leaves == len(ROLLOUTS) and plan.path_token_total == sum(len(s.input_ids) for s in ROLLOUTS)
    if packing == "tree":  # shared prompts and turns are forwarded once
        assert plan.num_levels > 1 and plan.saved_tokens > 30
    else:
        assert plan.is_chains and plan.saved_tokens == 0

    model.train()
    model.gradient_checkpointing_enable()  # as train() does (AsyncGRPOConfig defaults to it)
    trainer.current_gradient_accumulation_steps = 1
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    packed_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    alone = _alone_loss(model, trainer, float(batch["global_n_tokens"][0]))
    alone.backward()
    alone_grads = _grads(model)

    assert float(batch["global_n_tokens"][0]) == sum(int(s.completion_mask[1:].sum()) for s in ROLLOUTS)
    loss, alone = float(loss.detach()), float(alone.detach())
    assert abs(loss - alone) <= 1e-7 * max(1.0, abs(alone)), (loss, alone)
    assert set(packed_grads) == set(alone_grads)
    for name in ("A_log", "dt_bias", "conv1d.weight"):
        assert any(n.endswith(name) and float(g.abs().max()) > 0 for n, g in alone_grads.items()), name
    bad = {}
    for name, ref in alone_grads.items():
        err = float((packed_grads[name] - ref).abs().max())
        if err > 1e-6 * max(1.0, float(ref.abs().max())):
            bad[name] = err
    assert not bad, f"gradients differ: {bad}"


def test_chains_support_switches_the_trainer_to_chain_batchers(saved_models, built, gdn_follows_chains):
    """A family declaring ``follows: chains``: the trainer gets the chain batchers, its rows branch
    nowhere, and the forward runs (a TRL tree row would raise, naming the layer)."""
    with T.tree_recurrent_models(attn_implementation="tree_sdpa") as supports:
        trainer, worker = built(saved_models[MODEL_TYPE], token_budget=64)
        _feed(worker)
        loader = trainer.get_train_dataloader()
        assert isinstance(loader.base_dataloader.dataset if hasattr(loader, "base_dataloader") else loader.dataset,
                          T.ChainTokenBudgetBatcher)
        batch = next(iter(loader))
    assert supports[0].mode == "chains"
    assert agt.TokenBudgetBatcher is not T.ChainTokenBudgetBatcher
    kwargs = T.tree_kwargs_from_batch(batch)
    assert tr.tree_plan(kwargs).is_chains
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, batch).backward()

    row = TreeRow()
    for s in _as_dicts(ROLLOUTS[:4]):
        row.add(s)
    tree_batch = agt.DataCollatorForRollout(0).torch_call([[row]])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn .* follows packed samples only as separate "
                                         r"chains"):
        trainer.compute_loss(trainer.model, tree_batch)


def test_one_training_step_of_a_moe_hybrid(saved_models, built):
    """trainer.train() for one optimizer step on Qwen3.5-MoE: the step's FLOPs estimate (computed
    every step, MFU or not) raises in TRL 1.16 and works through guarded_flops."""
    with T.tree_recurrent_models(attn_implementation="tree_sdpa"):
        trainer, worker = built(saved_models["qwen3_5_moe_text"])
        config = trainer.model.config.get_text_config()
        with pytest.raises(AttributeError, match="num_local_experts"):
            compute_flops_per_token(config, 32)
        _feed(worker)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    logged = trainer.state.log_history[0]
    assert np.isfinite(logged["loss"]) and "aux_loss" in logged and logged["batch/packing_ratio"] > 1.0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert any(n.endswith("A_log") for n in changed) and any(n.endswith("conv1d.weight") for n in changed)
    assert T.guarded_flops(config, 32) == T.guarded_flops(config, 32, model=trainer.model) > 0


# ------------------------------------------------------------------------------------------------
# ChainRow and the chain batchers
# ------------------------------------------------------------------------------------------------


def _as_dicts(samples):
    return [{"input_ids": torch.as_tensor(s.input_ids), "completion_mask": torch.as_tensor(s.completion_mask),
             "old_log_probs": torch.as_tensor(s.old_log_probs), "advantage": s.advantage, "group_id": s.group_id,
             "metrics": s.metrics} for s in samples]


def test_chain_row_packs_every_sample_as_its_own_chain():
    samples = _as_dicts(ROLLOUTS) + _as_dicts(ROLLOUTS[:1])  # an exact duplicate, too
    chains, tree = T.ChainRow(), TreeRow()
    for s in samples:
        assert chains.fits(s, 10_000)
        chains.add(s)
        tree.add(s)
    got, ref = chains.pack(), tree.pack()
    lengths = [len(s["input_ids"]) for s in samples]
    n = sum(lengths)
    assert got["input_ids"].tolist() == [t for s in samples for t in s["input_ids"].tolist()]
    assert got["tree_cu_seqlens_q"].tolist() == np.cumsum([0] + lengths).tolist()
    assert torch.equal(got["tree_cu_seqlens_k"], got["tree_cu_seqlens_q"])
    assert torch.equal(got["tree_kv_index"], torch.arange(n))
    assert got["position_ids"].tolist() == [p for L in lengths for p in range(L)]
    assert got["tree_max_seqlens"].tolist() == [max(lengths), max(lengths)]
    assert got["tree_cu_seqlens_q"].dtype == ref["tree_cu_seqlens_q"].dtype == torch.int32
    # the same loss terms as TRL's trie, in the same sample order
    for key in ("old_log_probs", "advantages", "segment_id"):
        assert torch.equal(got[key], ref[key]), key
    assert torch.equal(got["input_ids"][got["token_index"]], ref["input_ids"][ref["token_index"]])
    assert torch.equal(got["shift_labels"][got["token_index"]], ref["shift_labels"][ref["token_index"]])
    assert chains.load == sum(L * (L + 1) // 2 for L in lengths) and len(chains.tokens) == n > len(tree.tokens)
    assert not chains.fits(samples[0], n + lengths[0] - 1) and chains.fits(samples[0], n + lengths[0])
    with pytest.raises(ValueError, match="no tokens"):
        chains.add({**samples[0], "input_ids": torch.empty(0, dtype=torch.long)})


def test_chain_token_budget_batcher():
    from collections import defaultdict

    samples = [dict(s) for _ in range(3) for s in _as_dicts(ROLLOUTS)]  # distinct objects
    oversized = {**samples[0], "input_ids": torch.arange(2, 45), "completion_mask": torch.ones(43, dtype=torch.long)}
    metrics = defaultdict(list)
    batcher = T.ChainTokenBudgetBatcher(samples[:5] + [oversized] + samples[5:], num_processes=2, token_budget=40,
                                        metrics=metrics)
    placed = []
    for rows in batcher:
        assert len(rows) == 2 and all(isinstance(r, T.ChainRow) and r.samples for r in rows)
        assert all(len(r.tokens) <= 40 for r in rows)
        placed += [s for r in rows for s in r.samples]
    assert metrics["batch/dropped_oversize_total"] == [1.0]
    # the last open micro-batch is not emitted (TRL's batcher waits for a sample that does not fit)
    assert len(placed) < len(samples) and all(any(p is s for s in samples) for p in placed)
    assert len({id(p) for p in placed}) == len(placed)


def test_chain_fixed_count_batcher():
    samples = _as_dicts(ROLLOUTS)
    batches = list(T.ChainFixedCountBatcher(samples * 2, num_processes=3, microbatch_size=len(samples)))
    assert len(batches) == 2
    for rows in batches:
        assert len(rows) == 3 and all(r.samples for r in rows)
        got = [s for r in rows for s in r.samples]
        assert sorted(map(id, got)) == sorted(map(id, samples))
        for r in rows:  # arrival order inside a row
            order = [next(i for i, s in enumerate(samples) if s is x) for x in r.samples]
            assert order == sorted(order)
        # longest first into the least loaded row: the spread is at most one sample's cost
        biggest = max(len(s["input_ids"]) * (len(s["input_ids"]) + 1) // 2 for s in samples)
        assert max(r.load for r in rows) - min(r.load for r in rows) <= biggest


# ------------------------------------------------------------------------------------------------
# tree_kwargs_from_batch
# ------------------------------------------------------------------------------------------------


def _tree_rows():
    rows = [TreeRow(), TreeRow()]
    for i, s in enumerate(_as_dicts(ROLLOUTS)):
        rows[i % 2].add(s)
    return rows


def test_tree_kwargs_from_a_collated_batch():
    rows = _tree_rows()
    batch = agt.DataCollatorForRollout(0, num_processes=2).torch_call([rows])
    with pytest.raises(ValueError, match=r"the batch holds 2 rows \(one per data-parallel rank\).*pass row=i"):
        T.tree_kwargs_from_batch(batch)
    with pytest.raises(ValueError, match="row 2 is out of range: the batch holds 2 row"):
        T.tree_kwargs_from_batch(batch, row=2)
    for r, row in enumerate(rows):
        packed = row.pack()
        kwargs = T.tree_kwargs_from_batch(batch, row=r)
        for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
            assert torch.equal(kwargs[key], packed[key]), key
        for key in ("input_ids", "position_ids", "shift_labels"):
            assert torch.equal(kwargs[key], packed[key][None]), key
        assert (kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"]) == tuple(packed["tree_max_seqlens"].tolist())
        # what compute_loss builds for a rank holding this row
        single = {k: v[r:r + 1] for k, v in batch.items() if v.dim() == 2}
        mask = single["attention_mask"].bool()
        assert torch.equal(kwargs["input_ids"], single["input_ids"][mask][None])
        for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
            assert torch.equal(kwargs[key], single[key][single[key] >= 0])
        assert torch.equal(T.tree_kwargs_from_batch(single)["tree_kv_index"], packed["tree_kv_index"])
    # one unpadded row, as TreeRow.pack() returns it
    packed = rows[0].pack()
    kwargs = T.tree_kwargs_from_batch(packed)
    assert torch.equal(kwargs["input_ids"], packed["input_ids"][None]) and kwargs["tree_max_seqlen_k"] > 0


def test_tree_kwargs_from_the_richer_formats():
    tree = M.pack_forest("mixed")
    rich = {"input_ids": tree.input_ids[0], "position_ids": tree.position_ids[0], **tree.rich_kwargs()}
    rich = {k: v for k, v in rich.items() if isinstance(v, torch.Tensor)}
    other = M.pack_forest("groups")
    other_rich = {"input_ids": other.input_ids[0], "position_ids": other.position_ids[0], **other.rich_kwargs()}
    other_rich = {k: v for k, v in other_rich.items() if isinstance(v, torch.Tensor)}
    from trl.trainer.utils import pad

    # TRL's collator pads a field it does not know (tree_segment_*) with 0, the tree fields with -1
    padding = {"tree_kv_index": -1, "tree_cu_seqlens_q": -1, "tree_cu_seqlens_k": -1}
    batch = {k: pad([rich[k], other_rich[k]], padding_value=padding.get(k, 0)) for k in rich}
    batch["attention_mask"] = pad([torch.ones_like(rich["input_ids"]), torch.ones_like(other_rich["input_ids"])],
                                  padding_value=0)
    for r, source in enumerate((tree, other)):
        kwargs = T.tree_kwargs_from_batch(batch, row=r)
        assert torch.equal(kwargs["tree_segment_parents"], source.parents)
        assert torch.equal(kwargs["tree_segment_depths"], source.depths)
        plan = tr.tree_plan(kwargs)  # checked against the key paths: a wrong cut would raise
        assert plan.num_leaves == len(source.samples)
    # the smallest form: segment bounds + parents; position_ids then come from the plan
    minimal = {"input_ids": tree.input_ids[0], **tree.minimal_kwargs()}
    kwargs = T.tree_kwargs_from_batch(minimal)
    assert torch.equal(kwargs["position_ids"], tree.position_ids)
    assert kwargs["tree_max_seqlen_k"] == max(len(s) for s in tree.samples)


def test_tree_kwargs_from_batch_refuses_malformed_padding():
    rows = _tree_rows()
    batch = agt.DataCollatorForRollout(0, num_processes=2).torch_call([rows])
    shorter = 0 if batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum() else 1

    def broken(key, edit):
        copy = {k: v.clone() for k, v in batch.items()}
        edit(copy[key])
        return copy

    def hole(t):  # a -1 inside the row, real values after it
        t[shorter, 2] = -1

    with pytest.raises(ValueError, match=rf"tree_kv_index: row {shorter}: malformed padding: entry 2 is -1"):
        T.tree_kwargs_from_batch(broken("tree_kv_index", hole), row=shorter)
    with pytest.raises(ValueError, match=rf"tree_cu_seqlens_q: row {shorter}: malformed padding"):
        T.tree_kwargs_from_batch(broken("tree_cu_seqlens_q", hole), row=shorter)

    def drop_one(t):  # the row's last real entry turned into padding
        n = int((t[shorter] >= 0).sum())
        t[shorter, n - 1] = -1

    with pytest.raises(ValueError, match=r"tree_cu_seqlens_k: row \d: \d+ entries after padding, but tree_cu_seqlens_q"):
        T.tree_kwargs_from_batch(broken("tree_cu_seqlens_k", drop_one), row=shorter)
    with pytest.raises(ValueError, match=r"tree_kv_index: row \d: \d+ entries after padding, but tree_cu_seqlens_k ends"):
        T.tree_kwargs_from_batch(broken("tree_kv_index", drop_one), row=shorter)

    def mask_hole(t):
        t[shorter, 0] = 0

    with pytest.raises(ValueError, match="attention_mask: row .*its 1s are not a prefix"):
        T.tree_kwargs_from_batch(broken("attention_mask", mask_hole), row=shorter)

    def mask_short(t):
        n = int(t[shorter].sum())
        t[shorter, n - 1] = 0

    with pytest.raises(ValueError, match=r"attention_mask holds \d+ tokens but tree_cu_seqlens_q ends at"):
        T.tree_kwargs_from_batch(broken("attention_mask", mask_short), row=shorter)
    parents = dict(batch)
    segments = int((batch["tree_cu_seqlens_q"][0] >= 0).sum()) - 1
    parents["tree_segment_parents"] = torch.tensor([[-1] * segments + [7, 7, 0]] * 2)  # more parents than segments
    with pytest.raises(ValueError, match=r"tree_segment_parents: row 0: malformed padding: after the \d+ segments"):
        T.tree_kwargs_from_batch(parents, row=0)
    with pytest.raises(ValueError, match="no tree_cu_seqlens_q"):
        T.tree_kwargs_from_batch({"input_ids": batch["input_ids"]})


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------


_LFM2_MOE = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=3, num_dense_layers=1,
                 moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _config(model_type, **overrides):
    from transformers import AutoConfig

    kwargs = {**M.GDN_CONFIGS.get(model_type, {}), **({"lfm2_moe": _LFM2_MOE}.get(model_type, {})), **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next", "lfm2_moe"])
def test_guarded_flops_where_trl_fails(model_type):
    config = _config(model_type)
    with pytest.raises(AttributeError, match="num_local_experts"):
        compute_flops_per_token(config, 128)
    flops = T.guarded_flops(config, 128)
    assert isinstance(flops, int) and flops > 0


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_guarded_flops_equals_trl_where_trl_is_right(model_type):
    """Dense and MoE models TRL handles (attention everywhere, its own attribute names): the same number."""
    config = _config(model_type, vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     **({"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
                        if model_type == "qwen3_moe" else {}))
    for seq_len in (1, 100, 4096):
        assert T.guarded_flops(config, seq_len) == compute_flops_per_token(config, seq_len)


def test_guarded_flops_charges_only_softmax_attention_per_token_of_context():
    config = _config(MODEL_TYPE)  # layers: linear_attention, full_attention
    slope = (T.guarded_flops(config, 2048) - T.guarded_flops(config, 1024)) / 1024
    heads, head_dim = config.num_attention_heads, config.head_dim
    assert slope == 3 * 2 * heads * 2 * head_dim * 1  # one attention layer
    trl_slope = (compute_flops_per_token(config, 2048) - compute_flops_per_token(config, 1024)) / 1024
    assert trl_slope == 2 * slope  # TRL charges the linear layer as softmax attention
    # the linear layer's own work is still counted (projections, conv, recurrent state)
    dense = _config("qwen3", **{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                 "num_attention_heads", "num_key_value_heads",
                                                                 "head_dim")}, num_hidden_layers=1)
    assert T.guarded_flops(config, 1) > T.guarded_flops(dense, 1)
    no_attention = _config("mamba2", vocab_size=M.VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                           expand=2, state_size=16, n_groups=2, chunk_size=8)
    assert T.guarded_flops(no_attention, 10) == T.guarded_flops(no_attention, 10_000) > 0
    with pytest.raises(AttributeError):
        compute_flops_per_token(no_attention, 10)


def test_guarded_flops_falls_back_to_the_config():
    class Odd:  # not a transformers config: no model can be built from it
        model_type = "odd"
        hidden_size, num_hidden_layers, num_attention_heads, vocab_size, intermediate_size = 64, 2, 4, 100, 128
        layer_types = ["linear_attention", "full_attention"]

    flops = T.guarded_flops(Odd(), 100)
    assert flops > 0 and T.guarded_flops(Odd(), 200) - flops == 3 * 2 * 4 * 32 * 100


def test_guarded_flops_of_a_vision_language_model_counts_its_text_model_only():
    """The trainer passes the text config; for a model whose config is not it (a VLM), only the text
    model and the LM head run per text token."""
    text_model = M.make_model(MODEL_TYPE)
    config = text_model.config

    class VisionLanguage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = object()  # the composite config
            self.vision_tower = torch.nn.Linear(512, 512)
            self.language_model = text_model

        def get_output_embeddings(self):
            return text_model.lm_head

    for seq_len in (16, 1024):
        assert (T.guarded_flops(config, seq_len, model=VisionLanguage())
                == T.guarded_flops(config, seq_len, model=text_model) == T.guarded_flops(config, seq_len))


def test_example_smoke_run():
    """examples/train_async_grpo.py --smoke: two optimizer steps of a tiny hybrid through the trainer."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_async_grpo.py")
    spec = importlib.util.spec_from_file_location("train_async_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    peak_flops = agt.get_peak_flops_per_device
    logged = example.smoke(example.parse_args(["--smoke"]))
    assert [entry["step"] for entry in logged] == [1, 2]
    assert all(np.isfinite(entry["loss"]) and entry["batch/packing_ratio"] > 1.5 for entry in logged)
    assert agt.get_peak_flops_per_device is peak_flops


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba2", "nemotron_h", "bamba", "falcon_h1", "zamba2",
                                        "granitemoehybrid", "lfm2_moe", "qwen3_next"])
def test_layer_types_hidden_from_trls_check_and_restored(model_type):
    """Plain attributes, properties (mamba2, falcon_h1) and attribute_map aliases (nemotron_h, bamba,
    zamba2: layer_types -> layers_block_type) alike: TRL's check sees nothing recurrent, then the
    config has its class and the very same value back."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **({"lfm2_moe": _LFM2_MOE}.get(model_type, {})))
    cls, before = type(config), config.layer_types
    assert T._recurrent_layer_types(config), "not a hybrid config"
    hider = T._LayerTypesHider()
    hider.hide(config)
    # trl 1.16's check, verbatim
    assert not set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    hider.restore_all()
    assert type(config) is cls and config.layer_types == before
    if "layer_types" in config.__dict__:
        assert config.layer_types is before
