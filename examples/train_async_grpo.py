"""AsyncGRPO (trl 1.16) on a hybrid model with tree packing: tree_recurrence.integrations.trl.

TRL's AsyncGRPOTrainer packs the rollouts of each rank into a prefix trie and forwards every shared
prompt once, but it refuses models with recurrent layers (Qwen3.5, Qwen3-Next, Nemotron-H, LFM2, ...):
they would scan across the packed samples. Under ``tree_recurrent_models()`` the trainer loads the
model with tree_recurrence's hooks installed, so its linear-attention / Mamba2 / short-conv layers
follow the trie, and its FLOPs estimate works for MoE hybrids (docs/trl.md).

Install (CUDA machine; the trainer and the vLLM server on different GPUs)::

    pip install --no-build-isolation "tree-recurrence[trl]"   # or, from a checkout: bash scripts/setup.sh
    pip install vllm math-verify                              # the generation server, the reward

Launch the server (it must allow weight transfer, which AsyncGRPO uses to sync the policy)::

    CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3.5-0.8B \\
        --weight-transfer-config '{"backend":"nccl"}' --max-model-len 4096 --dtype float32

then the trainer (one GPU here; ``accelerate launch`` for several)::

    CUDA_VISIBLE_DEVICES=1 python examples/train_async_grpo.py --model Qwen/Qwen3.5-0.8B \\
        --dataset trl-lib/DeepMath-103K --token-budget 4096 --max-steps 100

``--attn tree_sdpa`` replaces TRL's ``tree_fa3`` (flash-attention 3 from the kernels hub) by
tree_recurrence's dense-mask tree attention (any device, slower).

``--smoke`` runs without a server, model download or GPU: a tiny random Qwen3.5 saved locally,
rollouts made up in the script and fed through the trainer's own queue, two optimizer steps on
CPU. It prints what install() answered and the packing the trainer logged::

    python examples/train_async_grpo.py --smoke
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3.5-0.8B")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--vllm-url", default="http://localhost:8000")
    parser.add_argument("--output-dir", default="async-grpo-tree")
    parser.add_argument("--token-budget", type=int, default=4096, help="unique tokens per packed row")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--attn", default=None, choices=[None, "tree_fa3", "tree_sdpa"],
                        help="attention implementation (default: TRL's tree_fa3)")
    parser.add_argument("--packing", default="auto", choices=["auto", "tree", "chains"],
                        help="auto: one chain per sample only for models whose support is 'chains'")
    parser.add_argument("--smoke", action="store_true", help="offline CPU run of a tiny model, no server")
    return parser.parse_args(argv)


def train(args) -> None:
    from datasets import load_dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.rewards import accuracy_reward

    from tree_recurrence.integrations.trl import tree_recurrent_models

    config = AsyncGRPOConfig(output_dir=args.output_dir, vllm_server_base_url=args.vllm_url,
                             token_budget=args.token_budget, max_steps=args.max_steps,
                             num_generations=args.num_generations, bf16=False)
    dataset = load_dataset(args.dataset, split="train")
    with tree_recurrent_models(attn_implementation=args.attn, packing=args.packing) as supports:
        trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=accuracy_reward, args=config, train_dataset=dataset)
        print(f"tree_recurrence: mode={supports[0].mode} families={supports[0].families} "
              f"layers={len(supports[0].layers)}", flush=True)
        trainer.train()  # inside the block: the FLOPs estimate of every step goes through guarded_flops


# ------------------------------------------------------------------------------------------------
# --smoke: everything external replaced
# ------------------------------------------------------------------------------------------------


class LocalRollouts:
    """A rollout worker without generation (trl's RolloutWorkerProtocol): its queue is filled up front."""

    def __init__(self, samples):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        pass

    def check_health(self, stale_after_s):
        raise RuntimeError("the smoke run's rollouts ran out")


class NoWeightSync:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def _tiny_model(folder: str, vocab: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"], use_cache=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0", eos_token="t1")


def _made_up_rollouts(vocab: int, groups: int, generations: int):
    """GRPO groups (one prompt, several completions) and a multi-turn conversation."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    rng = np.random.default_rng(0)

    def sample(ids, prompt_len, group):
        mask = np.zeros(len(ids), dtype=np.int64)
        mask[prompt_len:] = 1
        return RolloutSample(prompt=[], completion=[], input_ids=np.asarray(ids), completion_mask=mask,
                             old_log_probs=np.full(len(ids), -np.log(vocab), dtype=np.float32),
                             advantage=float(rng.normal()), model_version=0, group_id=group, metrics={"reward": 0.0})

    out = []
    for group in range(groups):
        prompt = rng.integers(2, vocab, 24).tolist()
        out += [sample(prompt + rng.integers(2, vocab, rng.integers(4, 20)).tolist(), len(prompt), group)
                for _ in range(generations)]
    history = rng.integers(2, vocab, 16).tolist()
    for turn in range(3):
        history = history + rng.integers(2, vocab, 8).tolist()
        out.append(sample(history, len(history) - 8, groups))
    return out


def smoke(args) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl.experimental.async_grpo import async_grpo_trainer

    peak_flops = async_grpo_trainer.get_peak_flops_per_device
    if not torch.cuda.is_available():
        # trl 1.16's constructor asks CUDA for the device name to look up its peak FLOPs: no MFU on CPU
        async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        return _smoke(args, vocab=128, steps=2)
    finally:
        async_grpo_trainer.get_peak_flops_per_device = peak_flops


def _smoke(args, vocab: int, steps: int) -> list[dict]:
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    import tree_recurrence
    from tree_recurrence.integrations.trl import tree_recurrent_models

    rollouts = _made_up_rollouts(vocab, groups=4, generations=args.num_generations)
    with tempfile.TemporaryDirectory() as folder:
        _tiny_model(folder, vocab)
        config = AsyncGRPOConfig(output_dir=os.path.join(folder, "out"), use_cpu=not torch.cuda.is_available(),
                                 bf16=False, report_to="none", save_strategy="no", max_steps=steps, token_budget=160,
                                 logging_steps=1, learning_rate=1e-4)
        # accelerate's dispatcher reads one micro-batch ahead: enough rollouts for steps + 1 of them
        worker = LocalRollouts(rollouts * (steps + 2))
        with tree_recurrent_models(attn_implementation="tree_sdpa", packing=args.packing) as supports:
            trainer = AsyncGRPOTrainer(model=folder, args=config, train_dataset=Dataset.from_dict({"prompt": ["t2"] * 4}),
                                       processing_class=_tokenizer(vocab), rollout_worker=worker,
                                       weight_transfer=NoWeightSync())
            support = supports[0]
            print(f"install: mode={support.mode} families={support.families} "
                  f"layers={[layer.path for layer in support.layers]}")
            print(f"config layer_types after the constructor: {trainer.model.config.layer_types}")
            trainer.train()
        tree_recurrence.uninstall(trainer.model)
    steps_logged = [logged for logged in trainer.state.log_history if "loss" in logged]
    for logged in steps_logged:
        print(f"step {logged['step']}: loss {logged['loss']:.4f}, packing ratio {logged['batch/packing_ratio']:.2f} "
              f"(samples' tokens / forwarded tokens), {logged['batch/samples_per_row']:.0f} samples per row")
    return steps_logged


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        smoke(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
