"""Shared fixtures of the Python suites: deterministic seeds, an install() that always uninstalls,
kernel libraries bound the way transformers binds them, and a cache of the "every sample alone"
references (the expensive part), keyed by model type, forest and seed."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys

# The families' test-only ops (float64 token oracles, the fused kernels' stage ops) are registered
# only with this set before a plugin loads (sdk/include/tree_recurrence/sdk/test_ops.h).
os.environ["TREE_RECURRENCE_TEST_OPS"] = "1"

import pytest
import torch

import models as M

# Modeling modules as transformers left them at import (before any test touched them).
_PRISTINE: dict[str, dict] = {}


def pristine_seams(model_type: str) -> dict:
    """The module's own seam objects, captured before any test ran."""
    name = M.MODELING_MODULES[model_type]
    if name not in _PRISTINE:
        module = importlib.import_module(name)
        _PRISTINE[name] = {s: getattr(module, s) for s in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    return _PRISTINE[name]


for _mt in M.MODELING_MODULES:
    try:
        pristine_seams(_mt)
    except ImportError:  # a model type this transformers lacks: its tests skip
        pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _gdn_module_changes() -> list[str]:
    from tree_recurrence import seams

    changes = [f"{name} is patched" for name in sorted(seams.owners) if name in _PRISTINE]
    for name, original in _PRISTINE.items():
        module = sys.modules[name]
        changes += [f"{name}.{seam} is not transformers' own" for seam, obj in original.items() if getattr(module, seam) is not obj]
    return changes


@pytest.fixture
def gdn_modules_pristine():
    """Use with ``pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")``: the GDN modeling
    modules must hold transformers' own seams, unpatched, before and after each test (a leak would
    silently change later tests). A leak is repaired after being reported."""
    from tree_recurrence import seams

    before = _gdn_module_changes()
    assert not before, f"an earlier test left GDN modeling modules changed: {before}"
    yield
    leaks = _gdn_module_changes()
    for name in [n for n in list(seams.owners) if n in _PRISTINE]:
        seams.unpatch_module(name)
    for name, original in _PRISTINE.items():
        for seam, obj in original.items():
            setattr(sys.modules[name], seam, obj)
    assert not leaks, f"test left GDN modeling modules changed: {leaks}"


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def decisions():
    """The driver's decision log, emptied before the test."""
    from tree_recurrence import driver

    driver.decisions.clear()
    return driver.decisions


# ------------------------------------------------------------------------------------------------
# kernel libraries bound as transformers binds them
# ------------------------------------------------------------------------------------------------


class KernelSpy:
    """Wraps a stand-in library function (functools.wraps: same signature, so transformers' keyword
    filter sees the library's parameters) and records how each call was made."""

    def __init__(self):
        self.calls: list[dict] = []

    def wrap(self, kind: str, fn):
        @functools.wraps(fn)
        def spy(*args, **kwargs):
            self.calls.append({"kind": kind, "batch": args[0].shape[0], "cu_seqlens": kwargs.get("cu_seqlens"),
                               "initial_state": kwargs.get("initial_state"), "nargs": len(args), "keywords": sorted(kwargs)})
            return fn(*args, **kwargs)

        return spy

    def of(self, kind: str) -> list[dict]:
        return [c for c in self.calls if c["kind"] == kind]


def bind_library(module, seam: str, hub_key: str, package: str, fn):
    """Re-decorates ``module.<seam>``'s torch function with transformers' own
    ``use_kernel_func_from_hub_with_fallback(hub_key, package)`` while a stand-in ``package``
    exposes ``fn``: the result is what the modeling module would hold had the library been
    installed at import. Returns the new seam object."""
    from tree_recurrence.stand_ins import wrap_as_library

    bound = wrap_as_library(pristine_seams_by_module(module)[seam].__wrapped__, package, hub_key, fn)
    setattr(module, seam, bound)
    return bound


def pristine_seams_by_module(module) -> dict:
    for mt, name in M.MODELING_MODULES.items():
        if name == module.__name__:
            return pristine_seams(mt)
    raise KeyError(module.__name__)


BINDINGS = {
    # name: (bind FLA's chunk_gated_delta_rule, bind causal-conv1d's causal_conv1d_fn)
    "torch": (False, False),
    "fla": (True, False),
    "fla+causal_conv1d": (True, True),
}


@pytest.fixture
def bind_kernels():
    """``bind_kernels(model_type, binding)`` binds tree_recurrence.stand_ins' FLA / causal-conv1d
    stand-ins into the model type's modeling module (call it before install) and returns a
    KernelSpy of their calls; the module's seams are restored at teardown."""
    from tree_recurrence import stand_ins

    restore = []

    def bind(model_type: str, binding: str) -> KernelSpy:
        fla, conv = BINDINGS[binding]
        module = importlib.import_module(M.MODELING_MODULES[model_type])
        spy = KernelSpy()
        restore.append((module, {s: getattr(module, s) for s in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}))
        if fla:
            bind_library(module, "torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "fla",
                         spy.wrap("gdr", stand_ins.chunk_gated_delta_rule))
        if conv:
            bind_library(module, "causal_conv1d_fn", "causal_conv1d_fn", "causal_conv1d",
                         spy.wrap("conv", stand_ins.causal_conv1d_fn))
        return spy

    yield bind
    for module, seams in reversed(restore):
        for name, obj in seams.items():
            setattr(module, name, obj)


@pytest.fixture
def tree_install(bind_kernels):
    """``tree_install(model, **kw)`` = tree_recurrence.install, undone at teardown, whatever happened.
    It depends on bind_kernels so that it is torn down first: uninstall puts back the seams it
    replaced (possibly bound stand-ins), then bind_kernels puts back transformers' own."""
    import tree_recurrence as tr

    models = []

    def install(model, **kw):
        support = tr.install(model, **kw)
        models.append(model)
        return support

    yield install
    for model in models:
        tr.uninstall(model)


@pytest.fixture
def installed(tree_install):
    """tree_install under the name the hooks and install-support tests use."""
    return tree_install


# ------------------------------------------------------------------------------------------------
# the references: every sample alone, cached for the session
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def transformers_seams(model_type: str):
    """Runs the block with the modeling module's own (torch) seams, whatever is bound or installed."""
    module = importlib.import_module(M.MODELING_MODULES[model_type])
    current = {s: getattr(module, s) for s in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    for name, obj in pristine_seams(model_type).items():
        setattr(module, name, obj)
    try:
        yield
    finally:
        for name, obj in current.items():
            setattr(module, name, obj)


@pytest.fixture(scope="session")
def alone_reference():
    """``alone_reference(model_type, forest_name, tree, **config_overrides)`` -> Result of every
    sample run alone through a fresh (deterministic) GDN model with transformers' own seams;
    cached in the family harness's session cache."""
    import family_harness as H

    def get(model_type: str, forest: str, tree: M.PackedTree, **overrides) -> M.Result:
        return H.alone(lambda: M.make_model(model_type, **overrides), model_type, forest, tree,
                       guard=lambda: transformers_seams(model_type), **overrides)

    return get


@pytest.fixture
def env(decisions):
    """The family harness's Env: ``env.bind(module, seams)`` binds tree_recurrence.stand_ins'
    library stand-ins into the modeling module as transformers binds the libraries;
    ``env.install(model, **kw)`` installs. Teardown uninstalls first, then restores the seams."""
    import family_harness as H

    e = H.Env()
    yield e
    e.close()


@pytest.fixture
def gdn_follows_chains(monkeypatch):
    """The loaded gated_delta_net family as if its manifest entries said ``follows: chains``."""
    import copy
    import dataclasses

    from tree_recurrence import plugins

    real = plugins.families
    record = dataclasses.replace(real()["gated_delta_net"], manifest=copy.deepcopy(real()["gated_delta_net"].manifest))
    for entry in record.models:
        entry["follows"] = "chains"
    monkeypatch.setattr(plugins, "families", lambda: {**real(), "gated_delta_net": record})
    return record
