"""The driver: runs a seam call over the trie, generically, from the family manifest's adapter spec.

The adapters (docs/plugins.md):

* ``conv`` -- a causal depthwise conv over channels-first ``(1, C, N)``: the family's native
  ``tree_conv`` op (each token reads its own path's last inputs), or, through the bound kernel,
  every root-to-leaf path as one row of a right-padded batch.
* ``scan`` -- a recurrence over time-major ``(1, N, ...)`` tensors: ``native`` (the family's tree
  scan op), ``fork`` (one call per trie level, initial states from the parents' final states,
  varlen when the bound kernel takes ``cu_seqlens``, else a padded batch whose padding is
  state-neutral), or ``rescan`` (every path once, varlen or padded).
* ``decline`` -- a fused seam whose caller has an unfused path: answers None (the split path runs).
* ``family`` -- a seam the family runs in its own Python (its manifest's ``python: {adapters: ...}``).

No family appears here by name: the manifest says which arguments are which.

The public seam-call API (what the seam wrappers, ``components`` and family adapters use):

* ``run(family, seam, spec, kernel, plan, args, kwargs, backend, policy)`` -- one seam call, the way
  ``seams.py``'s wrappers make it: binds the call, trims a row padded past the plan's tokens, runs the
  manifest's adapter, and pads the output back (control flows one way: seam -> driver -> op);
* ``SeamCall`` -- one bound call: ``bind``, ``check_row``, ``record``, ``path_rows``,
  ``call_original``, ``finish``;
* ``decide_route(call, backend, policy, device, decide=None)`` -- the call's route, decided once per
  plan and cached there (``decide`` for a family adapter's own decision);
* the adapters ``run_conv`` / ``run_scan`` / ``run_decline`` / ``run_family`` (``ADAPTERS``), and
  ``tree_conv``, ``bound_implementation``, ``check_activation``, ``decisions``.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _routes, plugins
from . import _scan_strategies as strategies
from ._bound_kernels import bound_implementation, instance_forward, takes_keyword
from ._plan import TreePlan
from ._specs import SeamSpec, seam_spec_of
from ._tree_kwargs import host_work
from .policy import Policy

logger = logging.getLogger("tree_recurrence")

# Recent strategy decisions, newest last: (family, seam, strategy, reason). For tests and debugging.
decisions: collections.deque = collections.deque(maxlen=256)
_warned_reference: set = set()

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
        return strategies.padded_paths_rows(self.plan, x, time_dim)

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


def run(family: str, seam: str, spec: SeamSpec, kernel: Callable, plan: TreePlan, args: tuple, kwargs: dict,
        backend: str, policy: Policy):
    """One seam call over the trie, as the seam wrappers make it: ``kernel`` is what the seam replaced
    (backend ``"stand_ins"``: the family's library stand-in in its place where it has one, ``kernel`` kept as
    ``SeamCall.bound``); the row is trimmed to the plan's tokens, the adapter runs, the result is padded back."""
    call = SeamCall.bind(family, seam, spec, kernel, plan, args, kwargs)
    if backend == "stand_ins":
        from .stand_ins import stand_in_seam
        call.original, call.bound = stand_in_seam(family, seam, kernel) or kernel, kernel
    call.trim_row()
    return call.pad_row(ADAPTERS[call.spec.adapter](call, backend, policy))


def _warn_reference(call: SeamCall, is_library: bool) -> None:
    if not is_library and call.seam not in _warned_reference:
        _warned_reference.add(call.seam)
        logger.warning(
            "tree_recurrence: %s runs on transformers' PyTorch reference (no kernel library installed); "
            "correct but slow", call.seam)


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


def decide_route(call: SeamCall, backend: str, policy: Policy, device: torch.device,
                 decide: Callable[[SeamCall, str, Policy, torch.device], Route] | None = None) -> Route:
    """The call's route: cached on the plan, else ``decide(call, backend, policy, device)``'s (default:
    the call's adapter's decision, conv or scan; a family adapter passes its own), cached (not for
    ``components.tree_scan`` over a caller's kernel without a family: decided per call). The entry
    holds the policy, the bound kernel and the spec it was decided for (a different one decides again;
    holding them keeps their ids from being reused while the plan lives)."""
    decide = decide or _DECIDE[call.spec.adapter]
    if call.family == PYTHON_FAMILY:  # a caller's kernel and spec, maybe new objects each call: not cached
        return decide(call, backend, policy, device)
    forward = instance_forward(call.original)  # kernelize may swap it: decide again then
    return call.plan.cached(("route", call.family, call.seam, id(call.spec), device, backend),
                            lambda: decide(call, backend, policy, device),
                            depends=(policy, call.original, call.spec, forward))


