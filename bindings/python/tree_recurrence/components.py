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
  family's native op, else fork / rescan over ``kernel`` (default: the reference the seam's
  ``library:`` names). Families add friendlier fronts in their own Python (``python: {components:
  ...}`` in the manifest, files in ``plugins/<family>/python/``); while the family is loaded they are
  attributes of this module (``components.<name>``).
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from . import driver, plugins, seams
from ._plan import TreePlan, tree_plan
from .policy import Policy

__all__ = ["mark_tree_forward", "register_family", "scan", "short_convolution", "tree_conv", "tree_scan",
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
        for k, d, ok in found[name]["kernels"]:
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
    any loaded family with one for x's device); without one, a PyTorch gather does the same."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"tree_conv: activation must be None, 'silu' or 'swish', got {activation!r}")
    plan = _require_plan(plan, "tree_conv")
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != plan.num_tokens:
        raise ValueError(f"tree_conv: x must be (1, channels, {plan.num_tokens}) (one tree-packed row, channels first), "
                         f"got {tuple(x.shape)}")
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    if family is None:
        family = _family_with_kernel("tree_conv", x.device)
    elif not any(k == "tree_conv" and d == x.device.type and ok for k, d, ok in plugins.families()[family]["kernels"]):
        raise ValueError(f"tree_conv: family '{family}' has no tree_conv kernel for {x.device.type} in this build")
    if family is not None:
        return driver.tree_conv(family, x, weight, bias, activation, plan)
    return _tree_conv_torch(x, weight, bias, activation is not None, plan)


def short_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None, plan: TreePlan | None = None, family: str | None = None) -> torch.Tensor:
    """A short causal depthwise conv on token-major ``x`` (B, T, C) (FLA's ``ShortConvolution`` layout),
    weight (C, W) or (C, 1, W): over the trie of ``plan`` (or the enclosing ``mark_tree_forward``'s),
    else along each row of an ordinary batch. Returns (B, T, C) in x's dtype."""
    plan = _plan(plan)
    if plan is not None:
        return tree_conv(x.transpose(1, 2), weight, bias, activation, plan, family).transpose(1, 2)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"short_convolution: activation must be None, 'silu' or 'swish', got {activation!r}")
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


def tree_scan(kernel: Callable, *args, plan: TreePlan | None = None, spec: dict | None = None, family: str | None = None,
              seam: str | None = None, backend: str = "auto", policy: Policy | None = None, **kwargs):
    """Runs the recurrence ``kernel(*args, **kwargs)`` over the trie of ``plan`` as the ``scan`` seam
    adapter does: each segment starts from its parent's final state, and the result equals running
    every root-to-leaf path alone.

    ``kernel`` is what you would call on a flat row: a library kernel or a reference with its API
    (per-sequence ``initial_state`` and ``output_final_state``, and ``cu_seqlens`` for varlen).
    ``spec`` is a seam spec with the manifest's keys (docs/plugins.md), or ``family`` + ``seam`` name a
    loaded family's seam whose spec to use. With ``family``, its ``native`` op may run (``backend``
    "auto" or "native", as the policy chooses); without one, fork or rescan over ``kernel``.
    Returns what the seam returns: the output, or (output, None, ...) when the spec says ``returns: n``."""
    plan = _require_plan(plan, "tree_scan")
    if spec is None:
        if family is None or seam is None:
            raise ValueError("tree_scan: pass spec=, or family= and seam= naming a loaded family's seam")
        spec = plugins.families()[family]["manifest"]["seams"][seam]
    if backend not in ("auto", "native", "kernel"):
        raise ValueError(f"tree_scan: unknown backend '{backend}', choose one of ['auto', 'native', 'kernel']")
    policy = policy or Policy()
    name = seam or getattr(kernel, "__name__", "tree_scan")
    if family is not None:
        call = driver.SeamCall.bind(family, name, spec, kernel, plan, args, kwargs)
        return driver.run_scan(call, backend, policy)
    if backend == "native":
        raise ValueError("tree_scan: backend 'native' needs family= (whose native op to run)")
    spec = {k: v for k, v in spec.items() if k != "native"}
    call = driver.SeamCall.bind("<python>", name, spec, kernel, plan, args, kwargs)
    first = call.named[spec["sequence"][0]]
    driver._check_row(call, first, 1, spec["sequence"][0])
    state = spec.get("state_args")
    if state and call.rest.get(state["output_final_state"]):
        raise ValueError(f"{name}: a tree-packed row has one final state per sample, not one per row")
    _, params, _ = driver.bound_implementation(kernel)
    varlen = "varlen" in spec and spec["varlen"]["cu_seqlens"] in params
    fork = state is not None and (varlen or "neutral" in spec)
    strategy, reason = policy.choose(plan, False, fork)
    driver._record(call, strategy, reason)
    if strategy == "fork":
        return driver._finish(call, driver._scan_fork(call, varlen))
    return driver._finish(call, driver._scan_rescan(call, varlen))


