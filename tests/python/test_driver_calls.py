"""How the driver calls the kernel transformers bound: the bound implementation is read per
call (kernelize swapping a hub seam's instance forward is seen), varlen is taken on the manifest's word
for library kernels that take ``cu_seqlens`` through ``**kwargs`` (called directly: transformers'
keyword filter would drop it), and a one-level plan (a forest of chains, a single chain) runs as one
plain varlen call that asks for no final states."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import models as M
import tree_recurrence as tr
from conftest import bind_library
from tree_recurrence import stand_ins

pytestmark = pytest.mark.usefixtures("gdn_modules_pristine")

FAMILY = "gated_delta_net"
MODEL_TYPE = "qwen3_5_text"
SCAN = "torch_chunk_gated_delta_rule"


def _module():
    return importlib.import_module(M.MODELING_MODULES[MODEL_TYPE])


@pytest.fixture
def restore_scan():
    module = _module()
    saved = getattr(module, SCAN)
    yield module
    setattr(module, SCAN, saved)


def _run(model, tree):
    with torch.no_grad():
        return model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False,
                     **tree.trl_kwargs()).logits[0]


def _install(model, strategy="fork"):
    support = tr.install(model, policy=tr.Policy(strategy=strategy), backends={FAMILY: "kernel"})
    assert support.mode == "tree"
    return support


def _run_installed(tree, strategy="fork", model=None):
    """The row's logits through a (fresh) model with the hooks installed for the call only."""
    model = model if model is not None else M.make_model(MODEL_TYPE)
    _install(model, strategy)
    try:
        return _run(model, tree)
    finally:
        tr.uninstall(model)


def _expected(tree, strategy="fork"):
    """The same row with FLA's stand-in bound the ordinary way (named cu_seqlens)."""
    module = _module()
    saved = getattr(module, SCAN)
    bind_library(module, SCAN, "chunk_gated_delta_rule", "fla", stand_ins.chunk_gated_delta_rule)
    try:
        return _run_installed(tree, strategy)
    finally:
        setattr(module, SCAN, saved)


# ------------------------------------------------------------------------------------------------
# 13. varlen by the manifest's word
# ------------------------------------------------------------------------------------------------


def _fla_kwargs_style(calls):
    """FLA's newer signature: cu_seqlens travels in **kwargs."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return stand_ins.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                cu_seqlens=kwargs.get("cu_seqlens"))

    return chunk_gated_delta_rule


def _keyword_only_style(calls):
    def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append(cu_seqlens)
        return stand_ins.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    return chunk_gated_delta_rule


@pytest.mark.parametrize("style", [_fla_kwargs_style, _keyword_only_style], ids=["kwargs", "keyword-only"])
def test_varlen_kernel_taking_cu_seqlens_through_kwargs_or_keyword_only(style, restore_scan):
    tree = M.pack_forest("fan")
    expected = _expected(tree)
    calls = []
    bind_library(restore_scan, SCAN, "chunk_gated_delta_rule", "fla", style(calls))
    out = _run_installed(tree)
    assert calls and all(cu is not None for cu in calls), "the varlen kernel got padded batches"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# 12. a one-level plan: one plain varlen call, no final states asked for
# ------------------------------------------------------------------------------------------------


def _no_final_states(calls):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append({"cu_seqlens": cu_seqlens, "output_final_state": output_final_state, "batch": q.shape[0]})
        out, _ = stand_ins.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        return out, None  # a kernel that never returns final states

    return chunk_gated_delta_rule


@pytest.mark.parametrize("strategy", ["fork", "rescan"])
@pytest.mark.parametrize("forest", ["chain", "chains"])
def test_one_level_plan_is_one_plain_varlen_call(forest, strategy, restore_scan):
    if forest == "chains":  # several samples sharing nothing: a forest of chains
        samples = [s for s in M.make_forest("groups") if True][:4]
        tree = M.pack([torch.cat([torch.tensor([2 + i]), s]) for i, s in enumerate(samples)])
    else:
        tree = M.pack_forest("chain")
    assert tr.tree_plan(tree.trl_kwargs()).num_levels == 1
    expected = _expected(tree, strategy)
    calls = []
    bind_library(restore_scan, SCAN, "chunk_gated_delta_rule", "fla", _no_final_states(calls))
    out = _run_installed(tree, strategy)
    plan = tr.tree_plan(tree.trl_kwargs())
    assert len(calls) == 1, calls  # one GDN layer, one call
    assert calls[0]["batch"] == 1 and not calls[0]["output_final_state"]
    assert torch.equal(calls[0]["cu_seqlens"].cpu(), plan.array("seg_offsets")[: plan.num_segments + 1])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# 3. the bound implementation is read per call: kernelize swapping a hub seam's instance forward
# ------------------------------------------------------------------------------------------------


def _hub_seam(func):
    """What the `kernels` package makes of a seam function: an nn.Module whose forward calls it."""

    class HubSeam(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return HubSeam()


def test_instance_forward_swapped_by_kernelize_is_seen(restore_scan):
    tree = M.pack_forest("fan")
    seam = _hub_seam(getattr(restore_scan, SCAN))  # transformers' torch reference: padded batches
    setattr(restore_scan, SCAN, seam)
    model = M.make_model(MODEL_TYPE)
    _install(model)
    calls = []
    try:
        before = _run(model, tree)

        @functools.wraps(stand_ins.chunk_gated_delta_rule)
        def hub_kernel(*args, **kwargs):  # kernelize: a library kernel on the seam's instance
            calls.append(kwargs.get("cu_seqlens"))
            return stand_ins.chunk_gated_delta_rule(*args, **kwargs)

        seam.forward = hub_kernel
        after = _run(model, tree)
    finally:
        tr.uninstall(model)
    assert calls and all(cu is not None for cu in calls), "the driver still used what it read before the swap"
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_profiler_around_the_torch_reference_is_not_taken_for_a_varlen_kernel(restore_scan):
    """A wrapper with an (*args, **kwargs) signature around transformers' torch reference: the driver looks
    through it, so the manifest's varlen word (for library kernels) does not apply: padded batches."""
    tree = M.pack_forest("fan")
    model = M.make_model(MODEL_TYPE)
    expected = _run_installed(tree, model=model)
    inner = getattr(restore_scan, SCAN)
    calls = []

    def profiler(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return inner(*args, **kwargs)

    setattr(restore_scan, SCAN, profiler)
    out = _run_installed(tree, model=model)
    assert calls and all(cu is None for cu in calls)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
