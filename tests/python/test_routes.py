"""``auto`` never picks a slower route (issues 19 and 20, item 6): the families' measured routes
(manifest ``routes:``, ``tree_recurrence/_routes.py``), the timed trial, and what doctor says.

CPU only: a fake GPU name (``_routes.device_name`` stood in) and fake tables; the real H200 tables
through ``doctor --gpu``."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import models as M
import tree_recurrence as tr
from tree_recurrence import _routes, components, driver, plugins, stand_ins

GDN = "gated_delta_net"
SEAM = "torch_chunk_gated_delta_rule"
FAKE_GPU = "Fake GPU 9000"


def table(native=10.0, fork=5.0, rescan=20.0, gpu=FAKE_GPU, library="fakepeer", shape="tree", tokens=None,
          needs=None, dtypes=("float64", "bfloat16")):
    """A routes table with one class (forward + backward and forward times)."""
    entry = {"shape": shape, "tokens": tokens or 100, "native": {"fwd": native / 4, "fwd_bwd": native}}
    if fork is not None:
        entry["fork"] = {"fwd": fork / 4, "fwd_bwd": fork}
    if rescan is not None:
        entry["rescan"] = {"fwd": rescan / 4, "fwd_bwd": rescan}
    gpu_entry = {"gpu": gpu, "source": "fake numbers", "dtypes": list(dtypes), "classes": [entry]}
    if needs is not None:
        gpu_entry["backward_needs"] = list(needs)
    return {"library": library, "gpus": [gpu_entry]}


def parsed(**kw) -> _routes.Table:
    return _routes.parse("fake.yaml", table(**kw))


ALL = {"native": True, "fork": True, "rescan": True}


# ------------------------------------------------------------------------------------------------
# the choice, as a function of the table
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("times,expected", [((10.0, 5.0, 20.0), "fork"), ((3.0, 5.0, 20.0), "native"),
                                            ((10.0, 12.0, 8.0), "rescan"), ((5.0, 5.0, 5.0), "native")])
def test_choose_picks_the_fastest_measured_route(times, expected):
    native, fork, rescan = times
    strategy, reason = _routes.choose(parsed(native=native, fork=fork, rescan=rescan), FAKE_GPU, "tree", 100,
                                      "bfloat16", "fwd_bwd", ALL, GDN)
    assert strategy == expected, reason
    assert reason.startswith(f"{GDN}: measured on {FAKE_GPU} (tree, 100 tokens, fwd_bwd, bfloat16): {expected}")
    assert "[fake numbers]" in reason and f"native {native:.3g} ms" in reason


def test_choose_skips_routes_the_call_cannot_take():
    t = parsed(native=10.0, fork=5.0, rescan=20.0)
    strategy, reason = _routes.choose(t, FAKE_GPU, "tree", 100, "bfloat16", "fwd_bwd",
                                      {"native": True, "fork": False, "rescan": True})
    assert strategy == "native" and "fork 5 ms (not available)" in reason, reason
    strategy, _ = _routes.choose(t, FAKE_GPU, "tree", 100, "bfloat16", "fwd", ALL)
    assert strategy == "fork"  # forward times are the table's too


@pytest.mark.parametrize("gpu,shape,tokens,dtype,why", [
    ("Other GPU", "tree", 100, "bfloat16", f"no measured routes for GPU 'Other GPU' (measured: {FAKE_GPU})"),
    (None, "tree", 100, "bfloat16", "not on a GPU"),
    (FAKE_GPU, "tree", 100, "float32", "measured for float64/bfloat16, not float32"),
    (FAKE_GPU, "flat", 100, "bfloat16", "no flat class measured"),
    (FAKE_GPU, "tree", 100 * 17, "bfloat16", "more than 16x from this call's 1700"),
])
def test_choose_falls_back_to_the_rule_with_a_reason(gpu, shape, tokens, dtype, why):
    strategy, reason = _routes.choose(parsed(), gpu, shape, tokens, dtype, "fwd_bwd", ALL)
    assert strategy is None and why in reason, reason


def test_nearest_class_by_tokens():
    t = table()
    t["gpus"][0]["classes"].append({"shape": "tree", "tokens": 10000, "native": {"fwd_bwd": 1.0}, "fork": {"fwd_bwd": 2.0}})
    t = _routes.parse("fake.yaml", t)
    assert _routes.choose(t, FAKE_GPU, "tree", 120, "bfloat16", "fwd_bwd", ALL)[0] == "fork"
    assert _routes.choose(t, FAKE_GPU, "tree", 9000, "bfloat16", "fwd_bwd", ALL)[0] == "native"


@pytest.mark.parametrize("change,key", [
    (lambda t: t.update(librar="x"), "routes: librar: not a key of routes"),
    (lambda t: t.update(library="fla-x"), "routes: library: expected the peer library's top-level package name"),
    (lambda t: t["gpus"][0].update(gpu=""), "routes: gpus[0].gpu:"),
    (lambda t: t["gpus"][0]["classes"][0].update(shape="forest"), "routes: gpus[0].classes[0].shape: expected one of"),
    (lambda t: t["gpus"][0]["classes"][0].update(fork={"fwd": -1.0}), "routes: gpus[0].classes[0].fork.fwd: expected positive"),
    (lambda t: t["gpus"][0]["classes"][0].pop("native"), "routes: gpus[0].classes[0].native: missing"),
    (lambda t: t["gpus"][0].update(backward_needs=["tilelang; rm -rf"]), "routes: gpus[0].backward_needs:"),
])
def test_bad_tables_are_refused_naming_the_key(change, key):
    t = table()
    change(t)
    with pytest.raises(_routes.RoutesError, match="^fake.yaml: " + key.replace("[", r"\[").replace("]", r"\]")):
        _routes.parse("fake.yaml", t)


def test_the_shipped_tables_parse_and_name_the_h200():
    for family, library in ((GDN, "fla"), ("mamba2", "mamba_ssm")):
        t = _routes.family_table(plugins.families()[family])
        assert t.library == library and t.for_gpu("NVIDIA H200") is not None
        shapes = {m.shape for m in t.for_gpu("NVIDIA H200").classes}
        assert shapes == {"tree", "flat", "chains"}
    gdn = _routes.family_table(plugins.families()[GDN]).for_gpu("NVIDIA H200")
    # the shipped H200 table: our tree (11.1 ms) beats forking over a working FLA (15.4 ms) on the GRPO trie
    got = _routes.choose(_routes.family_table(plugins.families()[GDN]), "NVIDIA H200", "tree", 49152, "bfloat16",
                         "fwd_bwd", ALL, GDN)
    assert got[0] == "native" and "native 11.1 ms < fork 15.4 ms" in got[1], got
    # a flat row without sharing: ours (12.0 ms) beats FLA's own flat row (12.6 ms, issue 19)
    # forward + backward, and its forward alone (ours 3.465 ms against FLA's 3.5)
    flat = _routes.choose(_routes.family_table(plugins.families()[GDN]), "NVIDIA H200", "flat", 49152, "bfloat16",
                          "fwd_bwd", ALL, GDN)
    assert flat[0] == "native" and "native 12 ms < fork 12.6 ms" in flat[1], flat
    flat_fwd = _routes.choose(_routes.family_table(plugins.families()[GDN]), "NVIDIA H200", "flat", 49152, "bfloat16",
                              "fwd", ALL, GDN)
    assert flat_fwd[0] == "native" and "native 3.46 ms < fork 3.5 ms" in flat_fwd[1], flat_fwd
    assert gdn.backward_needs == ("tilelang", "triton>=3.7.1")
    ssd = _routes.choose(_routes.family_table(plugins.families()["mamba2"]), "NVIDIA H200", "tree", 49152, "bfloat16",
                         "fwd_bwd", {"native": True, "fork": False, "rescan": True}, "mamba2")
    assert ssd[0] == "native" and "native 14.5 ms < rescan 55.1 ms" in ssd[1], ssd


# ------------------------------------------------------------------------------------------------
# through the driver: a GDN seam call on the CPU standing in for a GPU
# ------------------------------------------------------------------------------------------------


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
    n = plan.num_tokens
    gen = torch.Generator().manual_seed(3)
    return tree, plan, [t.requires_grad_() for t in M.gdn_inputs(n, 2, 2, gen)]


@pytest.fixture
def fake_gpu(monkeypatch):
    """``set(name, routes)``: the CPU seen as GPU ``name``, the GDN manifest's routes replaced."""
    record = plugins.families()[GDN]
    manifest = record.manifest
    monkeypatch.setattr(_routes, "device_name", lambda device: FAKE_GPU)
    monkeypatch.delenv(_routes.TRIAL_ENV, raising=False)
    monkeypatch.setattr(_routes, "trials", {})

    def set_routes(routes, name=FAKE_GPU):
        monkeypatch.setattr(_routes, "device_name", lambda device: name)
        monkeypatch.setitem(manifest, "routes", routes)

    yield set_routes


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


