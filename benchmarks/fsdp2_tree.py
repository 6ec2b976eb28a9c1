"""Data-parallel training step with FSDP2 on tree-packed rows, one row per rank.

Launch: torchrun --standalone --nproc-per-node 2 benchmarks/fsdp2_tree.py [--size tiny|mid] [--out FILE]

Every rank builds the same random Qwen3.5-like and Nemotron-H-like CausalLM (fixed seed; bf16 on a
GPU, fp32 on the CPU), turns gradient checkpointing on, shards every decoder layer and the root with
``fully_shard`` (FSDP2; NCCL on GPUs, gloo on the CPU), calls ``tree_recurrence.install`` and
forwards its OWN tree-packed row of GRPO-shaped rollouts (prompt groups, each with several
completions), in the tree format TRL 1.16's ``TreeRow.pack()`` emits (``--check-trl`` proves the
packer here gives TRL's exact fields). Checked:

- loss and every parameter's gradient after the step (the reduce-scatter over ranks included) equal
  one process running every sample of both ranks alone through an unsharded copy of the model
  (rank 0 gathers the full gradients): fp32 max abs error <= 1e-4 of the gradient's scale; bf16
  (GPU) relative RMS <= 2e-2 against the fp32 model alone, or within 4x of the model's own bf16
  noise on the samples alone (SPEC.md; tests/python/test_gpu.py explains the band);
- the same with the samples packed as a forest of chains (plain padding-free packing);
- ``uninstall`` on every rank restores the modeling modules object for object, and afterwards the
  same tree row gives a different loss (the comparison can fail);
- no rank hangs: every collective runs under the process group's timeout (--timeout).

Measured: the time of a whole training step (forward, backward with its reduce-scatter, optimizer
step) per rank, tree row vs the same samples as chains, median of --repeat after --warmup steps.
The optimizer's learning rate is 0: its work is timed, and the weights stay those the reference
saw, so the control after uninstall compares against the same numbers.

Rank 0 prints one JSON document and writes it to --out. Exit status 1 (with the errors printed)
when any check fails.
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on the shared GPU hosts (device KINDS.md): set before NCCL loads.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------

MODEL_CONFIGS = {
    "tiny": {
        "qwen3_5_text": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention", "linear_attention"]),
        "nemotron_h": dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                           layers_block_type=["linear_attention", "full_attention", "mlp"], num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=32,
                           ssm_state_size=16, n_groups=2, chunk_size=8),
    },
    "mid": {
        "qwen3_5_text": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
                             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
                             linear_num_value_heads=16, layer_types=["linear_attention"] * 3 + ["full_attention"]
                             + ["linear_attention"] * 3 + ["full_attention"]),
        "nemotron_h": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072,
                           layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp", "full_attention",
                                              "mlp", "linear_attention", "mlp"], num_attention_heads=8,
                           num_key_value_heads=2, head_dim=128, mamba_num_heads=16, mamba_head_dim=64,
                           ssm_state_size=64, n_groups=4, chunk_size=64),
    },
}
# Rollouts per rank: (prompt groups, prompt length, completions per prompt, completion lengths lo..hi)
ROWS = {"tiny": (2, 12, 4, (1, 9)), "mid": (2, 768, 8, (64, 320))}
FAMILY_OF = {"qwen3_5_text": "gated_delta_net", "nemotron_h": "mamba2"}


def build_model(model_type: str, size: str, seed: int, attention: str = "tree_sdpa") -> torch.nn.Module:
    """The same random fp32 CausalLM on every rank (the seed fixes it), dropout off, train mode,
    tree attention. A_log and dt_bias are re-drawn in [-1, 1] so heads decay at clearly different
    rates and the state carried across a segment boundary matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tree_recurrence.attention import register_tree_attention

    config = AutoConfig.for_model(model_type, **MODEL_CONFIGS[size][model_type])
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    config.use_cache = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_tree_attention(attention)).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
    return model.train()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layer (GradientCheckpointingLayer) found to shard")
    return layers


# ------------------------------------------------------------------------------------------------
# rollouts and packing (TRL 1.16's tree format)
# ------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    tokens: torch.Tensor  # (L,) int64: prompt then completion
    prompt_length: int
    advantage: float


