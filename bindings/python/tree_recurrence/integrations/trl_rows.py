"""A collated batch -> the forward kwargs of one row, as TRL's ``compute_loss`` builds them
(``tree_kwargs_from_batch``; re-exported by ``integrations.trl``). Imports no TRL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._tree_kwargs import LEVEL_SIZES, N_CHUNKS, SIZES, chunk_count, index_tensor, tree_plan

__all__ = ["tree_kwargs_from_batch"]


# Fields TRL's collator pads with -1 (a value no real entry has).
_NEGATIVE_PADDED = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
# Fields whose entries may be -1 themselves (a root's parent): cut at the segment count instead.
_SEGMENT_FIELDS = ("tree_segment_parents", "tree_segment_depths")


def _row_vector(batch: Mapping, key: str, row: int, rows: int) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor):  # a list of ints (or of rows of them), as a collator may give
        value = torch.as_tensor(value) if key == "attention_mask" else index_tensor(f"tree_kwargs_from_batch: {key}", value)
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
    the smallest form, ``tree_cu_seqlens_q`` + ``tree_segment_parents``), and huggingface/trl#7686's
    ``tree_level_sizes`` (level sizes) / ``tree_sizes`` (``[max_q, max_k, n_kv, n_chunks, *level sizes]``),
    cut where the 0 / -1 padding after the level sizes starts (``tree_plan`` checks them against the key
    paths), and ``tree_n_chunks`` (per row or per batch; the row's passed on as an int). ``row``: which row
    to take; needed when the batch holds several (one per data-parallel rank).

    Returns ``input_ids`` and ``position_ids`` ``(1, N)`` (``position_ids`` is each token's depth; taken
    from the plan when the batch lacks it), ``shift_labels`` ``(1, N)`` when the batch has them, the
    tree fields without padding, and ``tree_max_seqlen_q`` / ``tree_max_seqlen_k`` ints. Pass them to
    the model with ``use_cache=False`` (TRL's fused head sets it). Raises ``ValueError`` for a batch of
    several rows without ``row=`` (saying how many), and for padding that is not a suffix of -1s, or
    fields that disagree on the row's length.
    """
    if batch.get("tree_cu_seqlens_q") is None:
        raise ValueError("tree_kwargs_from_batch: the batch has no tree_cu_seqlens_q (not a tree-packed batch)")
    cu_q_all = index_tensor("tree_kwargs_from_batch: tree_cu_seqlens_q", batch["tree_cu_seqlens_q"])
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
    # huggingface/trl#7686's fields, padded with 0 by its collator. tree_n_chunks (the chunks its kernel
    # splits a row into: one per row, or one for the batch) is passed on as an int, checked, never used to
    # cut a field. tree_level_sizes (segments per level) and tree_sizes ([max_q, max_k, n_kv, n_chunks,
    # *level sizes]) are cut where the padding after the level sizes starts (no level is empty);
    # tree_plan checks them against the key paths.
    if batch.get(N_CHUNKS) is not None:
        counts = batch[N_CHUNKS]
        counts = (counts if isinstance(counts, torch.Tensor) else torch.as_tensor(counts)).reshape(-1)
        if counts.numel() not in (1, rows):
            raise ValueError(f"tree_kwargs_from_batch: {N_CHUNKS} has {counts.numel()} entries, expected one per row "
                             f"({rows}) or one for the batch")
        out[N_CHUNKS] = chunk_count({N_CHUNKS: counts[row if counts.numel() == rows else 0]})
    for key, header in ((LEVEL_SIZES, 0), (SIZES, 4)):
        if batch.get(key) is None:
            continue
        vector = _row_vector(batch, key, row, rows)
        if vector.numel() < header:
            raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: {vector.numel()} entries, but its layout is "
                             "[max_q, max_k, n_kv, n_chunks, *level sizes]")
        levels = vector[header:]
        real = int((levels > 0).sum())
        if bool((levels[real:] > 0).any()) or not bool((levels[:real] > 0).all()):
            raise ValueError(f"tree_kwargs_from_batch: {key}: row {row}: malformed padding: {levels.tolist()[:8]} "
                             + (f"(entries {header}...) " if header else "")
                             + "is not the level sizes (all > 0) followed by 0 or -1")
        out[key] = vector[: header + real]

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
    if index_tensor("input_ids", batch["input_ids"]).dim() == 1 and input_ids.numel() != num_tokens:  # one row
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