def _first_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def scan(family: str, seam: str, *args, plan: TreePlan | None = None, kernel: Callable | None = None,
         backend: str = "auto", policy: Policy | None = None, **kwargs) -> torch.Tensor:
    """A loaded family's ``scan`` seam over a tree-packed row: ``kernel(*args, **kwargs)`` (what the
    model would call on a flat row) run over the trie of ``plan`` (or the enclosing
    ``mark_tree_forward``'s) with the manifest's seam spec. Returns the output only (a tree-packed row
    has one final state per sample, none per row).

    Native: the seam's ``native`` op when the family registered one (``backend`` "auto" or "native", as
    the policy chooses); else fork / rescan over ``kernel`` (default: the reference the seam's
    ``library:`` names). ``backend="kernel"`` skips the native op. An initial state (the spec's
    ``state_args``) is the state every root starts from; native ops take one per root, so with several
    roots fork / rescan run. Without a plan, ``kernel`` runs on the ordinary batch.

    Families ship friendlier fronts (their manifest's ``python: {components: ...}`` module), reachable as
    attributes of this module while the family is loaded."""
    record = plugins.families().get(family)
    if record is None:
        raise ValueError(f"scan: no loaded family '{family}' (loaded: {sorted(plugins.families())})")
    spec = ((record.get("manifest") or {}).get("seams") or {}).get(seam)
    if not isinstance(spec, dict) or spec.get("adapter") != "scan":
        raise ValueError(f"scan: family '{family}' has no scan seam '{seam}' "
                         f"(its seams: {sorted((record.get('manifest') or {}).get('seams') or {})})")
    if backend not in ("auto", "native", "kernel"):
        raise ValueError(f"scan: unknown backend '{backend}', choose one of ['auto', 'native', 'kernel']")
    if kernel is None and spec.get("library"):
        from . import reference

        kernel = reference._resolve(family, spec["library"]["reference"])
    plan = _plan(plan)
    op = (spec.get("native") or {}).get("op")
    native = backend != "kernel" and op is not None and any(k == op and ok for k, _, ok in record["kernels"])
    state_arg = (spec.get("state_args") or {}).get("initial_state")
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