def make_rollouts(shape: tuple, rank: int, vocab: int, seed: int) -> list[list[Rollout]]:
    """Rank ``rank``'s GRPO-shaped rollouts: groups of one prompt and several completions, the
    advantages normalised within each group. Completions of a prompt start with distinct tokens
    and prompts with distinct tokens, so the samples really diverge where a trainer's would."""
    groups, prompt_length, completions, (lo, hi) = shape
    gen = torch.Generator().manual_seed(10_000 * (seed + 1) + rank)
    prompt_firsts = torch.randperm(vocab - 2, generator=gen)[:groups] + 2
    out = []
    for g in range(groups):
        prompt = torch.randint(2, vocab, (prompt_length,), generator=gen)
        prompt[0] = prompt_firsts[g]
        firsts = torch.randperm(vocab - 2, generator=gen)[:completions] + 2
        rewards = torch.randn(completions, generator=gen)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        group = []
        for k in range(completions):
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            completion = torch.randint(2, vocab, (n,), generator=gen)
            completion[0] = firsts[k]
            group.append(Rollout(torch.cat([prompt, completion]), prompt_length, float(advantages[k])))
        out.append(group)
    return out


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # (N,)
    position_ids: torch.Tensor  # (N,)
    tree: dict  # the tree kwargs of the forward
    token_index: torch.Tensor  # for every predicted target, the row position whose logits predict it
    segment_id: torch.Tensor  # the sample of each entry of token_index
    samples: list[Rollout]

    def kwargs(self, device) -> dict:
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.tree.items()}


def pack_row(groups: list[list[Rollout]], chains: bool) -> PackedRow:
    """The fields TRL 1.16's ``TreeRow.pack()`` gives these samples (docs/tree-format.md): its trie
    keys a token on (token, next token), so a group forks one token before its completions, at
    the prompt's last token. ``chains``: every sample its own root (plain padding-free packing,
    what ``tree_recurrence.integrations.trl.ChainRow`` packs)."""
    segments: list[tuple[list[torch.Tensor], int | None]] = []  # (tokens, parent segment)
    leaf_of: list[int] = []  # the leaf segment of every sample, in sample order
    samples = [s for g in groups for s in g]
    for group in groups:
        if chains or len(group) == 1:
            for s in group:
                segments.append((s.tokens, None))
                leaf_of.append(len(segments) - 1)
            continue
        prompt = group[0].tokens[: group[0].prompt_length]
        root = len(segments)
        segments.append((prompt[:-1], None))
        for s in group:
            assert torch.equal(s.tokens[: s.prompt_length], prompt)
            segments.append((s.tokens[s.prompt_length - 1:], root))
            leaf_of.append(len(segments) - 1)
    ids, positions, cu_q, kv, cu_k, paths, depth_start = [], [], [0], [], [0], [], []
    for tokens, parent in segments:
        start = cu_q[-1]
        first_depth = 0 if parent is None else depth_start[parent] + len(segments[parent][0])
        depth_start.append(first_depth)
        ids.append(tokens)
        positions.append(torch.arange(first_depth, first_depth + len(tokens)))
        own = torch.arange(start, start + len(tokens))
        path = own if parent is None else torch.cat([paths[parent], own])
        paths.append(path)
        kv.append(path)
        cu_q.append(start + len(tokens))
        cu_k.append(cu_k[-1] + len(path))
    token_index, segment_id = [], []
    for i, leaf in enumerate(leaf_of):
        path = paths[leaf]
        token_index.append(path[:-1])
        segment_id.append(torch.full((len(path) - 1,), i, dtype=torch.long))
    seg_lengths = [len(t) for t, _ in segments]
    tree = {"tree_kv_index": torch.cat(kv), "tree_cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
            "tree_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32), "tree_max_seqlen_q": max(seg_lengths),
            "tree_max_seqlen_k": max(len(p) for p in paths)}
    return PackedRow(torch.cat(ids), torch.cat(positions), tree, torch.cat(token_index), torch.cat(segment_id), samples)


