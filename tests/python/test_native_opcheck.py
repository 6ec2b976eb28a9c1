"""torch.library.opcheck over every native scan op of the in-tree families, with exactly the arguments the
driver hands it (captured from a real seam call through components.scan on a small trie), so the ops'
schemas, fake (Meta) kernels and autograd registrations are checked in the convention they are called
with. The tree conv and the SDK's chunk_state_pass have their own opcheck tests (test_tree_conv_op.py,
test_chunk_state_pass.py)."""

from __future__ import annotations

import types

import pytest
import torch

import tree_recurrence as tr
from tree_recurrence import components, plugins

def _delta_rule_inputs(n, g):
    q, k = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(1, n, 2, generator=g, dtype=torch.float64), torch.rand(1, n, 2, generator=g, dtype=torch.float64)
    return (q, k, v, decay, beta), {"use_qk_l2norm_in_kernel": True}


def _ssd_inputs(n, g):
    x = torch.randn(1, n, 2, 4, generator=g, dtype=torch.float64)
    dt = torch.randn(1, n, 2, generator=g, dtype=torch.float64)
    A = -torch.rand(2, generator=g, dtype=torch.float64)
    B, C = (torch.randn(1, n, 1, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return (x, dt, A, B, C), {"D": torch.rand(2, generator=g, dtype=torch.float64),
                              "dt_bias": torch.rand(2, generator=g, dtype=torch.float64), "dt_softplus": True}


# family -> (its scan seam, inputs (n tokens, generator) -> (args, kwargs) for components.scan)
SCANS = {
    "gated_delta_net": ("torch_chunk_gated_delta_rule", _delta_rule_inputs),
    "mamba2": ("mamba2_chunk_scan", _ssd_inputs),
}


def _captured_native_call(family, seam, args, kwargs, plan, monkeypatch):
    """(op, args, kwargs) of the native op as the driver calls it."""
    op_name = plugins.families()[family].seams[seam].native.op
    real = getattr(plugins.ops(family), op_name)
    captured = {}

    def spy(*a, **kw):
        captured["call"] = (a, kw)
        return real(*a, **kw)

    real_ops = plugins.ops
    monkeypatch.setattr(plugins, "ops", lambda f: types.SimpleNamespace(**{op_name: spy}) if f == family else real_ops(f))
    components.scan(family, seam, *args, plan=plan, backend="native", **kwargs)
    monkeypatch.setattr(plugins, "ops", real_ops)
    assert "call" in captured, f"{family}/{seam}: the native op was not called"
    return real, *captured["call"]


@pytest.mark.parametrize("family", sorted(SCANS))
def test_native_scan_op_passes_opcheck(family, monkeypatch):
    if family not in plugins.families():
        pytest.skip(f"family {family} is not loaded")
    seam, make = SCANS[family]
    # 3 levels, segments of 1 to 70 tokens (one longer than a 64-token chunk), two roots
    kwargs = {"tree_cu_seqlens_q": torch.tensor([0, 70, 75, 76, 80, 90, 93]),
              "tree_segment_parents": torch.tensor([-1, 0, 0, 1, -1, 4])}
    plan = tr.tree_plan(kwargs)
    args, scan_kwargs = make(plan.num_tokens, torch.Generator().manual_seed(0))
    for t in args:
        if t.is_floating_point():
            t.requires_grad_()
    op, op_args, op_kwargs = _captured_native_call(family, seam, args, scan_kwargs, plan, monkeypatch)
    torch.library.opcheck(op, op_args, op_kwargs)


@pytest.mark.parametrize("family", ["gated_delta_net", "mamba2", "short_conv"])
def test_kernel_list_is_what_the_family_registered(family):
    """kernels() is derived from the family's registrations (sdk/kernel_list.h): every op it lists as
    available on the CPU has a CPU or composite kernel in the family's op namespace, or is a shared op
    (torch.ops.tree_recurrence, the shared ops library: tree_conv) the family's namespace does not hold."""
    if family not in plugins.families():
        pytest.skip(f"family {family} is not loaded")
    record = plugins.families()[family]
    namespace = record.op_namespace
    listed = {(name, device) for name, device, ok in record.kernels if ok}
    assert ("tree_conv", "cpu") in listed
    for name, device in listed:
        if device != "cpu":
            continue
        qualified = f"{namespace}::{name}"
        if not torch._C._jit_get_schemas_for_operator(qualified):
            qualified = f"tree_recurrence::{name}"
        assert any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)
                   for key in ("CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd")), qualified