@pytest.mark.parametrize("times,expected", [((10.0, 5.0, 20.0), "fork"), ((3.0, 5.0, 20.0), "native"),
                                            ((10.0, 12.0, 8.0), "rescan")])
def test_auto_takes_the_faster_route_on_a_fake_gpu(fake_gpu, gdn_inputs, times, expected):
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(*times, tokens=plan.num_tokens))
    kernel = fake_peer_kernel()
    out, decision = run_gdn(plan, inputs, kernel)
    assert decision[2] == expected, decision
    assert f"measured on {FAKE_GPU} (tree, {plan.num_tokens} tokens, fwd_bwd, float64): {expected}" in decision[3]
    assert (kernel.calls > 0) == (expected != "native")
    check_against_alone(tree, inputs, out)


def test_auto_stays_native_without_the_peer_library_bound(fake_gpu, gdn_inputs):
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(10.0, 1.0, 1.0, tokens=plan.num_tokens))
    kernel = fake_peer_kernel("someotherlib.ops")
    out, decision = run_gdn(plan, inputs, kernel)
    assert decision[2] == "native" and decision[3] == f"{GDN}: bound kernel is someotherlib, not fakepeer: native"
    assert kernel.calls == 0


def test_auto_stays_native_when_the_peer_backward_is_unusable(fake_gpu, gdn_inputs, monkeypatch):
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(10.0, 1.0, 1.0, tokens=plan.num_tokens, needs=["no_such_module_xyz", "torch>=999.0"]))
    _, decision = run_gdn(plan, inputs, fake_peer_kernel())
    assert decision[2] == "native"
    assert "fakepeer's backward on Fake GPU 9000 needs one of ['no_such_module_xyz', 'torch>=999.0']" in decision[3]
    monkeypatch.setattr(_routes, "requirement_met", lambda need: need == "torch>=999.0")
    plan2 = tr.tree_plan(M.pack_forest("groups").trl_kwargs())  # routes are cached per plan
    _, decision = run_gdn(plan2, [t.detach().clone().requires_grad_() for t in inputs], fake_peer_kernel())
    assert decision[2] == "fork", decision


