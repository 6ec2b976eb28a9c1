"""The router (``tree_recurrence/_routes.py``): routes register with a verifier; ``auto`` orders the
routes that can run a call by a ``tune`` record for this device and this bound kernel, else the
default order (the policy's rule); a corrupt record file is ignored with a warning; manifests hold no
timings. CPU only: records written into a temporary cache folder (XDG_CACHE_HOME), with made-up
milliseconds (no test here measures speed)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import _peer_libraries, _routes, components, driver, plugins, stand_ins

GDN = "gated_delta_net"
SEAM = "torch_chunk_gated_delta_rule"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty cache folder of the user's: the router's record file lives there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_peer_kernel(module: str = "fakepeer.ops.gated_delta_rule"):
    """The stand-in GDN kernel, looking like a library's (its ``__module__``), counting its calls."""

    @functools.wraps(stand_ins.chunk_gated_delta_rule)
    def kernel(*args, **kwargs):
        kernel.calls += 1
        return stand_ins.chunk_gated_delta_rule(*args, **kwargs)

    kernel.calls = 0
    kernel.__module__ = module
    return kernel


@pytest.fixture
def gdn_inputs():
    tree = M.pack_forest("groups")
    plan = tr.tree_plan(tree.trl_kwargs())
    gen = torch.Generator().manual_seed(3)
    return tree, plan, [t.requires_grad_() for t in M.gdn_inputs(plan.num_tokens, 2, 2, gen)]


def record(tokens: int, ms: dict, package: str = "fakepeer", version: str = "", backend: str = "", **key) -> dict:
    """A tune record for a GDN seam call on this machine (float64, forward + backward, a tree)."""
    torch_version, ours = _routes.versions()
    return {"device": "cpu", "torch": torch_version, "tree_recurrence": ours, "family": GDN, "seam": SEAM,
            "shape": "tree", "dtype": "float64", "phase": "fwd_bwd", "tokens": tokens,
            "kernel": {"package": package, "version": version, "backend": backend}, "ms": ms, "failed": {}, **key}


def run_gdn(plan, inputs, kernel, policy=None):
    driver.decisions.clear()
    out = components.tree_scan(kernel, *inputs, plan=plan, family=GDN, seam=SEAM, policy=policy or tr.Policy())
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    (decision,) = [d for d in driver.decisions if d[0] == GDN]
    return out, decision


def check_against_alone(tree, inputs, out):
    q, k, v, g, beta = (t.detach() for t in inputs)
    for pos in tree.sample_positions:
        o, _ = stand_ins.chunk_gated_delta_rule(q[:, pos], k[:, pos], v[:, pos], g[:, pos], beta[:, pos])
        assert (o[0] - out[0, pos]).abs().max() < 1e-10


def facts(tokens=100, native=True, fork=True, kernel=_peer_libraries.KernelId("fakepeer"), phase="fwd_bwd"):
    return _routes.Facts(GDN, SEAM, torch.device("cpu"), torch.float64, "tree", tokens, phase, kernel, native, fork)


# ------------------------------------------------------------------------------------------------
# the registry and the choice
# ------------------------------------------------------------------------------------------------


def test_routes_register_with_a_verifier():
    assert list(_routes.VERIFIERS) == ["native", "fork", "rescan"]
    assert _routes.runnable(facts()) == {"native": None, "fork": None, "rescan": None}
    cannot = _routes.runnable(facts(native=False, fork=False))
    assert cannot["native"] == f"no native {GDN} kernel for cpu in this build"
    assert "cannot start sequences from given states" in cannot["fork"] and cannot["rescan"] is None


def test_the_peer_backward_verifier(monkeypatch):
    monkeypatch.setitem(_peer_libraries.BACKWARD_PROBES, "fakepeer", lambda backend, device: "no backward here")
    assert _routes.runnable(facts())["fork"] == "no backward here"
    assert _routes.runnable(facts(phase="fwd"))["fork"] is None  # a forward needs no backward


@pytest.mark.parametrize("ms,expected", [({"native": 10.0, "fork": 5.0, "rescan": 20.0}, "fork"),
                                         ({"native": 3.0, "fork": 5.0, "rescan": 20.0}, "native"),
                                         ({"native": 10.0, "fork": 12.0, "rescan": 8.0}, "rescan"),
                                         ({"native": 5.0, "fork": 5.0}, "native")])
def test_a_record_orders_the_routes(ms, expected):
    path = _routes.store([record(100, ms)])
    strategy, reason = _routes.decide(facts(), ("native", "native tree kernel available"))
    assert strategy == expected, reason
    assert reason.startswith(f"measured by tune on cpu (tree, 100 tokens, fwd_bwd, float64, fakepeer): {expected}")
    assert reason.endswith(f"[{path}]")


def test_routes_the_call_cannot_take_are_skipped():
    _routes.store([record(100, {"native": 10.0, "fork": 5.0, "rescan": 20.0})])
    strategy, reason = _routes.decide(facts(fork=False), ("native", "rule"))
    assert strategy == "native" and "fork 5 ms (the bound kernel cannot start" in reason, reason


