"""The family test harness: what the model tests of every family share, written once.

A family's model test file (test_gdn_models.py, test_mamba2_models.py, test_short_conv_models.py)
is a ``Family`` table (model types, tiny configs, modeling modules, mixer classes, plan carriers,
seams) plus what is special to it. From here it takes:

- ``Family.make_model`` / ``Family.alone``: a tiny deterministic model of a type, and every sample
  of a forest run alone through one with the modeling module unpatched (cached for the session);
- ``Env`` (the ``env`` fixture of conftest.py): library stand-ins bound as transformers binds the
  libraries, and installs, undone at teardown in that order;
- ``run_case``: one forest packed into a tree row, installed under a strategy, run once and checked
  against the samples alone (logits at every token, every gradient), with what it ran returned for
  the family's own checks (the driver's decisions, the bound kernels' calls);
- the controls every family runs: an unpatched model must fail the same comparison, uninstall
  restores every module attribute by identity, a hooked model without tree kwargs is
  bit-identical, a tree row with a cache is refused.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import stand_ins, seams

# parameter-name suffixes and the uniform range they are re-drawn from (in parameter order), so that
# every head decays differently and the state carried across a segment boundary matters
SSM_REDRAW = ((("A_log", "dt_bias"), -1.0, 1.0),)


@dataclass(frozen=True)
class Family:
    """One family's table of model types."""

    name: str
    configs: dict[str, dict]  # model_type -> tiny config (docs/transformers-seams.md section 5)
    mixers: dict[str, str]  # model_type -> mixer class name (the manifest's mixers)
    seams: tuple[str, ...]  # the seams the family replaces in every modeling module
    modules: dict[str, str] = field(default_factory=dict)  # model_type -> modeling module, where not the usual
    carriers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # model_type -> plan carrier classes
    redraw: tuple = SSM_REDRAW  # see SSM_REDRAW
    no_attention: frozenset = frozenset()  # model types without attention layers
    required: tuple[str, ...] = ("A_log", "dt_bias", "conv1d.weight")  # parameters gradient must reach
    layers_of: Callable | None = None  # model, model_type -> covered mixer paths (default: by mixer class)

    @property
    def model_types(self) -> list[str]:
        return list(self.configs)

    def module_name(self, model_type: str) -> str:
        return self.modules.get(model_type, f"transformers.models.{model_type}.modeling_{model_type}")

    def module(self, model_type: str):
        return importlib.import_module(self.module_name(model_type))

    def make_model(self, model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
        return M.make_tiny_model(model_type, {**self.configs[model_type], **overrides}, seed=seed, dtype=dtype,
                                 redraw=self.redraw, attention=model_type not in self.no_attention)

    def mixer_paths(self, model, model_type: str) -> list[str]:
        if self.layers_of is not None:
            return self.layers_of(model, model_type)
        return [n for n, m in model.named_modules() if type(m).__name__ == self.mixers[model_type]]

    def alone(self, model_type: str, forest: str, tree: M.PackedTree, **overrides) -> M.Result:
        """Every sample alone through a fresh model on the unpatched modeling module; cached."""
        return alone(lambda: self.make_model(model_type, **overrides), model_type, forest, tree,
                     guard=lambda: _unpatched(self.module_name(model_type)), **overrides)


_ALONE: dict[tuple, M.Result] = {}


def alone(make: Callable, model_type: str, forest: str, tree: M.PackedTree, *, guard: Callable = contextlib.nullcontext,
          **overrides) -> M.Result:
    """The session cache of the "every sample alone" references: ``make()`` builds the model,
    ``guard()`` the context it runs in (the modeling module's own seams)."""
    key = (model_type, forest, tuple(sorted(overrides.items())))
    if key not in _ALONE:
        model = make()
        with guard():
            _ALONE[key] = M.run_alone(model, tree.samples, M.loss_weights(tree.samples))
    return _ALONE[key]


@contextlib.contextmanager
def _unpatched(module_name: str):
    assert module_name not in seams.owners, "alone references run on unpatched modules"
    yield


class Env:
    """``bind(module, seams)`` binds tree_recurrence.stand_ins' library stand-ins into a modeling
    module as transformers binds the libraries; ``install(model, **kw)`` installs. ``close()``
    uninstalls first, then restores the seams."""

    def __init__(self):
        self.models, self.restores = [], []

    def bind(self, module, names):
        self.restores.append(stand_ins.bind_stand_ins(module, seams=names))

    def install(self, model, **kw):
        self.models.append(model)
        return tr.install(model, **kw)

    def close(self):
        for model in self.models:
            tr.uninstall(model)
        for restore in reversed(self.restores):
            restore()


# ------------------------------------------------------------------------------------------------
# one tree row against its samples alone
# ------------------------------------------------------------------------------------------------


def tree_kwargs(tree: M.PackedTree, fmt: str) -> dict:
    """The row's tree kwargs in format ``fmt``: "trl" (TRL 1.16), "rich" (+ parents, depths) or
    "minimal" (segment bounds, parents and depths only)."""
    return {"trl": tree.trl_kwargs, "rich": tree.rich_kwargs, "minimal": tree.minimal_kwargs}[fmt]()


def decided(decisions, family: str) -> list[tuple[str, str]]:
    """The driver's (seam, strategy) decisions for ``family``."""
    return [(d[1], d[2]) for d in decisions if d[0] == family]


@dataclass
class Run:
    model: torch.nn.Module
    tree: M.PackedTree
    strategy: str  # what ran ("auto" resolves to "native")
    layers: list[str]  # the covered mixers' paths
    bound: dict  # seam -> the object the modeling module held before install
    spy: object  # what ``bind`` returned
    alone: M.Result
    result: M.Result
    decided: list[tuple[str, str]]


def run_case(family: Family, model_type: str, forest: str, strategy: str, *, install: Callable, alone: Callable,
             decisions, bind: Callable | None = None, checkpointing=False, overrides=None, fmt="trl",
             what: str = "") -> Run:
    """Packs ``forest``, computes its samples alone, calls ``bind()`` (library stand-ins, before
    install), builds the model (``checkpointing``: True or gradient_checkpointing_kwargs), installs
    it under ``strategy`` (native or auto: backend auto; fork / rescan: backend kernel), checks
    install's answer, runs the row once in format ``fmt`` and checks it equals the samples alone."""
    overrides = overrides or {}
    tree = M.pack_forest(forest)
    ref = alone(model_type, forest, tree, **overrides)
    spy = bind() if bind else None
    module = family.module(model_type)
    bound = {s: getattr(module, s) for s in family.seams}  # what transformers would hold
    model = family.make_model(model_type, **overrides)
    if checkpointing:
        model.gradient_checkpointing_enable(**({} if checkpointing is True else {"gradient_checkpointing_kwargs": checkpointing}))
        assert model.is_gradient_checkpointing
    backend = "auto" if strategy in ("native", "auto") else "kernel"
    if strategy == "auto":  # the defaults: install(model), which picks the native kernels on CPU
        support, strategy = install(model), "native"
    else:
        support = install(model, policy=tr.Policy(strategy=strategy), backends={family.name: backend})
    assert support.mode == "tree", support.reason
    assert support.families == {family.name: backend}
    layers = family.mixer_paths(model, model_type)
    assert sorted(layer.path for layer in support.layers) == sorted(layers) and layers
    for seam, obj in bound.items():
        assert getattr(module, seam).__tree_recurrence_original__ is obj
    for carrier in family.carriers.get(model_type, ()):
        assert getattr(getattr(module, carrier).forward, seams.WRAPPER_MARK) == "carrier"

    kwargs = tree_kwargs(tree, fmt)
    decisions.clear()
    result = M.run_tree(model, tree, M.loss_weights(tree.samples), kwargs)
    what = what or f"{model_type}/{forest}/{strategy}/{fmt}/ckpt={bool(checkpointing)}"
    M.assert_matches(result, ref, model, what=what, required=family.required)
    return Run(model, tree, strategy, layers, bound, spy, ref, result, decided(decisions, family.name))


# ------------------------------------------------------------------------------------------------
# the controls every family runs
# ------------------------------------------------------------------------------------------------


def check_unpatched_model_fails(family: Family, model_type: str, tree: M.PackedTree, ref: M.Result, *,
                                logits_factor: float, grad_suffix: str, grad_factor: float):
    """The same comparison on the model without hooks (installed, then uninstalled) must fail: state
    leaks from one segment into the next in the packed row. The logits miss by more than
    ``logits_factor`` tolerances, some ``*grad_suffix`` gradient by more than ``grad_factor``."""
    model = family.make_model(model_type)
    tr.install(model)
    tr.uninstall(model)
    result = M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs())
    err, tol = M.logits_error(result, ref)
    assert err > logits_factor * tol, f"unpatched {model_type}: error {err:.2e} does not exceed the tolerance {tol:.2e}"
    grad_err = M.grad_errors(result, ref)
    assert any(e > grad_factor * t for n, (e, t) in grad_err.items() if n.endswith(grad_suffix)), \
        f"{grad_suffix} gradients should differ"
    with pytest.raises(AssertionError):
        M.assert_matches(result, ref, model, required=family.required)


