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

The public seam-call API (what the seam wrappers and ``components`` use; family Python reaches it
through ``tree_recurrence.sdk``):

* ``run(family, seam, spec, kernel, plan, args, kwargs, backend, policy)`` -- one seam call, the way
  ``seams.py``'s wrappers make it: binds the call, trims a row padded past the plan's tokens, runs the
  manifest's adapter, and pads the output back (control flows one way: seam -> driver -> op);
* ``SeamCall`` -- one bound call: ``bind``, ``check_row``, ``record``, ``path_rows``,
  ``call_original``, ``finish`` (``_seam_call.py``, with ``Route`` and ``decisions``);
* ``decide_route(call, backend, policy, device, decide=None)`` -- the call's route, decided once per
  plan and cached there (``decide`` for a family adapter's own decision);
* ``route_decision(call, first, implementation, native, fork, default)`` -- the router's choice for
  a call under backend and policy ``auto`` (a ``tune`` record, else ``default``);
* the adapters ``run_conv`` / ``run_scan`` / ``run_decline`` / ``run_family`` (``ADAPTERS``, one per
  name of ``_specs.KNOWN_ADAPTERS``), and ``tree_conv``, ``bound_implementation``, ``check_activation``,
  ``decisions``.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _routes, plugins
from . import _scan_strategies as strategies
from ._bound_kernels import bound_implementation, instance_forward, takes_keyword
from ._engine import ENGINE
from ._plan import TreePlan
from ._seam_call import PYTHON_FAMILY, Route, SeamCall, check_activation, decisions, logger  # noqa: F401 (its API)
from ._specs import KNOWN_ADAPTERS, SeamSpec
from ._tree_kwargs import host_work
from .policy import Policy
from .stand_ins import stand_in_seam

_warned_reference: set = ENGINE.warned_reference


def run(family: str, seam: str, spec: SeamSpec, kernel: Callable, plan: TreePlan, args: tuple, kwargs: dict,
        backend: str, policy: Policy):
    """One seam call over the trie, as the seam wrappers make it: ``kernel`` is what the seam replaced
    (backend ``"stand_ins"``: the family's library stand-in in its place where it has one, ``kernel`` kept as
    ``SeamCall.bound``); the row is trimmed to the plan's tokens, the adapter runs, the result is padded back."""
    call = SeamCall.bind(family, seam, spec, kernel, plan, args, kwargs)
    if backend == "stand_ins":
        call.original, call.bound = stand_in_seam(family, seam, kernel) or kernel, kernel
    call.trim_row()
    return call.pad_row(ADAPTERS[call.spec.adapter](call, backend, policy))


def _warn_reference(call: SeamCall, is_library: bool) -> None:
    if not is_library and call.seam not in _warned_reference:
        _warned_reference.add(call.seam)
        logger.warning(
            "tree_recurrence: %s runs on transformers' PyTorch reference (no kernel library installed); "
            "correct but slow", call.seam)


def route_decision(call: SeamCall, first: torch.Tensor, implementation: Callable, native: bool, fork: bool,
                   default: tuple[str, str]) -> tuple[str, str]:
    """The router's ``(strategy, reason)`` for a call under backend and policy ``auto``: the fastest route a
    ``tune`` record measured for a call like it (device, dtype and shape of ``first``, its first sequence
    tensor; the bound kernel ``implementation``; whether the family's ``native`` op runs and whether the
    kernel can ``fork`` states), else ``default`` (the policy's rule), its reason saying why."""
    facts = _routes.call_facts(call.family, call.seam, call.plan, first, call.named, implementation, native, fork)
    return _routes.decide(facts, default)


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
        if backend == "auto" and policy.strategy == "auto" and call.family != PYTHON_FAMILY:
            strategy, reason = route_decision(call, call.named[spec.sequence[0]], implementation,
                                              native and policy.prefer_native, fork, (strategy, reason))
    op = getattr(plugins.ops(call.family), op_name) if strategy == "native" else None
    return Route(strategy, reason, op, varlen, is_library, kernel)


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
if tuple(ADAPTERS) != KNOWN_ADAPTERS:  # the spec parser accepts exactly the adapters the driver runs
    raise ImportError(f"driver.ADAPTERS {tuple(ADAPTERS)} differ from _specs.KNOWN_ADAPTERS {KNOWN_ADAPTERS}")
