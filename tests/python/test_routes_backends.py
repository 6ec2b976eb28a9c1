"""Measured routes see which backend the bound peer library runs a call on: FLA hands its GDN to FlashQLA
whenever ``flash_qla`` imports (FLA >= 0.5.2), so a routes table measured on FLA's own Triton kernels must
not route a call that FLA would run on FlashQLA, and a table measured on FlashQLA decides for it
(``_peer_libraries.bound_backend``, ``backend:`` of a GPU table). CPU only: fake packages on the path, a
fake GPU name."""

from __future__ import annotations

import json
import os

import pytest

from test_routes import ALL, FAKE_GPU, GDN, check_against_alone, doctor, fake_gpu, fake_peer_kernel, gdn_inputs, run_gdn  # noqa: F401
from tree_recurrence import _peer_libraries, _routes, plugins


def two_backend_table(triton=(10.0, 5.0), qla=(10.0, 20.0), tokens=100):
    """FLA-named table with one class per backend: (native, fork) forward + backward ms."""
    def gpu(backend, times):
        native, fork = times
        return {"gpu": FAKE_GPU, "backend": backend, "source": f"fake {backend}", "dtypes": ["float64", "bfloat16"],
                "classes": [{"shape": "tree", "tokens": tokens, "native": {"fwd": native / 4, "fwd_bwd": native},
                             "fork": {"fwd": fork / 4, "fwd_bwd": fork}}]}
    gpus = ([gpu("triton", triton)] if triton else []) + ([gpu("flash_qla", qla)] if qla else [])
    return {"library": "fla", "gpus": gpus}