def _snapshot(module):
    attrs = dict(vars(module))
    forwards = {name: obj.__dict__.get("forward") for name, obj in attrs.items()
                if isinstance(obj, type) and obj.__module__ == module.__name__}
    return attrs, forwards


def check_uninstall_restores_by_identity(family: Family, model_type: str):
    """Two models of one type installed (backends auto and kernel): every seam holds our wrapper over
    the module's own object and every plan carrier is hooked; uninstalling one keeps them; uninstalling
    both restores every module attribute and every class's forward by identity."""
    module = family.module(model_type)
    attrs, forwards = _snapshot(module)
    carriers = family.carriers.get(model_type, ())
    first, second = family.make_model(model_type), family.make_model(model_type, seed=1)

    def hooked():
        for seam in family.seams:
            wrapper = getattr(module, seam)
            assert getattr(wrapper, seams.WRAPPER_MARK) == (family.name, seam)
            assert wrapper.__tree_recurrence_original__ is attrs[seam]
        for carrier in carriers:
            cls = getattr(module, carrier)
            assert cls.__dict__["forward"] is not forwards[carrier]
            assert getattr(cls.forward, seams.WRAPPER_MARK) == "carrier"

    try:
        assert tr.install(first).mode == "tree"
        assert tr.install(second, backends={family.name: "kernel"}).mode == "tree"
        hooked()
        tr.uninstall(first)  # the second model still uses the module: it stays patched
        hooked()
        tr.uninstall(second)
        assert module.__name__ not in seams.owners
        after, after_forwards = _snapshot(module)
        assert after.keys() == attrs.keys()
        changed = [name for name in attrs if after[name] is not attrs[name]]
        assert not changed, f"not restored by identity: {changed}"
        assert all(after_forwards[n] is f for n, f in forwards.items())
        assert not hasattr(first, "_tree_recurrence_support") and not hasattr(second, "_tree_recurrence_support")
    finally:
        tr.uninstall(first)
        tr.uninstall(second)


def check_bit_identical_without_tree(model, install: Callable):
    """Without tree kwargs the hooks call the seams they replaced, unchanged: outputs and gradients
    of an ordinary batch are bit-identical to the unhooked model's."""
    ids = torch.randint(2, M.VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False).logits
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = run()
    install(model)
    hooked = run()
    assert torch.equal(plain[0], hooked[0])
    assert plain[1].keys() == hooked[1].keys() and all(torch.equal(plain[1][n], hooked[1][n]) for n in plain[1])


def check_tree_row_with_cache_is_refused(model, install: Callable):
    tree = M.pack_forest("fan")
    install(model)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=True, **tree.trl_kwargs())
