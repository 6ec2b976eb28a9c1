"""Chains: every sample its own chain (for models whose support is ``"chains"``): TRL's row and
batchers with nothing shared between samples. Subclasses of TRL's classes: importing this module
imports TRL (``integrations.trl`` imports it on first use of a chain class)."""

from __future__ import annotations

import logging
from typing import Any

from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, TokenBudgetBatcher
from trl.experimental.async_grpo.packing import TreeRow

logger = logging.getLogger("tree_recurrence")

__all__ = ["ChainFixedCountBatcher", "ChainRow", "ChainTokenBudgetBatcher"]


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