@pytest.mark.parametrize("change", [
    {"kernel": {"package": "fakepeer", "version": "", "backend": "flash_qla"}},
    {"kernel": {"package": "fakepeer", "version": "9.9", "backend": ""}},
    {"kernel": {"package": "otherpeer", "version": "", "backend": ""}},
    {"device": "NVIDIA H200"}, {"torch": "0.0.1"}, {"tree_recurrence": "0.0.1"}, {"dtype": "bfloat16"},
    {"phase": "fwd"}, {"shape": "flat"}, {"seam": "other_seam"}, {"tokens": 100 * 5},
])
def test_a_record_for_another_kernel_or_call_does_not_decide(change):
    _routes.store([{**record(100, {"native": 10.0, "fork": 1.0}), **change}])
    strategy, reason = _routes.decide(facts(), ("native", "native tree kernel available"))
    assert strategy == "native"
    assert reason == "native tree kernel available; default order (no tune record for cpu, fakepeer)"


def test_the_nearest_token_count_decides():
    _routes.store([record(100, {"native": 10.0, "fork": 1.0}), record(300, {"native": 1.0, "fork": 10.0})])
    assert _routes.decide(facts(tokens=120), ("native", "rule"))[0] == "fork"
    assert _routes.decide(facts(tokens=280), ("native", "rule"))[0] == "native"


def test_a_corrupt_record_file_warns_and_the_default_order_holds(cache):
    path = _routes.record_path()
    assert path == cache / "tree_recurrence" / "routes.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="not a tune record"):
        strategy, reason = _routes.decide(facts(), ("native", "rule"))
    assert (strategy, reason) == ("native", "rule; default order (no tune record for cpu, fakepeer)")
    assert str(path) in _routes.record_problem()
    path.write_text('{"schema": 1, "records": [{"device": "cpu"}]}')
    with pytest.warns(RuntimeWarning, match=r"records\[0\] is not a measurement record"):
        assert _routes.records() == []
    _routes.store([record(100, {"native": 10.0, "fork": 1.0})])  # tune replaces a corrupt file
    assert _routes.decide(facts(), ("native", "rule"))[0] == "fork" and _routes.record_problem() is None


def test_store_replaces_a_record_of_the_same_key_and_keeps_others():
    _routes.store([record(100, {"native": 1.0}), record(100, {"native": 1.0}, backend="triton")])
    _routes.store([record(100, {"native": 2.0})])
    kept = sorted((r["kernel"]["backend"], r["ms"]["native"]) for r in _routes.records())
    assert kept == [("", 2.0), ("triton", 1.0)]


def test_a_manifest_with_routes_is_refused():
    family = plugins.families()[GDN]
    assert plugins.manifest_error(family) is None
    with_routes = dataclasses.replace(family, manifest={**family.manifest, "routes": {"library": "fla"}})
    error = plugins.manifest_error(with_routes)
    assert "'routes:' is not a manifest key" in error and "python -m tree_recurrence tune" in error
    assert plugins._load_check_error(with_routes) == error  # the plugin is refused at load with it
    assert all("routes" not in f.manifest for f in plugins.families().values())


# ------------------------------------------------------------------------------------------------
# through the driver: a GDN seam call on the CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ms,expected", [({"native": 10.0, "fork": 5.0, "rescan": 20.0}, "fork"),
                                         ({"native": 3.0, "fork": 5.0, "rescan": 20.0}, "native"),
                                         ({"native": 10.0, "fork": 12.0, "rescan": 8.0}, "rescan")])
def test_auto_takes_the_recorded_order(gdn_inputs, ms, expected):
    tree, plan, inputs = gdn_inputs
    _routes.store([record(plan.num_tokens, ms)])
    kernel = fake_peer_kernel()
    out, decision = run_gdn(plan, inputs, kernel)
    assert decision[2] == expected, decision
    assert f"measured by tune on cpu (tree, {plan.num_tokens} tokens, fwd_bwd, float64, fakepeer): {expected}" \
        in decision[3]
    assert (kernel.calls > 0) == (expected != "native")
    check_against_alone(tree, inputs, out)


def test_without_a_record_the_default_order_holds(gdn_inputs):
    tree, plan, inputs = gdn_inputs
    kernel = fake_peer_kernel()
    out, decision = run_gdn(plan, inputs, kernel)
    assert decision[2:] == ("native", "native tree kernel available; default order (no tune record for cpu, fakepeer)")
    assert kernel.calls == 0
    check_against_alone(tree, inputs, out)


def test_a_forced_strategy_is_not_second_guessed(gdn_inputs):
    tree, plan, inputs = gdn_inputs
    _routes.store([record(plan.num_tokens, {"native": 10.0, "fork": 1.0})])
    _, decision = run_gdn(plan, inputs, fake_peer_kernel(), policy=tr.Policy(strategy="native"))
    assert decision[2:] == ("native", "policy forces native")