# --------------------------------------------------------------------------------------------
# conv
# --------------------------------------------------------------------------------------------


def tree_conv(family: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              plan: TreePlan) -> torch.Tensor:
    """A family's native tree conv (the shared ``torch.ops.tree_recurrence.tree_conv``) on a ``(1, C, N)`` row."""
    check_activation("tree_conv", activation)
    plugins.ops(family)  # KeyError when no such family is loaded
    return _tree_conv_op(plugins.shared_ops().tree_conv, x, weight, bias, activation, plan)


def _tree_conv_op(op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  plan: TreePlan) -> torch.Tensor:
    width = weight.shape[-1]
    ancestors, reader_offsets, readers = plan.conv_tables(width, x.device)
    y = op(x[0].transpose(0, 1), weight.reshape(weight.shape[0], width), bias, ancestors, reader_offsets, readers,
           activation is not None)
    return y.transpose(0, 1).unsqueeze(0)


def _decide_conv(call: SeamCall, backend: str, policy: Policy, device: torch.device) -> Route:
    native = plugins.has_kernel(plugins.families()[call.family], "tree_conv", device)
    _, _, is_library = bound_implementation(call.original)
    if backend in ("auto", "native") and native:
        return Route("native", "native tree conv", plugins.shared_ops().tree_conv, is_library=is_library)
    if backend == "native":
        raise ValueError(f"{call.family}: backend 'native' has no tree_conv kernel for {device.type} in this build")
    return Route("rescan", "conv over every path as a padded batch of the bound kernel", is_library=is_library)


# Seam dispatch is host work (policy, plan tables, kernel lookup) around native ops or bound
# kernels: under torch.compile it runs eagerly, one graph break per seam call (``host_work``).
@host_work
def run_conv(call: SeamCall, backend: str, policy: Policy) -> torch.Tensor:
    x_name, w_name, b_name, act_name = call.spec.args[:4]
    x = call.named[x_name]
    call.check_row(x, 2, x_name)
    route = decide_route(call, backend, policy, x.device)
    call.record(route.strategy, route.reason)
    if route.op is not None:
        activation = call.named.get(act_name)
        check_activation("tree_conv", activation)
        return _tree_conv_op(route.op, x, call.named[w_name], call.named.get(b_name), activation, call.plan)
    _warn_reference(call, route.is_library)
    rows, source = call.path_rows(x, 2)
    y = call.call_original({x_name: rows})
    if isinstance(y, tuple):
        y = y[0]
    channels = y.shape[1]
    return y.permute(1, 0, 2).reshape(channels, -1)[:, source].unsqueeze(0)


# --------------------------------------------------------------------------------------------
# scan
# --------------------------------------------------------------------------------------------


@host_work  # see run_conv
def run_scan(call: SeamCall, backend: str, policy: Policy):
    spec = call.spec
    first = call.named[spec.sequence[0]]
    call.check_row(first, 1, spec.sequence[0])
    state = spec.state_args
    if state and call.rest.get(state["output_final_state"]):
        raise ValueError(
            f"{call.seam}: a tree-packed row has one final state per sample, not one per row; "
            "call the model with use_cache=False")
    route = decide_route(call, backend, policy, first.device)
    call.record(route.strategy, route.reason)
    if route.strategy == "native":
        return call.finish(strategies.scan_native(call, route.op))
    _warn_reference(call, route.is_library)
    if route.kernel is not None:
        call.original = route.kernel
    if route.strategy == "fork":
        return call.finish(strategies.scan_fork(call, route.varlen))
    return call.finish(strategies.scan_rescan(call, route.varlen))