def __getattr__(name: str):
    """A loaded family's component adapter by name (its manifest's ``python: {components: ...}``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    for family in plugins.families():
        module = plugins.family_python(family, "components")
        if module is not None and name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no loaded family's components define it)")


# ------------------------------------------------------------------------------------------------
# families registered from Python
# ------------------------------------------------------------------------------------------------


def _names(value: str | Iterable[str], what: str) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"register_family: {what} must be a non-empty string or list of strings, got {value!r}")
    return items


def register_family(name: str, model_types: str | Iterable[str], mixer_classes: Iterable[type | str],
                    layer_types: str | Iterable[str], seams: dict[str, dict] | None = None, *,
                    modules: Iterable[str] | None = None, plan_carriers: Iterable[str] = (),
                    detect: Callable[[dict], tuple[bool, str, str]] | None = None, ops: str | None = None,
                    version: str = "0.1.0") -> dict:
    """Registers a family from Python; ``install`` then treats it like a manifest family.

    ``model_types``: the config ``model_type`` values it covers (informational, as in a manifest).
    ``mixer_classes``: the mixer classes (or class names, with ``modules``) that follow the tree;
    ``install`` claims modules of these classes (``detect(description) -> (claimed, role, reason)``
    replaces that test; ``(False, "recurrent", why)`` recognises a module as recurrent without covering
    it, and install answers "none" with ``why``) and patches nothing inside them. ``layer_types``: the ``layer_types`` values
    those mixers implement. ``seams``: module-level functions of the mixers' modeling modules to
    replace, spec by spec as in a manifest (docs/plugins.md; default none: a model that follows trees
    in its own code needs no seam). ``plan_carriers``: class names in those modules whose forward
    sets the plan context. ``ops``: a loaded family whose torch ops (``tree_conv``, native scans)
    the seams' adapters use. Returns the family's record (as ``plugins.families()`` lists it).
    A loaded plugin's name, or one already registered, is refused: unregister_family first."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"register_family: name {name!r} must be lower-case letters, digits and '_'")
    if name in plugins.python_families:
        raise ValueError(f"register_family: family '{name}' is already registered from Python; unregister_family first")
    if name in plugins.families():
        raise ValueError(f"register_family: a family plugin named '{name}' is loaded "
                         f"({plugins.families()[name]['library_path']}); choose another name")
    model_types = _names(model_types, "model_types")
    layer_types = _names(layer_types, "layer_types")
    mixers, mixer_modules = [], []
    for cls in mixer_classes:
        if isinstance(cls, type):
            mixers.append(cls.__name__)
            mixer_modules.append(cls.__module__)
        elif isinstance(cls, str) and cls:
            mixers.append(cls)
        else:
            raise ValueError(f"register_family: mixer_classes must hold classes or class names, got {cls!r}")
    if not mixers:
        raise ValueError("register_family: mixer_classes is empty")
    module_names = list(dict.fromkeys([*(modules or []), *mixer_modules]))
    if not module_names:
        raise ValueError("register_family: mixer classes given by name need modules= (the modules defining them)")
    seam_specs = {}
    for seam, spec in (seams or {}).items():
        if not isinstance(spec, dict) or spec.get("adapter") not in driver.ADAPTERS:
            raise ValueError(f"register_family: seam '{seam}' needs an 'adapter' among {sorted(driver.ADAPTERS)}, got {spec!r}")
        missing = [key for key in ("args",) + (("sequence",) if spec["adapter"] == "scan" else ()) if key not in spec]
        if missing:
            raise ValueError(f"register_family: seam '{seam}' ({spec['adapter']}) lacks {missing}")
        seam_specs[seam] = dict(spec)
    kernels, namespace = [], f"tree_recurrence_{name}"
    if ops is not None:
        provider = plugins.families().get(ops)
        if provider is None:
            raise ValueError(f"register_family: ops='{ops}' names no loaded family (loaded: {sorted(plugins.families())})")
        kernels = list(provider["kernels"])
        namespace = provider.get("op_namespace") or f"tree_recurrence_{ops}"
    if detect is None:
        claimed = set(mixers)

        def detect(description: dict) -> tuple[bool, str, str]:
            if description["class_name"] in claimed:
                return True, "mixer", f"{name} mixer {description['class_name']} (registered from Python)"
            return False, "", ""

    entries = [{"model_type": mt, "module": module, "mixers": mixers, "layer_types": layer_types,
                "plan_carriers": list(plan_carriers)} for module in module_names for mt in model_types]
    record = {
        "family": name, "version": version, "manifest_path": "<registered from Python>", "library_path": "",
        "loaded": True, "error": "", "fingerprint": "python", "python": True,
        "manifest": {"schema": 1, "family": name, "version": version, "library": "", "models": entries,
                     "seams": seam_specs},
        "kernels": kernels, "detect": detect, "op_namespace": namespace,
    }
    plugins.python_families[name] = record
    return record


def unregister_family(name: str) -> None:
    """Removes a family registered from Python (models already installed keep their hooks until
    ``uninstall``)."""
    if name not in plugins.python_families:
        raise KeyError(f"unregister_family: no family '{name}' registered from Python")
    del plugins.python_families[name]