def check_against_trl(groups: list[list[Rollout]]) -> list[str]:
    """Differences between ``pack_row`` and TRL's own ``TreeRow.pack()`` on the same samples."""
    from trl.experimental.async_grpo.packing import TreeRow

    trl_row = TreeRow()
    for i, s in enumerate(s for g in groups for s in g):
        trl_row.add({"input_ids": s.tokens, "completion_mask": torch.ones_like(s.tokens),
                     "old_log_probs": torch.zeros(len(s.tokens)), "advantage": s.advantage, "group_id": 0})
    packed = trl_row.pack()
    ours = pack_row(groups, chains=False)
    errors = []
    for name, mine in (("input_ids", ours.input_ids), ("position_ids", ours.position_ids),
                       ("tree_cu_seqlens_q", ours.tree["tree_cu_seqlens_q"]), ("tree_kv_index", ours.tree["tree_kv_index"]),
                       ("tree_cu_seqlens_k", ours.tree["tree_cu_seqlens_k"]), ("token_index", ours.token_index),
                       ("segment_id", ours.segment_id)):
        theirs = packed[name]
        if theirs.shape != mine.shape or not torch.equal(theirs.long(), mine.long()):
            errors.append(f"packing: {name} differs from TRL's TreeRow.pack()")
    want = [ours.tree["tree_max_seqlen_q"], ours.tree["tree_max_seqlen_k"]]
    if packed["tree_max_seqlens"].tolist() != want:
        errors.append(f"packing: tree_max_seqlens {packed['tree_max_seqlens'].tolist()} vs ours {want}")
    return errors


# ------------------------------------------------------------------------------------------------
# the loss (GRPO-shaped: advantage-weighted log-probabilities of the completion tokens)
# ------------------------------------------------------------------------------------------------


def loss_terms(row: PackedRow, total_completion_tokens: int):
    """(positions, targets, weights) over the row's completion targets: loss = sum w * logp."""
    positions, targets, weights = [], [], []
    for i, s in enumerate(row.samples):
        pos = row.token_index[row.segment_id == i]  # pos[j] predicts token j + 1
        keep = slice(s.prompt_length - 1, None)
        positions.append(pos[keep])
        targets.append(s.tokens[1:][keep])
        weights.append(torch.full((len(pos[keep]),), -s.advantage / total_completion_tokens))
    return torch.cat(positions), torch.cat(targets), torch.cat(weights)


