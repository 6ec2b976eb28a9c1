"""TRL integration: AsyncGRPOTrainer (trl 1.16) on hybrid models with recurrent layers.

TRL's ``AsyncGRPOTrainer`` packs the rollouts of one rank into a prefix trie (``TreeRow``) and
forwards it as one row with ``tree_*`` kwargs. In trl 1.16 it loads the model in its constructor
(``create_model_from_path``) and refuses any model whose text config has ``layer_types`` other than
``full_attention`` / ``sliding_attention``: a recurrent layer would scan across samples. With the
hooks of :func:`tree_recurrence.install` those layers follow the trie, so::

    from tree_recurrence.integrations.trl import tree_recurrent_models

    with tree_recurrent_models() as supports:        # supports receives each loaded model's Support
        trainer = AsyncGRPOTrainer(model="Qwen/Qwen3.5-...", args=args, ...)
        trainer.train()

What the context manager patches in ``trl.experimental.async_grpo.async_grpo_trainer`` (all restored
on exit, also on exceptions):

* ``create_model_from_path``: loads as before (``attn_implementation=`` overrides TRL's ``tree_fa3``
  when given, e.g. ``"tree_sdpa"`` without flash-attention 3), then ``install(model, policy,
  backends)``. A model answering ``"none"`` is refused with the reason. The text config's
  ``layer_types`` is then hidden (TRL's refusal reads None) ...
* ``add_fused_lm_head`` (the trainer's next step after the refusal): ... and restored before it,
  the very same object: the trainer is built with the model's config intact.
* ``compute_flops_per_token``: :func:`guarded_flops` (trl 1.16's estimate raises on most MoE
  configs and charges linear-attention layers as softmax attention). It is called every optimizer
  step, so call ``trainer.train()`` inside the block.
* ``TokenBudgetBatcher`` / ``FixedCountBatcher``: the chain batchers, when a loaded model's support
  is ``"chains"`` (``packing="auto"``) or when ``packing="chains"``.

The hooks installed on the model stay after the block (``tree_recurrence.uninstall(model)`` removes
them); if the block raises (the trainer's constructor failing, say), every model it installed is
uninstalled too. See docs/trl.md.

Importing this module imports neither transformers nor trl: the chain classes (subclasses of TRL's)
are built on first use, and everything else imports TRL when called.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from .. import plugins
from .._plan import tree_plan
from ..install import Support, _check_backends, install, register_backend, uninstall
from ..policy import Policy

logger = logging.getLogger("tree_recurrence")

__all__ = ["ChainFixedCountBatcher", "ChainRow", "ChainTokenBudgetBatcher", "guarded_flops", "tree_kwargs_from_batch",
           "tree_recurrent_models", "trl_backend_unavailable"]

TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
# What trl 1.16's refusal lets through (async_grpo_trainer.py: `layer_types - {...}`).
_TRL_ATTENTION_TYPES = {"full_attention", "sliding_attention"}


def _trainer_module():
    return importlib.import_module(TRAINER_MODULE)


# ------------------------------------------------------------------------------------------------
# the "trl" backend: TRL's own tree kernels (huggingface/trl#7686)
# ------------------------------------------------------------------------------------------------

# A family names TRL's own tree kernel for it in its manifest (``integrations: {trl: {kernel: <patch
# function>, modules: [where a TRL release may define it, searched in order]}}``; huggingface/trl#7686
# adds one; trl 1.16 has none). TRL keeps the modeling modules it patched in a module-level set (any set
# whose name says "patched"): a module in it is TRL's, and one this package patches is recorded there so
# TRL does not wrap it again.


def _trl_entry(family: str) -> dict | None:
    from .. import plugins

    record = plugins.families().get(family) or {}
    entry = ((record.get("manifest") or {}).get("integrations") or {}).get("trl")
    return entry if isinstance(entry, dict) and entry.get("kernel") else None


def _trl_families() -> list[str]:
    from .. import plugins

    return sorted(name for name in plugins.families() if _trl_entry(name) is not None)


def _trl_version() -> str:
    trl = sys.modules.get("trl")
    return getattr(trl, "__version__", "?") if trl is not None else "?"


def _trl_kernel(family: str, load: bool = True) -> tuple[Any, Callable, set | None] | str:
    """(module, patch function, patched set) of TRL's tree kernel for ``family``, or why there is none.
    ``load=False`` looks only at modules already imported (never imports TRL)."""
    entry = _trl_entry(family)
    if entry is None:
        return f"TRL has no tree kernel for family '{family}' (families whose manifest names one: {_trl_families()})"
    name, modules = entry["kernel"], tuple(entry.get("modules") or ())
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None and load:
            try:
                found = importlib.util.find_spec(module_name) is not None
            except (ImportError, ValueError):
                found = False
            module = importlib.import_module(module_name) if found else None
        function = getattr(module, name, None) if module is not None else None
        if callable(function):
            patched = next((value for key, value in vars(module).items()
                            if isinstance(value, set) and "patched" in key.lower()), None)
            return module, function, patched
    return (f"trl {_trl_version()} has no {name} (TRL's own tree kernel, huggingface/trl#7686; looked in "
            f"{', '.join(modules)})")


def trl_backend_unavailable(family: str) -> str | None:
    """Why backend ``"trl"`` cannot serve ``family`` (None when it can): the installed TRL must have
    its own tree kernel for it (the one the family's manifest names, huggingface/trl#7686)."""
    found = _trl_kernel(family)
    return found if isinstance(found, str) else None


def _in_patched_set(patched: set, module_name: str) -> bool:
    module = sys.modules.get(module_name)
    return module_name in patched or (module is not None and module in patched)


def trl_owns(module_name: str, family: str) -> bool:
    """Whether TRL patched ``module_name`` with its own tree kernel (without importing TRL)."""
    found = _trl_kernel(family, load=False)
    return not isinstance(found, str) and found[2] is not None and _in_patched_set(found[2], module_name)


def note_patched_here(module_name: str, family: str, patched: bool) -> None:
    """Records (``patched``) or forgets a module this package hooks in TRL's patched set, so that TRL's
    patcher leaves it alone (without importing TRL: a TRL imported later cannot know)."""
    found = _trl_kernel(family, load=False)
    if isinstance(found, str) or found[2] is None:
        return
    entries = found[2]
    module = sys.modules.get(module_name)
    # TRL's set holds module names or module objects: record ours the same way
    key = module if module is not None and any(not isinstance(e, str) for e in entries) else module_name
    if patched:
        entries.add(key)
    else:
        entries.discard(key)


def hand_off(model: torch.nn.Module, family: str, module_names: list[str]) -> None:
    """Backend ``"trl"``: TRL's patcher takes the model's modeling modules of ``family`` (those it has not
    patched already)."""
    found = _trl_kernel(family)
    if isinstance(found, str):
        raise ValueError(f"backends: backend 'trl' cannot take family '{family}': {found}")
    _, patch, patched = found
    if patched is not None and module_names and all(_in_patched_set(patched, name) for name in module_names):
        return
    patch(model)


# ------------------------------------------------------------------------------------------------
# chains: every sample its own chain
# ------------------------------------------------------------------------------------------------


_CHAIN_CLASSES = ("ChainRow", "ChainTokenBudgetBatcher", "ChainFixedCountBatcher")


def __getattr__(name: str):
    # The chain classes subclass TRL's: built (importing TRL) when first asked for.
    if name in _CHAIN_CLASSES:
        globals().update(_chain_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def _chain_classes() -> dict[str, type]:
    from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, TokenBudgetBatcher
    from trl.experimental.async_grpo.packing import TreeRow

    class ChainRow(TreeRow):
        """A :class:`~trl.experimental.async_grpo.packing.TreeRow` in which every sample is its own chain:
        nothing is shared between samples, not even an identical prompt. ``pack()`` (inherited) emits the
        same fields, so TRL's collator and ``compute_loss`` work unchanged; each sample is one segment whose
        key path is itself (plain padding-free packing in the tree format). For models whose support is
        ``"chains"``; ``fits`` charges a sample its full length."""

        def fits(self, sample: dict[str, Any], budget: int) -> bool:
            return (len(self.tokens) + len(sample["input_ids"]) <= budget
                    and self.trained + int(sample["completion_mask"].sum()) <= budget)

        def add(self, sample: dict[str, Any]) -> None:
            input_ids = sample["input_ids"].tolist()
            if not input_ids:
                raise ValueError("ChainRow.add: the sample has no tokens")
            nodes: list[int] = []
            for depth, (token, following) in enumerate(zip(input_ids, [*input_ids[1:], None])):
                node = len(self.tokens)
                self.tokens.append(token)
                self.children.append({})
                self.load += depth + 1
                if depth == 0:
                    self.roots[("sample", len(self.samples))] = node  # a key no other sample has: never shared
                else:
                    self.children[nodes[-1]][(token, following)] = node
                nodes.append(node)
            self.samples.append(sample)
            self.sample_nodes.append(nodes)
            self.groups.add(sample["group_id"])
            self.trained += int(sample["completion_mask"].sum())


    class ChainTokenBudgetBatcher(TokenBudgetBatcher):
        """TRL's :class:`TokenBudgetBatcher` with :class:`ChainRow` rows: ``num_processes`` rows of at most
        ``token_budget`` tokens each (every token counted, nothing being shared), each sample placed in the
        least loaded row it fits (a group's rows bring no saving here), a micro-batch emitted when the next
        sample fits nowhere; a sample longer than the budget is dropped with TRL's warning and counter."""

        def __iter__(self):
            rows = [ChainRow() for _ in range(self.num_processes)]
            for sample in self.dataset:
                n = len(sample["input_ids"])
                if n > self.token_budget:
                    logger.warning(
                        f"Dropping a rollout sample of {n} tokens that exceeds token_budget={self.token_budget}. "
                        "Raise token_budget to avoid dropping samples.")
                    self.metrics["batch/dropped_oversize_total"].append(1.0)
                    continue
                while True:
                    placed = self._place(rows, sample)
                    if placed is not None:
                        placed.add(sample)
                        break
                    yield rows
                    rows = [ChainRow() for _ in range(self.num_processes)]

        def _place(self, rows: list[TreeRow], sample: dict[str, Any]) -> TreeRow | None:
            # An empty row fits any sample within the budget, so no emitted micro-batch has an empty row.
            return min((row for row in rows if row.fits(sample, self.token_budget)), key=lambda row: row.load, default=None)


    class ChainFixedCountBatcher(FixedCountBatcher):
        """TRL's :class:`FixedCountBatcher` with :class:`ChainRow` rows: ``microbatch_size`` samples, spread
        over ``num_processes`` rows by their attention cost (longest first into the least loaded row; with
        nothing shared, a group gains nothing from staying together), added to each row in arrival order."""

        def __iter__(self):
            batch: list[dict[str, Any]] = []
            for sample in self.dataset:
                batch.append(sample)
                if len(batch) < self.microbatch_size:
                    continue
                loads = [0] * self.num_processes
                assignment = [0] * len(batch)
                for i in sorted(range(len(batch)), key=lambda i: len(batch[i]["input_ids"]), reverse=True):
                    row = min(range(self.num_processes), key=lambda r: loads[r])
                    n = len(batch[i]["input_ids"])
                    loads[row] += n * (n + 1) // 2
                    assignment[i] = row
                rows = [ChainRow() for _ in range(self.num_processes)]
                for i, queued in enumerate(batch):
                    rows[assignment[i]].add(queued)
                yield rows
                batch = []

    return {"ChainRow": ChainRow, "ChainTokenBudgetBatcher": ChainTokenBudgetBatcher,
            "ChainFixedCountBatcher": ChainFixedCountBatcher}


# ------------------------------------------------------------------------------------------------
# a collated batch -> forward kwargs of one row
# ------------------------------------------------------------------------------------------------

# Fields TRL's collator pads with -1 (a value no real entry has).
_NEGATIVE_PADDED = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
# Fields whose entries may be -1 themselves (a root's parent): cut at the segment count instead.
_SEGMENT_FIELDS = ("tree_segment_parents", "tree_segment_depths")


def _row_vector(batch: Mapping, key: str, row: int, rows: int) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dim() == 1 and rows == 1:
        return value
    if value.dim() != 2 or value.shape[0] != rows:
        raise ValueError(f"tree_kwargs_from_batch: {key} has shape {tuple(value.shape)}, expected ({rows}, length) like "
                         "tree_cu_seqlens_q (one padded row per rank)")
    return value[row]


def _strip_negative_padding(key: str, vector: torch.Tensor, row: int) -> torch.Tensor:
    padding = (vector < 0).nonzero()
    if padding.numel() == 0:
        return vector
    first = int(padding[0, 0])
    if bool((vector[first:] >= 0).any()):
        later = first + int((vector[first:] >= 0).nonzero()[0, 0])
        raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: malformed padding: entry {first} is "
                         f"{int(vector[first])} but entry {later} after it is {int(vector[later])}; the collator pads "
                         "with -1 at the end of a row only")
    return vector[:first]


def tree_kwargs_from_batch(batch: Mapping[str, Any], row: int | None = None) -> dict[str, Any]:
    """The forward kwargs of one row of a collated batch, as TRL's ``compute_loss`` builds them.

    ``batch``: TRL's collator output (``DataCollatorForRollout``: every field ``(rows, length)``, the
    tree fields padded with -1, an ``attention_mask``), or one unpadded row (``TreeRow.pack()``'s 1-D
    fields). Either tree format: TRL 1.16's ``tree_kv_index`` / ``tree_cu_seqlens_q`` /
    ``tree_cu_seqlens_k``, with or without ``tree_segment_parents`` / ``tree_segment_depths`` (also
    the smallest form, ``tree_cu_seqlens_q`` + ``tree_segment_parents``), and huggingface/trl#7686's level
    sizes ``tree_level_sizes`` / ``tree_sizes`` (cut at ``tree_n_chunks`` when given, else where their
    0 / -1 padding starts; ``tree_plan`` checks them against the key paths). ``row``: which row to take;
    needed when the batch holds several (one per data-parallel rank).

    Returns ``input_ids`` and ``position_ids`` ``(1, N)`` (``position_ids`` is each token's depth; taken
    from the plan when the batch lacks it), ``shift_labels`` ``(1, N)`` when the batch has them, the
    tree fields without padding, and ``tree_max_seqlen_q`` / ``tree_max_seqlen_k`` ints. Pass them to
    the model with ``use_cache=False`` (TRL's fused head sets it). Raises ``ValueError`` for a batch of
    several rows without ``row=`` (saying how many), and for padding that is not a suffix of -1s, or
    fields that disagree on the row's length.
    """
    if batch.get("tree_cu_seqlens_q") is None:
        raise ValueError("tree_kwargs_from_batch: the batch has no tree_cu_seqlens_q (not a tree-packed batch)")
    cu_q_all = batch["tree_cu_seqlens_q"]
    rows = 1 if cu_q_all.dim() == 1 else int(cu_q_all.shape[0])
    if cu_q_all.dim() not in (1, 2):
        raise ValueError(f"tree_kwargs_from_batch: tree_cu_seqlens_q has shape {tuple(cu_q_all.shape)}, expected "
                         "(rows, segments + 1) or (segments + 1,)")
    if row is None:
        if rows != 1:
            raise ValueError(f"tree_kwargs_from_batch: the batch holds {rows} rows (one per data-parallel rank); a "
                             "tree-packed forward takes one row: pass row=i (0 <= i < "
                             f"{rows}), as each rank's compute_loss gets its own")
        row = 0
    if not 0 <= row < rows:
        raise ValueError(f"tree_kwargs_from_batch: row {row} is out of range: the batch holds {rows} row(s)")

    out: dict[str, Any] = {}
    cu_q = _strip_negative_padding("tree_cu_seqlens_q", _row_vector(batch, "tree_cu_seqlens_q", row, rows), row)
    if cu_q.numel() < 2 or int(cu_q[0]) != 0:
        raise ValueError(f"tree_kwargs_from_batch: tree_cu_seqlens_q: row {row}: expected 0 followed by the end of "
                         f"every segment, got {cu_q.tolist()[:8]}")
    segments = cu_q.numel() - 1
    num_tokens = int(cu_q[-1])
    out["tree_cu_seqlens_q"] = cu_q
    for key in ("tree_kv_index", "tree_cu_seqlens_k"):
        if batch.get(key) is not None:
            out[key] = _strip_negative_padding(key, _row_vector(batch, key, row, rows), row)
    if "tree_cu_seqlens_k" in out:
        cu_k = out["tree_cu_seqlens_k"]
        if cu_k.numel() != cu_q.numel():
            raise ValueError(f"tree_kwargs_from_batch: tree_cu_seqlens_k: row {row}: {cu_k.numel()} entries after "
                             f"padding, but tree_cu_seqlens_q has {cu_q.numel()} ({segments} segments)")
        if "tree_kv_index" in out and int(cu_k[-1]) != out["tree_kv_index"].numel():
            raise ValueError(f"tree_kwargs_from_batch: tree_kv_index: row {row}: {out['tree_kv_index'].numel()} entries "
                             f"after padding, but tree_cu_seqlens_k ends at {int(cu_k[-1])}")
    for key in _SEGMENT_FIELDS:
        if batch.get(key) is None:
            continue
        vector = _row_vector(batch, key, row, rows)
        if vector.numel() < segments:
            raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: {vector.numel()} entries, but "
                             f"tree_cu_seqlens_q has {segments} segments")
        tail = vector[segments:]
        # TRL's collator pads a field it does not know with 0; -1 is the other natural choice.
        if tail.numel() and not (bool((tail == tail[0]).all()) and int(tail[0]) in (0, -1)):
            raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: malformed padding: after the {segments} "
                             f"segments of tree_cu_seqlens_q come {tail.tolist()[:8]}, not a run of 0 or -1 (do the "
                             "fields describe the same tree?)")
        out[key] = vector[:segments]
    # huggingface/trl#7686's level sizes (segments per level; either name), padded with 0 by its collator:
    # cut at the row's tree_n_chunks when given, else where the padding starts (no level is empty)
    counts = batch.get("tree_n_chunks")
    if counts is not None:
        counts = torch.as_tensor(counts).reshape(-1)
        count = int(counts[row] if counts.numel() == rows else counts[0])
        out["tree_n_chunks"] = count
    for key in ("tree_level_sizes", "tree_sizes"):
        if batch.get(key) is None:
            continue
        vector = _row_vector(batch, key, row, rows)
        if counts is not None:
            out[key] = vector[:count]
            continue
        real = int((vector > 0).sum())
        if bool((vector[real:] > 0).any()) or not bool((vector[:real] > 0).all()):
            raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: malformed padding: {vector.tolist()[:8]} is "
                             "not the level sizes (all > 0) followed by 0 or -1")
        out[key] = vector[:real]

    # the row's tokens: the attention_mask (1s then 0s) when there is one, else the segment bounds
    if batch.get("attention_mask") is not None:
        mask = _row_vector(batch, "attention_mask", row, rows).bool()
        length = int(mask.sum())
        if not bool(mask[:length].all()):
            raise ValueError(f"tree_kwargs_from_batch: attention_mask: row {row}: malformed padding: its 1s are not a "
                             "prefix of the row")
        if length != num_tokens:
            raise ValueError(f"tree_kwargs_from_batch: row {row}: the attention_mask holds {length} tokens but "
                             f"tree_cu_seqlens_q ends at {num_tokens}")
    if batch.get("input_ids") is None:
        raise ValueError("tree_kwargs_from_batch: the batch has no input_ids")
    input_ids = _row_vector(batch, "input_ids", row, rows)
    if input_ids.numel() < num_tokens:
        raise ValueError(f"tree_kwargs_from_batch: input_ids: row {row}: {input_ids.numel()} tokens, but "
                         f"tree_cu_seqlens_q ends at {num_tokens}")
    if batch["input_ids"].dim() == 1 and input_ids.numel() != num_tokens:  # one unpadded row
        raise ValueError(f"tree_kwargs_from_batch: input_ids has {input_ids.numel()} tokens but tree_cu_seqlens_q ends "
                         f"at {num_tokens}")
    out = {"input_ids": input_ids[:num_tokens].unsqueeze(0), **out}
    if batch.get("position_ids") is not None:
        out["position_ids"] = _row_vector(batch, "position_ids", row, rows)[:num_tokens].unsqueeze(0)
    else:
        plan = tree_plan(out, num_tokens=num_tokens)
        out["position_ids"] = plan.array("token_position").clone().to(input_ids.device).unsqueeze(0)
    if batch.get("shift_labels") is not None:
        out["shift_labels"] = _row_vector(batch, "shift_labels", row, rows)[:num_tokens].unsqueeze(0)

    if batch.get("tree_max_seqlens") is not None:
        max_q, max_k = (int(v) for v in _row_vector(batch, "tree_max_seqlens", row, rows).tolist()[:2])
    else:  # not in the batch: what TreeRow.pack() would have put there
        plan = tree_plan(out, num_tokens=num_tokens)
        max_q, max_k = plan.max_segment_length, plan.max_path_length
    out["tree_max_seqlen_q"], out["tree_max_seqlen_k"] = max_q, max_k
    return out


