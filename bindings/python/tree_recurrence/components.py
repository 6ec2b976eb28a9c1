"""The SDK for models that follow trees in their own code.

A model whose mixers are written for tree-packed rows needs no seam
patching: it builds the plan from the forward's ``tree_*`` kwargs and runs the tree-aware pieces
itself, then registers a family so that :func:`tree_recurrence.install` claims its mixers and
answers ``"tree"`` instead of reporting them as recurrent layers nobody covers::

    from tree_recurrence import components as trc

    class MyMixer(nn.Module):
        @trc.mark_tree_forward                      # plan context from the tree_* kwargs
        def forward(self, x, **kwargs):
            qkv = trc.short_convolution(self.qkv(x), self.conv.weight, activation="silu")
            q, k, v = ...
            return trc.scan("<family>", "<its scan seam>", q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

    trc.register_family("my_mixer", model_types=["my_model"], mixer_classes=[MyMixer],
                        layer_types=["linear_attention"])

Every component takes ``plan=None``: then the plan of the enclosing :func:`mark_tree_forward`
(``seams.plan_context``) is used, and without one the component runs on an ordinary (flat) batch.
Tensors of a tree-packed row have batch size 1 and the row's tokens along time, as the seams see
them. Scans return the output only (a tree-packed row has one final state per sample, none per row).

Where the pieces run (the same choices the seam adapters make, ``driver.py``):

* ``tree_conv`` / ``short_convolution``: a family's native ``tree_conv`` op for the device (any
  loaded family has one), else a differentiable PyTorch gather over the plan's conv ancestors.
* ``tree_scan``: any recurrence with a library's API (per-sequence initial states, optionally
  ``cu_seqlens``), over the trie: ``native`` (a family's tree op), ``fork`` or ``rescan``, chosen by
  the policy, from a seam spec (the manifest keys: args, sequence, returns, native, state_args,
  neutral, varlen; docs/plugins.md).
* ``scan(family, seam, ...)``: a loaded family's scan seam, with the spec its manifest gives: the
  family's native op, else fork / rescan over ``kernel`` (default: the stand-in the seam's
  ``library:`` names). Families add friendlier fronts in their own Python (``python: {components:
  ...}`` in the manifest, files in ``plugins/<family>/python/``); while the family is loaded they are
  attributes of this module (``components.<name>``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import driver, plugins, seams
from ._plan import TreePlan
from ._registered import register_family, unregister_family  # noqa: F401  (re-exported: part of this SDK)
from ._specs import SeamSpec
from ._tree_kwargs import tree_plan
from .policy import Policy
from .stand_ins import stand_in

__all__ = ["delta_rule_scan", "mark_tree_forward", "register_family", "scan", "short_convolution", "tree_conv", "tree_scan",
           "unregister_family"]


def _plan(plan: TreePlan | None) -> TreePlan | None:
    return plan if plan is not None else seams.current_plan()


def _require_plan(plan: TreePlan | None, what: str) -> TreePlan:
    plan = _plan(plan)
    if plan is None:
        raise ValueError(f"{what}: no plan: pass plan=tree_plan(kwargs), or call it inside a forward marked with "
                         "mark_tree_forward that received tree_* kwargs")
    return plan


# ------------------------------------------------------------------------------------------------
# plan context
# ------------------------------------------------------------------------------------------------


def mark_tree_forward(forward: Callable) -> Callable:
    """Decorates a mixer's ``forward(self, *args, **kwargs)``: when its kwargs carry a tree
    (``tree_cu_seqlens_q``, ...), the forward runs under ``seams.plan_context(plan)``, so every
    component (and every seam that gets no kwargs) called inside it without ``plan=`` follows that
    tree, also when gradient checkpointing replays the layer. Without a tree the forward runs as is."""

    @functools.wraps(forward)
    def tree_forward(self, *args, **kwargs):
        plan = tree_plan(kwargs)
        if plan is None:
            return forward(self, *args, **kwargs)
        with seams.plan_context(plan):
            return forward(self, *args, **kwargs)

    tree_forward.__tree_recurrence_forward__ = forward
    return tree_forward


# ------------------------------------------------------------------------------------------------
# conv
# ------------------------------------------------------------------------------------------------


def _family_with_kernel(kernel: str, device: torch.device | None, preferred: str | None = None) -> str | None:
    """A loaded family advertising ``kernel`` (for ``device`` when given), ``preferred`` first."""
    found = plugins.families()
    names = ([preferred] if preferred in found else []) + sorted(n for n in found if n != preferred)
    for name in names:
        for k, d, ok in found[name].kernels:
            if k == kernel and ok and (device is None or d == device.type):
                return name
    return None


def _tree_conv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, plan: TreePlan):
    """The tree conv with PyTorch ops (any device, autograd): fp32 (float64 for float64), one rounding."""
    channels, width = weight.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    xt = x[0].transpose(0, 1).to(compute)  # (N, C)
    w = weight.to(compute)
    y = xt * w[:, width - 1]
    if width > 1:
        ancestors, _, _ = plan.conv_tables(width, x.device)  # (N, W-1): column j is j+1 steps back, -1 none
        padded = torch.cat([xt, xt.new_zeros(1, channels)])  # row -1 (no ancestor) reads zeros
        taps = padded[ancestors]  # (N, W-1, C)
        y = y + (taps * w[:, : width - 1].flip(-1).transpose(0, 1)).sum(1)
    if bias is not None:
        y = y + bias.to(compute)
    if silu:
        y = F.silu(y)
    return y.to(x.dtype).transpose(0, 1).unsqueeze(0)


def tree_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
              plan: TreePlan | None = None, family: str | None = None) -> torch.Tensor:
    """Causal depthwise conv over a tree-packed row: each token reads the last inputs of its own
    root-to-token path (docs/architecture.md has the formula).

    x (1, C, N) channels-first, as ``causal_conv1d_fn`` takes it; weight (C, W) or (C, 1, W); bias (C)
    or None; activation None, "silu" or "swish". Returns (1, C, N) in x's dtype (computed in fp32,
    activation before the single rounding). ``family``: whose native ``tree_conv`` op to use (default:
    any loaded family with one for x's device); without one, a PyTorch gather does the same. An ``x``
    longer than the plan (a collator's padding after the tree's tokens) gets zeros at the padding
    tokens, whose inputs get zero gradient; a shorter one is a ValueError."""
    driver.check_activation("tree_conv", activation)
    plan = _require_plan(plan, "tree_conv")
    n = plan.num_tokens
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] < n:
        raise ValueError(f"tree_conv: x must be (1, channels, {n}) (one tree-packed row, channels first; longer rows "
                         f"are padding after the tree's tokens), got {tuple(x.shape)}")
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    if family is None:
        family = _family_with_kernel("tree_conv", x.device)
    elif not plugins.families()[family].has_kernel("tree_conv", x.device.type):
        raise ValueError(f"tree_conv: family '{family}' has no tree_conv kernel for {x.device.type} in this build")
    row = x.shape[2]
    x = x.narrow(2, 0, n)  # a row padded past the plan: the conv runs on the tree's tokens (see _pad_row)
    if family is not None:
        return _pad_row(driver.tree_conv(family, x, weight, bias, activation, plan), 2, row)
    return _pad_row(_tree_conv_torch(x, weight, bias, activation is not None, plan), 2, row)


def _pad_row(y: torch.Tensor, dim: int, row: int) -> torch.Tensor:
    """``y`` (the plan's tokens along ``dim``) back to a collator's padded row of ``row`` tokens: zeros for
    the padding tokens, as the seams give them (``driver.SeamCall.pad_row``). Their inputs were cut off
    before the computation, so they get zero gradient and real tokens nothing from them."""
    if y.shape[dim] == row:
        return y
    shape = list(y.shape)
    shape[dim] = row - y.shape[dim]
    return torch.cat([y, y.new_zeros(shape)], dim)


def short_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None, plan: TreePlan | None = None, family: str | None = None) -> torch.Tensor:
    """A short causal depthwise conv on token-major ``x`` (B, T, C) (FLA's ``ShortConvolution`` layout),
    weight (C, W) or (C, 1, W): over the trie of ``plan`` (or the enclosing ``mark_tree_forward``'s),
    else along each row of an ordinary batch. Returns (B, T, C) in x's dtype."""
    plan = _plan(plan)
    if plan is not None:
        return tree_conv(x.transpose(1, 2), weight, bias, activation, plan, family).transpose(1, 2)
    driver.check_activation("short_convolution", activation)
    channels, width = weight.shape[0], weight.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.conv1d(x.transpose(1, 2).to(compute), weight.reshape(channels, 1, width).to(compute),
                 None if bias is None else bias.to(compute), padding=width - 1, groups=channels)[..., : x.shape[1]]
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# scans
# ------------------------------------------------------------------------------------------------


def tree_scan(kernel: Callable, *args, plan: TreePlan | None = None, spec: SeamSpec | dict | None = None,
              family: str | None = None,
              seam: str | None = None, backend: str = "auto", policy: Policy | None = None, **kwargs):
    """Runs the recurrence ``kernel(*args, **kwargs)`` over the trie of ``plan`` as the ``scan`` seam
    adapter does: each segment starts from its parent's final state, and the result equals running
    every root-to-leaf path alone.

    ``kernel`` is what you would call on a flat row: a library kernel or a stand-in with its API
    (per-sequence ``initial_state`` and ``output_final_state``, and ``cu_seqlens`` for varlen).
    ``spec`` is a seam spec with the manifest's keys (docs/plugins.md), or ``family`` + ``seam`` name a
    loaded family's seam whose spec to use. With ``family``, its ``native`` op may run (``backend``
    "auto" or "native", as the policy chooses); without one, fork or rescan over ``kernel``.
    Returns what the seam returns: the output, or (output, None, ...) when the spec says ``returns: n``.
    Inputs longer than the plan (a collator's padding after the tree's tokens) are cut to the plan's
    tokens; the output's padding tokens are zeros, and their inputs get zero gradient."""
    plan = _require_plan(plan, "tree_scan")
    if spec is None:
        if family is None or seam is None:
            raise ValueError("tree_scan: pass spec=, or family= and seam= naming a loaded family's seam")
        spec = plugins.families()[family].seams[seam]
    if backend not in ("auto", "native", "kernel"):
        raise ValueError(f"tree_scan: unknown backend '{backend}', choose one of ['auto', 'native', 'kernel']")
    policy = policy or Policy()
    name = seam or getattr(kernel, "__name__", "tree_scan")
    if family is None and backend == "native":
        raise ValueError("tree_scan: backend 'native' needs family= (whose native op to run)")
    # without a family: fork or rescan over the caller's kernel (its spec's native op is not looked up)
    call = driver.SeamCall.bind(family or driver.PYTHON_FAMILY, name, spec, kernel, plan, args, kwargs)
    call.trim_row()  # a row padded past the plan: the scan runs on the tree's tokens, the padding gets zeros
    return call.pad_row(driver.run_scan(call, backend, policy))


def _first_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def scan(family: str, seam: str, *args, plan: TreePlan | None = None, kernel: Callable | None = None,
         backend: str = "auto", policy: Policy | None = None, **kwargs) -> torch.Tensor:
    """A loaded family's ``scan`` seam over a tree-packed row: ``kernel(*args, **kwargs)`` (what the
    model would call on a flat row) run over the trie of ``plan`` (or the enclosing
    ``mark_tree_forward``'s) with the manifest's seam spec. Returns the output only (a tree-packed row
    has one final state per sample, none per row).

    Native: the seam's ``native`` op when the family registered one (``backend`` "auto" or "native", as
    the policy chooses); else fork / rescan over ``kernel`` (default: the stand-in the seam's
    ``library:`` names). ``backend="kernel"`` skips the native op. An initial state (the spec's
    ``state_args``) is the state every root starts from; native ops take one per root, so with several
    roots fork / rescan run. Without a plan, ``kernel`` runs on the ordinary batch.

    Families ship friendlier fronts (their manifest's ``python: {components: ...}`` module), reachable as
    attributes of this module while the family is loaded."""
    record = plugins.families().get(family)
    if record is None:
        raise ValueError(f"scan: no loaded family '{family}' (loaded: {sorted(plugins.families())})")
    specs = record.seams
    spec = specs.get(seam)
    if spec is None or spec.adapter != "scan":
        raise ValueError(f"scan: family '{family}' has no scan seam '{seam}' (its seams: {sorted(specs)})")
    if backend not in ("auto", "native", "kernel"):
        raise ValueError(f"scan: unknown backend '{backend}', choose one of ['auto', 'native', 'kernel']")
    if kernel is None and spec.library:
        kernel = stand_in(family, seam)
    plan = _plan(plan)
    op = spec.native.op if spec.native is not None else None
    native = backend != "kernel" and op is not None and record.has_kernel(op)
    state_arg = (spec.state_args or {}).get("initial_state")
    several_roots = state_arg is not None and kwargs.get(state_arg) is not None and plan is not None \
        and int((plan.array("parents") < 0).sum()) > 1
    if several_roots:
        native = False
    if plan is None or (not native and kernel is None):
        if kernel is None:
            raise ValueError(f"scan: family '{family}' has no native {op or 'op'} for seam '{seam}' and no kernel was given")
        return _first_output(kernel(*args, **kwargs))
    if not native and backend == "native":
        raise ValueError(f"scan: backend 'native' needs family '{family}''s {op or 'native op'} for seam '{seam}'"
                         + (" and one initial state per root" if several_roots else ""))
    return _first_output(tree_scan(kernel, *args, plan=plan, spec=spec, family=family if native else None, seam=seam,
                                   backend=backend if native else "auto", policy=policy, **kwargs))


def delta_rule_scan(family: str, seam: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, plan: TreePlan | None = None, *, scale: float | None = None,
                    initial_state: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
                    kernel: Callable | None = None, backend: str = "auto", policy: Policy | None = None) -> torch.Tensor:
    """``scan`` for a family's delta-rule seam with FLA's keywords (families' own fronts in their
    ``python/components.py`` call it): ``scale``, ``initial_state`` (the state every root starts from)
    and ``use_qk_l2norm_in_kernel``."""
    extra: dict[str, Any] = {"use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
    if scale is not None:
        extra["scale"] = float(scale)
    if initial_state is not None:
        extra["initial_state"] = initial_state
    return scan(family, seam, q, k, v, g, beta, plan=plan, kernel=kernel, backend=backend, policy=policy, **extra)


def __getattr__(name: str):
    """A loaded family's component adapter by name (its manifest's ``python: {components: ...}``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    for family in plugins.families():
        module = plugins.family_python(family, "components")
        if module is not None and name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no loaded family's components define it)")
