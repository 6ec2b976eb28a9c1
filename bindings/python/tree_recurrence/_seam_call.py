"""One bound seam call (``SeamCall``) and its route (``Route``): what the driver's adapters, its scan
strategies (``_scan_strategies``) and family adapters read and write. The log of recent decisions
(``decisions``, the engine's ``ENGINE.decisions``) is named here too, so that every adapter records into the
same one.

The driver (``driver.py``) re-exports ``SeamCall``, ``Route``, ``decisions``, ``check_activation`` and
``PYTHON_FAMILY``; family Python reaches them through ``tree_recurrence.sdk``."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._plan import TreePlan
from ._engine import ENGINE
from ._specs import SeamSpec, seam_spec_of

logger = logging.getLogger("tree_recurrence")

# Recent strategy decisions, newest last: (family, seam, strategy, reason). For tests and debugging.
decisions: collections.deque = ENGINE.decisions

# Keywords of packed-row kernels that the driver sets itself; a caller's own are refused.
_DRIVER_KEYWORDS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")
# Where each adapter's sequence tensors keep their tokens: (names of the spec, time dimension).
_ROW_AXES = {"conv": (lambda spec: spec.args[:1], 2), "scan": (lambda spec: spec.sequence, 1)}
_NO_ROW_AXES = ((), 0)
# The family of calls ``components.tree_scan`` makes over a caller's kernel with no family: no native
# op, and the kernel is varlen only when it names the spec's ``cu_seqlens``.
PYTHON_FAMILY = "<python>"
ACTIVATIONS = (None, "silu", "swish")


def check_activation(what: str, activation: Any) -> None:
    """The one check of a conv's ``activation`` (what causal-conv1d takes)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: activation must be None, 'silu' or 'swish', got {activation!r}")


