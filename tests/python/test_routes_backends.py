"""The router keys a measurement by the bound kernel's package, version and the backend that package
would run the call on: FLA hands its gated delta rule to FlashQLA whenever ``flash_qla`` imports
(FLA >= 0.5.2) and the call is one FlashQLA takes (bf16 / fp16, key and value head dims 128), so a
record taken on FLA's own Triton kernels never orders a call FLA runs on FlashQLA, and the reverse.
CPU only: stand-in packages on the path, records in a temporary cache folder."""

from __future__ import annotations

import pytest
import torch

from test_routes import GDN, cache, check_against_alone, fake_peer_kernel, gdn_inputs, record, run_gdn  # noqa: F401
from tree_recurrence import _peer_libraries, _routes


@pytest.fixture
def flash_qla_installed(tmp_path, monkeypatch):
    """A ``flash_qla`` package importable (a stand-in: only its presence matters to FLA's dispatch)."""
    (tmp_path / "flash_qla").mkdir()
    (tmp_path / "flash_qla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("FLA_FLASH_QLA", "FLA_DISABLE_BACKEND_DISPATCH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


QLA_CALL = {"key": 128, "value": 128}


def test_fla_backend_follows_flas_own_switches(flash_qla_installed, monkeypatch):
    assert _peer_libraries.bound_backend("fla", torch.bfloat16, QLA_CALL) == "flash_qla"
    assert _peer_libraries.bound_backend("fla") == "flash_qla"  # facts unknown: taken
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert _peer_libraries.bound_backend("fla", torch.bfloat16, QLA_CALL) == "triton"
    monkeypatch.setenv("FLA_FLASH_QLA", "1")
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert _peer_libraries.bound_backend("fla", torch.bfloat16, QLA_CALL) == "triton"
    assert _peer_libraries.bound_backend("mamba_ssm") == ""  # one backend


@pytest.mark.parametrize("dtype,dims", [(torch.float32, QLA_CALL), (torch.float64, QLA_CALL),
                                        (torch.bfloat16, {"key": 64, "value": 128}),
                                        (torch.float16, {"key": 128, "value": 256})])
def test_calls_flash_qla_does_not_take_run_on_triton(flash_qla_installed, dtype, dims):
    assert _peer_libraries.bound_backend("fla", dtype, dims) == "triton"


def test_fla_backend_without_flash_qla_is_triton(monkeypatch):
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    if _peer_libraries.importlib.util.find_spec("flash_qla") is not None:
        pytest.skip("flash_qla is installed here")
    assert _peer_libraries.bound_backend("fla", torch.bfloat16, QLA_CALL) == "triton"


def test_kernel_id_names_package_version_and_backend(flash_qla_installed, monkeypatch):
    monkeypatch.setattr(_peer_libraries, "library_version", lambda package: "0.6.0")
    kernel = _peer_libraries.kernel_id("fla", torch.bfloat16, QLA_CALL)
    assert kernel == _peer_libraries.KernelId("fla", "0.6.0", "flash_qla")
    assert kernel.describe() == "fla 0.6.0 on flash_qla"


def test_an_unknown_package_has_no_version():
    assert _peer_libraries.library_version("no_such_package_xyz") == ""


def test_fla_backward_on_hopper_needs_tilelang_or_a_new_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    monkeypatch.setattr(_peer_libraries, "requirement_met", lambda need: False)
    problem = _peer_libraries.backward_problem(_peer_libraries.KernelId("fla", "0.6.0", "triton"), cuda)
    assert problem == "fla's backward on Hopper needs one of ['tilelang', 'triton>=3.7.1']"
    assert _peer_libraries.backward_problem(_peer_libraries.KernelId("fla", "0.6.0", "flash_qla"), cuda) is None
    monkeypatch.setattr(_peer_libraries, "requirement_met", lambda need: need == "tilelang")
    assert _peer_libraries.backward_problem(_peer_libraries.KernelId("fla", "0.6.0", "triton"), cuda) is None
    assert _peer_libraries.backward_problem(_peer_libraries.KernelId("fla", "", "triton"), torch.device("cpu")) is None


@pytest.mark.parametrize("recorded,decides", [("triton", True), ("flash_qla", False)])
def test_only_the_bound_backends_record_orders_a_call(gdn_inputs, flash_qla_installed, recorded, decides):
    """A float64 GDN call bound to an 'fla' kernel: FlashQLA does not take it, FLA runs it on Triton, so a
    Triton record orders it (fork first) and a FlashQLA record does not (the default order: native)."""
    tree, plan, inputs = gdn_inputs
    _routes.store([record(plan.num_tokens, {"native": 10.0, "fork": 1.0}, package="fla", backend=recorded)])
    kernel = fake_peer_kernel("fla.ops.gated_delta_rule.chunk")
    out, decision = run_gdn(plan, inputs, kernel)
    assert decision[2] == ("fork" if decides else "native"), decision
    assert ("fla on triton" in decision[3]) and (("measured by tune" in decision[3]) == decides), decision
    check_against_alone(tree, inputs, out)


def test_a_record_of_another_version_does_not_order(gdn_inputs, monkeypatch):
    tree, plan, inputs = gdn_inputs
    monkeypatch.setattr(_peer_libraries, "library_version", lambda package: "0.7.0")
    _routes.store([record(plan.num_tokens, {"native": 10.0, "fork": 1.0}, version="0.6.0")])
    _, decision = run_gdn(plan, inputs, fake_peer_kernel())
    assert decision[2:] == ("native", "native tree kernel available; default order (no tune record for cpu, "
                                      "fakepeer 0.7.0)")
    _routes.store([record(plan.num_tokens, {"native": 10.0, "fork": 1.0}, version="0.7.0")])
    _, decision = run_gdn(plan, [t.detach().clone().requires_grad_() for t in inputs], fake_peer_kernel())
    assert decision[2] == "fork"