def test_unknown_gpu_falls_back_to_the_rule_with_a_reason(fake_gpu, gdn_inputs, monkeypatch):
    tree, plan, inputs = gdn_inputs
    monkeypatch.setenv(_routes.TRIAL_ENV, "0")
    fake_gpu(table(10.0, 1.0, 1.0, tokens=plan.num_tokens), name="Unknown GPU")
    _, decision = run_gdn(plan, inputs, fake_peer_kernel())
    assert decision[2] == "native"
    assert decision[3] == (f"native tree kernel available ({GDN}: no measured routes for GPU 'Unknown GPU' "
                           f"(measured: {FAKE_GPU}))")


def test_on_the_cpu_the_rule_decides(gdn_inputs, monkeypatch):
    tree, plan, inputs = gdn_inputs
    monkeypatch.delenv(_routes.TRIAL_ENV, raising=False)
    _, decision = run_gdn(plan, inputs, fake_peer_kernel("fla.ops.gated_delta_rule"))
    assert decision[2] == "native"
    assert decision[3] == f"native tree kernel available ({GDN}: not on a GPU: measured routes are per GPU name)"


def test_a_forced_strategy_is_not_second_guessed(fake_gpu, gdn_inputs):
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(10.0, 1.0, 1.0, tokens=plan.num_tokens))
    _, decision = run_gdn(plan, inputs, fake_peer_kernel(), policy=tr.Policy(strategy="native"))
    assert decision[2:] == ("native", "policy forces native")


def test_timed_trial_once_per_shape_class_when_enabled(fake_gpu, gdn_inputs, monkeypatch):
    """TREE_RECURRENCE_ROUTE_TRIAL=1 on the CPU: no numbers for this GPU -> every route is run and timed
    once (the times stood in), the fastest taken, cached for the next plan of the same class."""
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(tokens=plan.num_tokens), name="Trial GPU")
    monkeypatch.setenv(_routes.TRIAL_ENV, "1")
    ran, fake_ms = [], iter([9.0, 4.0, 6.0])  # native, fork, rescan, in that order

    def timed(run, device):
        out = run()
        assert out.shape[:2] == (1, plan.num_tokens)
        ran.append(out)
        return next(fake_ms)

    monkeypatch.setattr(_routes, "time_route", timed)
    out, decision = run_gdn(plan, inputs, fake_peer_kernel())
    assert decision[2] == "fork" and len(ran) == 3, decision
    assert decision[3] == (f"{GDN}: timed trial on Trial GPU (tree, {plan.num_tokens} tokens, fwd_bwd, float64): "
                           "native 9 ms, fork 4 ms, rescan 6 ms")
    for other in ran[1:]:
        assert (other - ran[0]).abs().max() < 1e-10  # the trial ran real routes on copies of the inputs
    assert all(t.grad is not None for t in inputs)  # the call itself still back-propagates
    check_against_alone(tree, inputs, out)
    plan2 = tr.tree_plan(M.pack_forest("groups").trl_kwargs())
    _, again = run_gdn(plan2, [t.detach().clone().requires_grad_() for t in inputs], fake_peer_kernel())
    assert again == decision and len(ran) == 3 and len(_routes.trials) == 1