@dataclass
class SeamCall:
    """One intercepted call, its arguments bound to the names the manifest uses."""

    family: str
    seam: str
    spec: SeamSpec
    original: Callable
    plan: TreePlan
    named: dict
    rest: dict  # other keywords, tree_* removed
    positional: int  # how many of the manifest's arguments the model passed positionally
    row: int | None = field(default=None)  # the row's length when it was longer than the plan (trimmed)
    bound: Callable | None = field(default=None)  # the seam's own kernel where backend "stand_ins" replaced it

    @classmethod
    def bind(cls, family, seam, spec, original, plan, args, kwargs) -> "SeamCall":
        """``args`` / ``kwargs`` bound to ``spec``'s names (a ``SeamSpec``; a manifest-style mapping is parsed)."""
        spec = seam_spec_of(f"family '{family}'", seam, spec)
        names = spec.args
        positional = len(args)
        if positional > len(names):
            raise TypeError(f"{seam}: got {positional} positional arguments, the {family} manifest names {len(names)}")
        named = dict(zip(names, args))
        rest = {k: v for k, v in kwargs.items() if not k.startswith("tree_")}  # every tree field starts so
        for name in names[positional:]:
            if name in rest:
                named[name] = rest.pop(name)
        if not rest.keys().isdisjoint(_DRIVER_KEYWORDS):
            for key in _DRIVER_KEYWORDS:
                if rest.get(key) is not None:
                    raise ValueError(f"{seam}: got both tree_* kwargs and '{key}'; a tree-packed row carries its own "
                                     "boundaries")
                rest.pop(key, None)
        return cls(family, seam, spec, original, plan, named, rest, positional)

    def call_original(self, inputs: dict, **extra):
        """Calls the bound kernel the way the model called the seam (same positional arguments,
        same keywords), with ``inputs`` replacing arguments and ``extra`` added or replacing
        keywords. Library kernels order their parameters differently from the torch references
        (causal-conv1d puts seq_idx before activation), so keywords must stay keywords."""
        names, named, count = self.spec.args, self.named, self.positional
        positional = [inputs[n] if n in inputs else named.get(n) for n in names[:count]]
        keywords = dict(self.rest)
        for n in names[count:]:
            if n in inputs:
                keywords[n] = inputs[n]
            elif n in named:
                keywords[n] = named[n]
        keywords.update(extra)
        return self.original(*positional, **keywords)

    def check_row(self, tensor: torch.Tensor, time_dim: int, what: str) -> None:
        """Refuses ``tensor`` unless it is the plan's row: batch 1, the plan's tokens along ``time_dim``."""
        n = self.plan.num_tokens
        if tensor.shape[0] != 1 or tensor.shape[time_dim] != n:
            raise ValueError(
                f"{self.seam}: {what} has shape {tuple(tensor.shape)}, expected batch 1 and {n} tokens (the tree-packed "
                "row). Tree-packed rows need use_cache=False (no past states) and one packed row per forward.")

    def record(self, strategy: str, reason: str) -> None:
        """Logs what the call does (``decisions``, newest last; debug log)."""
        decisions.append((self.family, self.seam, strategy, reason))
        logger.debug("tree_recurrence: %s/%s -> %s (%s)", self.family, self.seam, strategy, reason)

    def path_rows(self, x: torch.Tensor, time_dim: int):
        """``x``'s row as every root-to-leaf path, the rows of a right-padded batch (zeros after a path's
        end; channels first when ``time_dim`` is 2), and each token's flat index into that batch's
        outputs: for a kernel run over every path alone."""
        return padded_paths_rows(self.plan, x, time_dim)

    def finish(self, output: torch.Tensor):
        """The seam's return value in the shape the model expects: the output, other results None."""
        arity = self.spec.returns
        return output if arity == 1 else (output,) + (None,) * (arity - 1)

    def trim_row(self) -> None:
        """A row longer than the plan (a collator padded ``input_ids`` past the tree's tokens): the seam
        runs on the plan's tokens only, so padding tokens never reach real ones (values or gradients);
        ``row`` keeps the row's length for ``pad_row``."""
        spec = self.spec
        axes = _ROW_AXES.get(spec.adapter)
        names, dim = (axes[0](spec), axes[1]) if axes is not None else _NO_ROW_AXES
        n = self.plan.num_tokens
        named = self.named
        for name in names:
            t = named.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            shape = t.shape
            if len(shape) > dim and shape[dim] > n and shape[0] == 1:
                self.row = t.shape[dim] if self.row is None else self.row
                named[name] = t.narrow(dim, 0, n)

    def pad_row(self, result: Any) -> Any:
        """The seam's result back to the row's length (after ``trim_row``): zeros for the padding tokens."""
        if self.row is None:
            return result
        dim, row = _ROW_AXES[self.spec.adapter][1], self.row

        def pad(t):
            if not isinstance(t, torch.Tensor) or t.dim() <= dim:
                return t
            shape = list(t.shape)
            shape[dim] = row - t.shape[dim]
            return torch.cat([t, t.new_zeros(shape)], dim)

        return (pad(result[0]),) + result[1:] if isinstance(result, tuple) else pad(result)


@dataclass(frozen=True)
class Route:
    """What a seam call does, decided once per (plan, family, seam, spec, device, backend) and cached on
    the plan (``TreePlan.cached``): the strategy and why, the native op's handle, whether the bound
    kernel takes ``cu_seqlens`` and whether it is a library kernel. A seam call after the first is a
    dictionary lookup plus the op."""

    strategy: str
    reason: str
    op: Any = None
    varlen: bool = False
    is_library: bool = True
    kernel: Any = None  # call this instead of the seam object (its keyword filter would drop cu_seqlens)


def padded_paths_rows(plan: TreePlan, x: torch.Tensor, time_dim: int):
    """``x``'s row (batch 1, tokens along ``time_dim``) as every root-to-leaf path, one row of a right-
    padded batch each (zeros after a path's end), and the flat index of each token's output in that
    batch's (paths * Lmax) rows: for kernels that run every path alone (rescan)."""
    gather, source = plan.padded_paths(x.device)
    if time_dim == 2:  # channels first (1, C, N) -> (P, C, Lmax)
        rows = x[0][:, gather.clamp(min=0)] * (gather >= 0).to(x.dtype)
        return rows.permute(1, 0, 2), source
    rows = x[0][gather.clamp(min=0)] * (gather >= 0).reshape(*gather.shape, *(1,) * (x.dim() - 2)).to(x.dtype)
    return rows, source