def _decide_scan(call: SeamCall, backend: str, policy: Policy, device: torch.device) -> Route:
    spec = call.spec
    op_name = spec.native.op if spec.native is not None and call.family != PYTHON_FAMILY else None
    native = op_name is not None and plugins.has_kernel(plugins.families()[call.family], op_name, device)
    implementation, params, is_library = bound_implementation(call.original)
    cu_name = spec.varlen["cu_seqlens"] if spec.varlen is not None else None
    if call.family == PYTHON_FAMILY:  # a caller's kernel: varlen when it names cu_seqlens
        varlen, kernel, is_library = cu_name is not None and cu_name in params, None, True
    else:
        # The manifest says the family's library kernels take cu_seqlens: a library kernel that names it, or
        # takes **kwargs (FLA passes it there) or keyword-only parameters, is varlen. Through **kwargs only,
        # transformers' wrapper would filter it out: then the implementation is called directly.
        varlen = cu_name is not None and (cu_name in params or (is_library and takes_keyword(implementation, cu_name)))
        kernel = implementation if varlen and cu_name not in params else None
    fork = spec.state_args is not None and (varlen or spec.neutral is not None)
    if backend == "native":
        if not native:
            raise ValueError(f"{call.family}: backend 'native' has no {op_name or 'tree scan'} kernel "
                             f"for {device.type} in this build")
        strategy, reason = "native", "backend native"
    else:
        strategy, reason = policy.choose(call.plan, native and backend == "auto", fork)
        if strategy == "native" and backend == "auto" and policy.strategy == "auto":
            # auto never picks a slower route: the family's measured routes (or a timed trial) decide
            measured, why = _measured_route(call, device, op_name, implementation, is_library, fork, varlen, kernel)
            if measured is not None:
                strategy, reason = measured, why
            elif why:
                reason = f"{reason} ({why})"
    op = getattr(plugins.ops(call.family), op_name) if strategy == "native" else None
    return Route(strategy, reason, op, varlen, is_library, kernel)


def _trial_copy(call: SeamCall, kernel: Any) -> SeamCall:
    """``call`` on detached copies of its tensors (a timed trial's inputs: its graph is its own)."""
    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(v.requires_grad and v.is_floating_point())
        return v

    return SeamCall(call.family, call.seam, call.spec, kernel or call.original, call.plan,
                    {k: copy(v) for k, v in call.named.items()}, {k: copy(v) for k, v in call.rest.items()},
                    call.positional, call.row)


def _measured_route(call: SeamCall, device: torch.device, op_name: str, implementation: Any, is_library: bool,
                    fork: bool, varlen: bool, kernel: Any) -> tuple[str | None, str]:
    """(strategy, reason) by the family's measured routes (``_routes``), or (None, why they did not decide)."""
    first = call.named[call.spec.sequence[0]]

    def trial(route: str) -> float:
        def run():
            copy = _trial_copy(call, kernel if route != "native" else None)
            if route == "native":
                return strategies.scan_native(copy, getattr(plugins.ops(call.family), op_name))
            return (strategies.scan_fork if route == "fork" else strategies.scan_rescan)(copy, varlen)

        return _routes.time_route(run, device)

    return _routes.decide(call.family, plugins.families().get(call.family), call.plan, device, first.dtype,
                          implementation, is_library, {"fork": fork, "rescan": True}, trial, call.seam)


_DECIDE = {"conv": _decide_conv, "scan": _decide_scan}


@host_work  # see run_conv
def run_decline(call: SeamCall, backend: str, policy: Policy):
    """For fused seams whose callers have an unfused path: answer what the model's own reference
    answers when it cannot fuse (the manifest's ``declined``, None by default), so the mixer takes
    its split path, whose seams follow the tree."""
    call.record("decline", "fused seam declined; the mixer takes its split path")
    return call.spec.declined


@host_work  # see run_conv
def run_family(call: SeamCall, backend: str, policy: Policy):
    """Seams a family runs in its own Python: the manifest's ``adapter: family`` with ``function:``,
    a function ``(call, backend, policy)`` of the module its ``python: {adapters: ...}`` names."""
    module = plugins.family_python(call.family, "adapters")
    function = getattr(module, call.spec.function or "", None) if module is not None else None
    if function is None:
        raise ValueError(f"{call.family}: seam '{call.seam}' uses adapter 'family', but the family's Python "
                         f"'adapters' module has no function {call.spec.function!r}")
    return function(call, backend, policy)


ADAPTERS = {"conv": run_conv, "scan": run_scan, "decline": run_decline, "family": run_family}