def test_trial_is_off_by_default_on_the_cpu(fake_gpu, gdn_inputs, monkeypatch):
    tree, plan, inputs = gdn_inputs
    fake_gpu(table(tokens=plan.num_tokens), name="Trial GPU")
    monkeypatch.setattr(_routes, "time_route", lambda run, device: pytest.fail("no trial by default on the CPU"))
    _, decision = run_gdn(plan, inputs, fake_peer_kernel())
    assert decision[2] == "native" and "no measured routes for GPU 'Trial GPU'" in decision[3]


# ------------------------------------------------------------------------------------------------
# doctor
# ------------------------------------------------------------------------------------------------


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tree_recurrence", "doctor", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_doctor_says_which_route_auto_takes_on_the_h200(tmp_path):
    """With stand-in fla, tilelang and mamba_ssm packages importable, as on a GPU machine with FLA's
    working Hopper backward: native on the GRPO trie (faster than forking over FLA) and on GDN's flat row
    forward + backward, FLA for a flat forward, rescan over mamba-ssm on an SSD flat row, with the numbers."""
    for package in ("fla", "tilelang", "mamba_ssm"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    report = json.loads(doctor("--json", "--gpu", "NVIDIA H200", env=env).stdout)
    assert report["routes_gpu"] == "NVIDIA H200"
    rows = {(p["family"], r["shape"], r["phase"]): r for p in report["plugins"] for r in p["routes"]}
    tree = rows[(GDN, "tree", "fwd_bwd")]
    assert tree["route"] == "native" and "native 11.1 ms < fork 15.4 ms < rescan 38.7 ms" in tree["reason"], tree
    assert "issue 19" in tree["reason"] and "gdn_bench.py" in tree["reason"]
    assert rows[(GDN, "tree", "fwd")]["route"] == "native"  # 2.9 ms against FLA forked 5.0 ms
    assert rows[(GDN, "flat", "fwd")]["route"] == "native"  # 3.465 ms against FLA's flat 3.5
    assert rows[("mamba2", "tree", "fwd_bwd")]["route"] == "native"
    # chains: ours 46.11 ms against mamba-ssm's 55.1 (issue 20)
    assert rows[("mamba2", "chains", "fwd_bwd")]["route"] == "native"
    assert rows[("mamba2", "flat", "fwd_bwd")]["route"] == "rescan"  # mamba-ssm's flat row 15.8 ms, ours 15.96
    text = doctor("--gpu", "NVIDIA H200", env=env).stdout
    assert "auto's route on NVIDIA H200:" in text
    assert "tree     49152 tokens fwd_bwd -> native (fla on triton): gated_delta_net: measured on NVIDIA H200" in text


def test_doctor_without_the_peer_library_says_native():
    report = json.loads(doctor("--json", "--gpu", "NVIDIA H200", env={"PYTHONPATH": ""}).stdout)
    rows = {(p["family"], r["shape"], r["phase"]): r for p in report["plugins"] for r in p["routes"]}
    if rows[(GDN, "tree", "fwd_bwd")]["library_installed"]:
        pytest.skip("FLA is installed here")
    tree = rows[(GDN, "tree", "fwd_bwd")]
    assert tree["route"] == "native" and "fork 15.4 ms (not available)" in tree["reason"], tree


def test_doctor_on_an_unknown_gpu_and_without_a_gpu():
    report = json.loads(doctor("--json", "--gpu", "Some Other GPU").stdout)
    gdn = next(p for p in report["plugins"] if p["family"] == GDN)
    assert gdn["routes"] == [{"family": GDN, "route": None, "reason":
                              f"{GDN}: no measured routes for GPU 'Some Other GPU' with fla on triton (measured: "
                              "NVIDIA H200 (fla on triton), NVIDIA H100 80GB HBM3 (fla on triton), NVIDIA H100 80GB "
                              "HBM3 (fla on flash_qla)): the policy's rule (native when available)"}]
    short = next(p for p in report["plugins"] if p["family"] == "short_conv")
    assert short["routes"] == []  # no native scan: nothing to route
    text = doctor().stdout
    if not torch.cuda.is_available():
        assert "auto's route on this machine (no GPU):" in text
        assert f"rule: {GDN}: not on a GPU: measured routes are per GPU name" in text