# ------------------------------------------------------------------------------------------------
# FLOPs (integrations/flops.py)
# ------------------------------------------------------------------------------------------------

from .flops import _models_by_config, guarded_flops  # noqa: E402  (re-exported: the trainer's estimate)


def _trainer_flops(config: Any, seq_len: int) -> int:
    """What the trainer module's ``compute_flops_per_token`` becomes under tree_recurrent_models()."""
    return guarded_flops(config, seq_len)


# ------------------------------------------------------------------------------------------------
# the context manager
# ------------------------------------------------------------------------------------------------


class _Patches:
    """setattr with exact restore (reverse order, the very objects)."""

    _MISSING = object()

    def __init__(self):
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((target, name, target.__dict__.get(name, self._MISSING)))
        setattr(target, name, value)

    def restore(self) -> None:
        while self._saved:
            target, name, old = self._saved.pop()
            if old is self._MISSING:
                delattr(target, name)
            else:
                setattr(target, name, old)


def _recurrent_layer_types(config: Any) -> set[str]:
    try:
        return set(getattr(config, "layer_types", None) or []) - _TRL_ATTENTION_TYPES
    except Exception:
        return set()


class _LayerTypesHider:
    """Makes ``config.layer_types`` read None by giving the config object a subclass whose class-level
    property shadows the attribute (a plain attribute, a property, or the attribute ``attribute_map``
    aliases it to, e.g. ``layers_block_type``); restoring gives it back its class, so ``layer_types`` is
    again the very object it was."""

    def __init__(self):
        self._hidden: dict[int, tuple[Any, type]] = {}

    def hide(self, config: Any) -> None:
        if id(config) in self._hidden:
            return
        cls = type(config)
        # configs may alias the name (attribute_map: layer_types -> layers_block_type): shadow both
        names = {"layer_types", (getattr(config, "attribute_map", None) or {}).get("layer_types", "layer_types")}

        def shadowed(name):
            return property(lambda self: None, lambda self, value: self.__dict__.__setitem__(name, value))

        shadow = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                             **{name: shadowed(name) for name in names}})
        config.__class__ = shadow
        self._hidden[id(config)] = (config, cls)

    def restore(self, config: Any) -> None:
        entry = self._hidden.pop(id(config), None)
        if entry is not None:
            entry[0].__class__ = entry[1]

    def restore_all(self) -> None:
        for config, cls in list(self._hidden.values()):
            config.__class__ = cls
        self._hidden.clear()