def row_loss(logits: torch.Tensor, terms, device) -> torch.Tensor:
    positions, targets, weights = (t.to(device) for t in terms)
    logp = F.log_softmax(logits[positions].float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    return (logp * weights).sum()


def run_alone(model, samples: list[Rollout], total_completion_tokens: int, device) -> tuple[float, dict]:
    """Every sample forwarded on its own, no tree kwargs: (loss, fp32 gradients by name)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in samples:
        tokens = s.tokens.to(device)
        logits = model(input_ids=tokens[None], use_cache=False).logits[0]
        keep = slice(s.prompt_length - 1, None)
        logp = F.log_softmax(logits[:-1][keep].float(), dim=-1).gather(-1, tokens[1:][keep][:, None])[:, 0]
        loss = (logp * (-s.advantage / total_completion_tokens)).sum()
        loss.backward()
        total += float(loss.detach())
    grads = {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30))


# ------------------------------------------------------------------------------------------------
# distributed helpers
# ------------------------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_sum(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)


def full_grads(model) -> dict:
    """Every parameter's full gradient (gathered from the FSDP2 shards); collective, all ranks."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device if isinstance(p, DTensor) else p.device)
        elif isinstance(g, DTensor):
            g = g.full_tensor()
        out[name] = g.detach().float()
    return out


def module_snapshot(model) -> dict:
    """What install may patch: the attributes of every modeling module the model's classes live
    in, and the attributes of the classes defined there (a carrier's forward, say)."""
    names = {type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.models.")}
    snap = {}
    for name in sorted(names):
        attrs = dict(vars(sys.modules[name]))
        snap[name] = attrs
        for key, obj in attrs.items():
            if isinstance(obj, type) and obj.__module__ == name:
                snap[f"{name}.{key}"] = dict(vars(obj))
    return snap


def snapshot_changes(before: dict) -> list[str]:
    changes = []
    for name, attrs in before.items():
        now = vars(sys.modules[name]) if name in sys.modules else None
        if now is None:  # a class: "<module>.<Class>"
            mod, _, cls_name = name.rpartition(".")
            now = vars(getattr(sys.modules[mod], cls_name))
        changes += [f"{name}.{k} is not the object it was before install" for k, v in attrs.items() if now.get(k) is not v]
        changes += [f"{name}.{k} was added" for k in now if k not in attrs]
    return changes


# ------------------------------------------------------------------------------------------------
# one model
# ------------------------------------------------------------------------------------------------


def run_model(model_type: str, args, rank: int, world: int, device, dtype) -> tuple[dict, list[str]]:
    import tree_recurrence
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tree_recurrence import driver, seams

    errors: list[str] = []
    result: dict = {"model_type": model_type, "family": FAMILY_OF[model_type]}
    vocab = MODEL_CONFIGS[args.size][model_type]["vocab_size"]
    rollouts = [make_rollouts(args.row_shape, r, vocab, args.seed) for r in range(world)]  # every rank's samples
    total_completion = sum(len(s.tokens) - s.prompt_length for groups in rollouts for g in groups for s in g)
    tree_row = pack_row(rollouts[rank], chains=False)
    chain_row = pack_row(rollouts[rank], chains=True)
    rows = {"tree": tree_row, "chains": chain_row}
    terms = {k: loss_terms(r, total_completion) for k, r in rows.items()}
    result["row_tokens_per_rank"] = {"tree": [], "chains": []}
    counts = [None] * world
    dist.all_gather_object(counts, (len(tree_row.input_ids), len(chain_row.input_ids), len(tree_row.samples)))
    result["row_tokens_per_rank"] = {"tree": [c[0] for c in counts], "chains": [c[1] for c in counts]}
    result["samples_per_rank"] = [c[2] for c in counts]
    if args.check_trl and rank == 0:
        errors += check_against_trl(rollouts[0])
        result["packing_checked_against_trl"] = True

    t0 = time.perf_counter()
    model = build_model(model_type, args.size, args.seed, args.attention).to(device)
    with torch.no_grad():
        checksum = torch.stack([p.double().sum() for p in model.parameters()]).sum().reshape(1)
    sums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if any(float(s) != float(checksum) for s in sums):
        errors.append(f"{model_type}: ranks built different weights (parameter sums {[float(s) for s in sums]})")

    # The single-process reference: every sample of every rank alone, unsharded, transformers' own
    # seams (nothing installed yet). fp32; on a GPU also the bf16 model alone (its own noise).
    reference = None
    if rank == 0:
        all_samples = [s for groups in rollouts for g in groups for s in g]
        ref_model = copy.deepcopy(model)
        reference = {"fp32": run_alone(ref_model, all_samples, total_completion, device)}
        if dtype != torch.float32:
            reference["alone_" + str(dtype).split(".")[-1]] = run_alone(ref_model.to(dtype), all_samples,
                                                                       total_completion, device)
        del ref_model
    result["reference_s"] = round(time.perf_counter() - t0, 2)
    dist.barrier()

    model.to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if unsharded:
        errors.append(f"{model_type}: parameters not sharded by fully_shard: {unsharded[:5]}")
    result["gradient_checkpointing"] = bool(model.is_gradient_checkpointing)

    before = module_snapshot(model)
    driver.decisions.clear()
    support = tree_recurrence.install(model)
    if support.mode != "tree":
        errors.append(f"{model_type}: install mode {support.mode!r}: {support.reason}")
    result["install"] = {"mode": support.mode, "layers": [(l.path, l.family, l.backend) for l in support.layers]}

    def step(kind: str, optimizer=None, backward: bool = True) -> float:
        row = rows[kind]
        logits = model(input_ids=row.input_ids.to(device)[None], position_ids=row.position_ids.to(device)[None],
                       use_cache=False, **row.kwargs(device)).logits[0]
        loss = row_loss(logits, terms[kind], device)
        if backward:
            # FSDP2 averages gradients over ranks; the loss is a sum over every rank's samples
            (loss * world).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    # correctness: one step of each packing against the reference
    result["checks"] = {}
    for kind in ("tree", "chains"):
        model.zero_grad(set_to_none=True)
        loss = all_reduce_sum(step(kind), device)
        grads = full_grads(model)
        model.zero_grad(set_to_none=True)
        if rank == 0:
            errors += compare(model_type, kind, loss, grads, reference, dtype, result)
    result["decisions"] = sorted({f"{f}.{s}: {st} ({r})" for f, s, st, r in driver.decisions})

    # timing: whole training steps, tree row vs chains row, every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    timings = {}
    for kind in ("tree", "chains"):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(args.warmup + args.repeat):
            sync(device)
            start = time.perf_counter()
            step(kind, optimizer)
            sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        gathered = [None] * world
        dist.all_gather_object(gathered, (statistics.median(times), times, peak))
        timings[kind] = gathered
    result["step_ms_per_rank"] = {k: [round(g[0], 2) for g in v] for k, v in timings.items()}
    result["step_ms_all"] = {k: [[round(t, 2) for t in g[1]] for g in v] for k, v in timings.items()}
    if device.type == "cuda":
        result["peak_memory_gib_per_rank"] = {k: [round(g[2], 2) for g in v] for k, v in timings.items()}
    slowest = {k: max(g[0] for g in v) for k, v in timings.items()}
    result["speedup_chains_over_tree"] = round(slowest["chains"] / slowest["tree"], 3)
    result["speedup_per_rank"] = [round(c[0] / t[0], 3) for t, c in zip(timings["tree"], timings["chains"])]

    # uninstall restores the modules, and the comparison can fail
    tree_recurrence.uninstall(model)
    changes = snapshot_changes(before) + [f"{n} still hooked" for n in before if n in seams.owners]
    gathered = [None] * world
    dist.all_gather_object(gathered, changes)
    for r, ch in enumerate(gathered):
        errors += [f"{model_type}: rank {r}: after uninstall: {c}" for c in ch]
    with torch.no_grad():
        control = all_reduce_sum(step("tree", backward=False), device)
    if rank == 0:
        ref_loss = reference["fp32"][0]
        gap = abs(control - ref_loss) / max(abs(ref_loss), 1e-12)
        result["control_uninstalled_loss_rel_err"] = gap
        # far outside both the fp32 bar and what the installed step missed by
        threshold = max(10 * loss_tolerance(torch.float32), 3 * result["checks"]["tree"]["loss_rel_err"])
        if gap <= threshold:
            errors.append(f"{model_type}: without install the tree row's loss is within {gap:.2e} of the reference "
                          f"(<= {threshold:.2e}): the comparison cannot tell a wrong recurrence from a right one")
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, errors


def loss_tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 5e-3


def compare(model_type, kind, loss, grads, reference, dtype, result) -> list[str]:
    """Rank 0: the step's loss and gathered gradients against the single-process reference."""
    errors = []
    ref_loss, ref_grads = reference["fp32"]
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    check = {"loss": loss, "reference_loss": ref_loss, "loss_rel_err": loss_err}
    loss_tol = loss_tolerance(dtype)
    if dtype != torch.float32:  # or within 4x of the low-precision model's own error on the samples alone
        noise_loss = reference["alone_" + str(dtype).split(".")[-1]][0]
        check["alone_loss_rel_err"] = abs(noise_loss - ref_loss) / max(abs(ref_loss), 1e-12)
        loss_tol = max(loss_tol, 4 * check["alone_loss_rel_err"])
    if loss_err > loss_tol:
        errors.append(f"{model_type} {kind}: loss {loss:.8g} vs reference {ref_loss:.8g} (rel. err {loss_err:.2e} > "
                      f"{loss_tol:.2e})")
    if set(grads) != set(ref_grads):
        errors.append(f"{model_type} {kind}: gradient names differ: {sorted(set(grads) ^ set(ref_grads))[:5]}")
        return errors
    recurrent = [n for n in ref_grads if n.endswith(("A_log", "dt_bias", "conv1d.weight"))]
    if not recurrent or any(float(ref_grads[n].abs().max()) == 0 for n in recurrent):
        errors.append(f"{model_type}: no gradient reaches the recurrent parameters {recurrent}")
    worst = (0.0, "")
    if dtype == torch.float32:
        for name, ref in ref_grads.items():
            err = float((grads[name] - ref).abs().max())
            tol = 1e-4 * max(float(ref.abs().max()), 1e-8)
            worst = max(worst, (err / tol, name))
            if err > tol:
                errors.append(f"{model_type} {kind}: grad {name}: max abs err {err:.3e} > {tol:.3e}")
        check["worst_grad_err_over_tol"] = worst
    else:
        noise = reference["alone_" + str(dtype).split(".")[-1]][1]
        for name, ref in ref_grads.items():
            err, band = rel_rms(grads[name], ref), rel_rms(noise[name], ref)
            tol = max(2e-2, 4 * band)
            worst = max(worst, (err, name))
            if err > tol:
                errors.append(f"{model_type} {kind}: grad {name}: rel. RMS {err:.3e} > {tol:.3e} "
                              f"(the bf16 model alone: {band:.3e})")
        check["worst_grad_rel_rms"] = worst
    result["checks"][kind] = check
    return errors


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(ROWS), default="tiny")
    parser.add_argument("--models", default="qwen3_5_text,nemotron_h", help="comma-separated model types")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    parser.add_argument("--check-trl", action="store_true", help="compare the packer with TRL's TreeRow.pack()")
    parser.add_argument("--rows", default=None, metavar="G,P,K,LO,HI",
                        help="rollouts per rank: G prompts of P tokens, K completions of LO..HI tokens each "
                             "(default: the size's)")
    parser.add_argument("--attention", choices=["tree_sdpa", "tree_flex"], default="tree_sdpa",
                        help="tree attention implementation (tree_recurrence.attention)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="model dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--out", default=None, help="JSON file (rank 0)")
    args = parser.parse_args(argv)
    if args.rows:
        try:
            g, p, k, lo, hi = (int(v) for v in args.rows.split(","))
        except ValueError:
            parser.error(f"--rows: expected five integers G,P,K,LO,HI, got {args.rows!r}")
        if min(g, k, lo) < 1 or p < 2 or hi < lo:
            parser.error(f"--rows: need G, K, LO >= 1, P >= 2 and HI >= LO, got {args.rows!r}")
        args.row_shape = (g, p, k, (lo, hi))
    else:
        args.row_shape = ROWS[args.size]

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout), device_id=device)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        dtype = torch.float32
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)

    import tree_recurrence

    doc = {"size": args.size, "world_size": world, "device": str(device.type), "dtype": str(dtype).split(".")[-1],
           "backend": dist.get_backend(), "torch": torch.__version__, "tree_recurrence": tree_recurrence.__version__,
           "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "policy": repr(tree_recurrence.Policy()), "attention": args.attention, "rows": dict(zip(
               ("prompt_groups", "prompt_length", "completions_per_prompt", "completion_lengths"), args.row_shape)),
           "models": []}
    if use_cuda:
        doc["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    errors: list[str] = []
    for model_type in [m for m in args.models.split(",") if m]:
        if model_type not in FAMILY_OF:
            raise SystemExit(f"--models: unknown model type {model_type!r} (known: {sorted(FAMILY_OF)})")
        result, errs = run_model(model_type, args, rank, world, device, dtype)
        doc["models"].append(result)
        errors += errs
        if rank == 0:
            print(f"[fsdp2_tree] {model_type}: {result.get('step_ms_per_rank')} speed-up "
                  f"{result.get('speedup_chains_over_tree')}; errors {len(errs)}", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    errors = [e for errs in gathered for e in errs]
    doc["errors"] = errors
    doc["passed"] = not errors
    if rank == 0:
        text = json.dumps(doc, indent=1, default=lambda o: o if not isinstance(o, float) or math.isfinite(o) else str(o))
        print(text, flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text + "\n")
        for e in errors:
            print(f"[fsdp2_tree] FAILED: {e}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if not errors else 1


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:  # one rank's error must not leave the others waiting in a collective
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
    # Every check ran and the process group is gone: skip interpreter teardown, where a library's
    # exit-time destructor once aborted one rank ("terminate called without an active exception")
    # after a passing run and turned it into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