@pytest.fixture
def flash_qla_installed(tmp_path, monkeypatch):
    """A ``flash_qla`` package importable (a stand-in: only its presence matters to FLA's dispatch)."""
    (tmp_path / "flash_qla").mkdir()
    (tmp_path / "flash_qla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("FLA_FLASH_QLA", "FLA_DISABLE_BACKEND_DISPATCH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_fla_backend_follows_flas_own_switches(flash_qla_installed, monkeypatch):
    assert _peer_libraries.bound_backend("fla") == "flash_qla"
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert _peer_libraries.bound_backend("fla") == "triton"
    monkeypatch.setenv("FLA_FLASH_QLA", "1")
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert _peer_libraries.bound_backend("fla") == "triton"
    assert _peer_libraries.bound_backend("mamba_ssm") == ""  # one backend


def test_fla_backend_without_flash_qla_is_triton(monkeypatch):
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    if _peer_libraries.importlib.util.find_spec("flash_qla") is not None:
        pytest.skip("flash_qla is installed here")
    assert _peer_libraries.bound_backend("fla") == "triton"


@pytest.mark.parametrize("backend,expected", [("triton", "fork"), ("flash_qla", "native")])
def test_choose_reads_the_table_of_the_bound_backend(backend, expected):
    t = _routes.parse("fake.yaml", two_backend_table(triton=(10.0, 5.0), qla=(10.0, 20.0)))
    strategy, reason = _routes.choose(t, FAKE_GPU, "tree", 100, "bfloat16", "fwd_bwd", ALL, GDN, backend)
    assert strategy == expected, reason
    assert f"fla on {backend}" in reason and f"[fake {backend}]" in reason


def test_a_table_of_another_backend_does_not_decide():
    t = _routes.parse("fake.yaml", two_backend_table(triton=(10.0, 5.0), qla=None))
    strategy, reason = _routes.choose(t, FAKE_GPU, "tree", 100, "bfloat16", "fwd_bwd", ALL, GDN, "flash_qla")
    assert strategy is None
    assert reason == (f"{GDN}: no measured routes for GPU '{FAKE_GPU}' with fla on flash_qla "
                      f"(measured: {FAKE_GPU} (fla on triton))")


def test_a_bad_backend_name_is_refused_naming_the_key():
    t = two_backend_table()
    t["gpus"][0]["backend"] = "triton; rm -rf"
    with pytest.raises(_routes.RoutesError, match=r"^fake.yaml: routes: gpus\[0\]\.backend:"):
        _routes.parse("fake.yaml", t)


@pytest.mark.parametrize("qla_installed", [False, True])
def test_auto_routes_by_the_bound_backend_through_the_driver(fake_gpu, gdn_inputs, flash_qla_installed, monkeypatch,  # noqa: F811
                                                             qla_installed):
    """A GDN seam call bound to an 'FLA' kernel: with flash_qla importable the FlashQLA table decides
    (native: its fork is slower), with FLA_FLASH_QLA=0 the Triton table decides (fork); both exact."""
    tree, plan, inputs = gdn_inputs
    if not qla_installed:
        monkeypatch.setenv("FLA_FLASH_QLA", "0")
    fake_gpu(two_backend_table(triton=(10.0, 5.0), qla=(10.0, 20.0), tokens=plan.num_tokens))
    kernel = fake_peer_kernel("fla.ops.gated_delta_rule.chunk")
    out, decision = run_gdn(plan, inputs, kernel)
    backend = "flash_qla" if qla_installed else "triton"
    assert decision[2] == ("native" if qla_installed else "fork"), decision
    assert f"fla on {backend}" in decision[3], decision
    check_against_alone(tree, inputs, out)


def test_doctor_names_the_backend(tmp_path):
    """Stand-in fla and tilelang packages: the shipped H200 table (FLA on Triton) decides and doctor says
    so; with flash_qla importable too, no H200 table measured on FlashQLA may decide from Triton numbers."""
    for package in ("fla", "tilelang"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "FLA_FLASH_QLA": "0"}
    text = doctor("--gpu", "NVIDIA H200", env=env).stdout
    assert "-> native (fla on triton): gated_delta_net: measured on NVIDIA H200 (tree, 49152 tokens, fwd_bwd, " \
           "bfloat16, fla on triton)" in text, text
    (tmp_path / "flash_qla").mkdir()
    (tmp_path / "flash_qla" / "__init__.py").write_text("")
    env = {"PYTHONPATH": path, "FLA_FLASH_QLA": "1"}
    report = json.loads(doctor("--json", "--gpu", "NVIDIA H200", env=env).stdout)
    gdn = next(p for p in report["plugins"] if p["family"] == GDN)
    table = _routes.family_table(plugins.families()[GDN])
    measured = {g.backend for g in table.gpus if g.gpu == "NVIDIA H200"}
    for row in gdn["routes"]:
        if "flash_qla" in measured:
            assert row["backend"] == "flash_qla" and "fla on flash_qla" in row["reason"], row
        else:
            assert row["route"] is None and "with fla on flash_qla" in row["reason"], row


@pytest.mark.parametrize("backend,shape,expected", [("flash_qla", "tree", "fork"), ("flash_qla", "chains", "fork"),
                                                    ("triton", "tree", "native"), ("triton", "chains", "native")])
def test_shipped_h100_tables_route_by_the_bound_backend(backend, shape, expected):
    """The H100 runs of benchmarks/gdn_bench.py (results gdn_bench_h100_flashqla_{a,b}.json): FLA forked per
    level on FlashQLA (6.91 ms) beats our tree (12.1 ms), FLA forked on its own Triton kernels (15.6 ms)
    does not; so auto forks over the bound FLA exactly when FLA would run FlashQLA."""
    table = _routes.family_table(plugins.families()[GDN])
    tokens = 163840 if shape == "chains" else 49152
    strategy, reason = _routes.choose(table, "NVIDIA H100 80GB HBM3", shape, tokens, "bfloat16", "fwd_bwd", ALL, GDN,
                                      backend)
    assert strategy == expected, reason
    assert f"fla on {backend}" in reason and "gdn_bench_h100_flashqla" in reason