@contextlib.contextmanager
def tree_recurrent_models(policy: Policy | None = None, backends: dict[str, str] | None = None, *,
                          attn_implementation: str | None = None, packing: str = "auto",
                          flops: bool = True) -> Iterator[list[Support]]:
    """Within this block, trl 1.16's AsyncGRPOTrainer takes models with recurrent layers.

    Every model the trainer loads gets ``tree_recurrence.install(model, policy, backends)`` (its
    :class:`~tree_recurrence.Support` is appended to the yielded list; a model answering ``"none"`` is
    refused with the reason), and the trainer does not see its recurrent ``layer_types`` until it has
    passed its refusal; the config is intact when the constructor returns.

    ``attn_implementation``: replaces TRL's ``"tree_fa3"`` (flash-attention 3 from the kernels hub, CUDA
    only), e.g. ``"tree_flex"`` or ``"tree_sdpa"`` (``tree_recurrence.attention``, registered here). ``packing``: ``"auto"``
    switches the trainer to :class:`ChainTokenBudgetBatcher` / :class:`ChainFixedCountBatcher` when a
    loaded model's support is ``"chains"``; ``"chains"`` always; ``"tree"`` never. ``flops``: replace
    the trainer's FLOPs estimate with :func:`guarded_flops` (used for MFU every optimizer step: keep
    ``trainer.train()`` inside the block). Everything patched is restored on exit, also on exceptions.
    """
    if packing not in ("auto", "tree", "chains"):
        raise ValueError(f"tree_recurrent_models: packing must be 'auto', 'tree' or 'chains', got {packing!r}")
    _check_backends(backends, plugins.families())  # unknown or unavailable backends fail here, not in the trainer
    if attn_implementation in ("tree_sdpa", "tree_flex"):
        from ..attention import register_tree_attention

        register_tree_attention(attn_implementation)
    _agt = _trainer_module()
    chain_classes = _chain_classes()
    supports: list[Support] = []
    installed: list[torch.nn.Module] = []  # uninstalled again if the block raises
    patches = _Patches()
    hider = _LayerTypesHider()
    load_model = _agt.create_model_from_path
    add_head = _agt.add_fused_lm_head
    chains_patched = False

    def use_chain_batchers():
        nonlocal chains_patched
        if not chains_patched:
            patches.set(_agt, "TokenBudgetBatcher", chain_classes["ChainTokenBudgetBatcher"])
            patches.set(_agt, "FixedCountBatcher", chain_classes["ChainFixedCountBatcher"])
            chains_patched = True

    def create_model_from_path(model_id, *args, **kwargs):
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model = load_model(model_id, *args, **kwargs)
        support = install(model, policy=policy, backends=backends)
        supports.append(support)
        installed.append(model)
        if support.mode == "none":
            raise ValueError(f"tree_recurrent_models: {type(model).__name__} ({model_id}) cannot take tree-packed rows: "
                             f"{support.reason}")
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        _models_by_config[id(text_config)] = (weakref.ref(text_config), weakref.ref(model))
        if packing == "chains" or (packing == "auto" and support.mode == "chains"):
            use_chain_batchers()
        if _recurrent_layer_types(text_config):
            hider.hide(text_config)
        return model

    def add_fused_lm_head(model, *args, **kwargs):
        config = getattr(model, "config", None)
        if config is not None:
            hider.restore(config.get_text_config() if hasattr(config, "get_text_config") else config)
        return add_head(model, *args, **kwargs)

    try:
        patches.set(_agt, "create_model_from_path", create_model_from_path)
        patches.set(_agt, "add_fused_lm_head", add_fused_lm_head)
        if flops:
            patches.set(_agt, "compute_flops_per_token", _trainer_flops)
        if packing == "chains":
            use_chain_batchers()
        yield supports
    except BaseException:
        for model in reversed(installed):  # the docstring's promise: nothing changed outlives a failure
            uninstall(model)
        raise
    finally:
        hider.restore_all()
        patches.restore()


def _owns_if_imported(module_name: str, family: str) -> bool:
    return "trl" in sys.modules and trl_owns(module_name, family)


def _note_if_imported(module_name: str, family: str, patched: bool) -> None:
    if "trl" in sys.modules:
        note_patched_here(module_name, family, patched)


# Backend "trl" (install.register_backend: install.py does not know this module): TRL's own tree kernel
# takes the family's modeling modules; without it, this package's hooks with a warning.
register_backend("trl", trl_backend_unavailable, handoff=True, action=hand_off, fallback="auto",
                 owns=_owns_if_imported, note_patched=_note_if_imported)
