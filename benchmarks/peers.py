"""The peer kernels the op benchmarks time ours against, when they import: FLA's
``chunk_gated_delta_rule`` (gdn_bench.py) and mamba-ssm's Triton ``mamba_chunk_scan_combined``
(ssd_bench.py). Neither is a dependency: a failed import is reported, never raised.

Where they come from on the GPU machine (no index there): FLA 0.6.0's wheels (and tilelang's, for its
Hopper backward) installed with ``pip install --no-index --no-deps --target DIR`` and DIR on
PYTHONPATH; mamba-ssm's Triton-only copy (shared/tools/mamba-ssm-triton.sh) on PYTHONPATH. When the
first import fails, these folders are tried too: /tmp/peers, /tmp/site (where benchmarks/gpu/common.sh's
PYTHONPATH points), and the checkout's .peers/mamba and .peers/site; any other folder goes on PYTHONPATH."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fallback_paths():
    return ["/tmp/peers", "/tmp/site", os.path.join(REPO, ".peers", "mamba"), os.path.join(REPO, ".peers", "site")]


def _import(module):
    """The module, or the error text of the first attempt (after trying the fallback folders)."""
    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001
        first = f"import {module} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for path in _fallback_paths():
        if os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)
            for name in [m for m in sys.modules if m == module.split(".")[0] or m.startswith(module.split(".")[0] + ".")]:
                del sys.modules[name]  # a half-imported package from the failed attempt
            try:
                return importlib.import_module(module), None
            except Exception:  # noqa: BLE001, S112
                continue
    return None, first


def _version(package: str) -> str:
    try:
        return getattr(importlib.import_module(package), "__version__", "?")
    except Exception as e:  # noqa: BLE001  (flash_qla raises ValueError on a GPU it has no kernels for)
        return f"? (import failed: {type(e).__name__})"


def fla_gdn():
    """(chunk_gated_delta_rule, info) or (None, info with 'skipped')."""
    mod, err = _import("fla.ops.gated_delta_rule")
    if mod is None:
        return None, {"skipped": err}
    info = {"fla": _version("fla"), "fla_path": os.path.dirname(getattr(mod, "__file__", "") or ""),
            "tilelang": _version("tilelang") if importlib.util.find_spec("tilelang") else None,
            "flash_qla": _version("flash_qla") if importlib.util.find_spec("flash_qla") else None,
            "backward": "FLA's own (tilelang on Hopper, or Triton >= 3.7.1)"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return mod.chunk_gated_delta_rule, info


def set_flash_qla(on: bool) -> None:
    """Lets FLA hand chunk_gated_delta_rule to FlashQLA (``on``) or keeps it on FLA's own kernels. FLA reads
    FLA_FLASH_QLA at every call (fla/backends.py BaseBackend.is_enabled), so one process times both."""
    os.environ["FLA_FLASH_QLA"] = "1" if on else "0"


class FlaDispatch:
    """Records which backend FLA's dispatch actually ran: every backend registered in FLA's operation
    registries (fla.backends) has its implementation wrapped, so a call records "op.function -> backend";
    a dispatched call no backend took runs FLA's own (Triton) function and records nothing. ``take()``
    returns what ran since the last take. FLA internals (0.5.2 - 0.6.0): where they differ, ``error`` says
    so and nothing is recorded."""

    def __init__(self):
        self.seen, self.error = set(), None
        try:
            from fla import backends

            for op, registry in backends._operation_registries.items():
                for backend in registry._backends.values():
                    self._wrap(op, backend)
        except Exception as e:  # noqa: BLE001
            self.error = f"FLA's backend registry not readable: {type(e).__name__}: {e}"

    def _wrap(self, op, backend):
        original = backend.get_implementation

        def get_implementation(function_name):
            impl = original(function_name)
            if impl is None:
                return None

            def recorded(*args, **kwargs):
                self.seen.add(f"{op}.{function_name} -> {backend.backend_type}")
                return impl(*args, **kwargs)
            return recorded

        backend.get_implementation = get_implementation

    def take(self) -> dict:
        """{"backends": what ran since the last take}; the GDN call without a backend entry ran FLA's Triton."""
        ran = sorted(self.seen)
        self.seen.clear()
        if self.error:
            return {"backends": None, "backends_error": self.error}
        if not any(r.startswith("gated_delta_rule.") for r in ran):
            ran.insert(0, "gated_delta_rule.chunk_gated_delta_rule -> FLA's own Triton kernels")
        return {"backends": ran}


def is_fla_hopper_guard(e: BaseException) -> bool:
    """FLA 0.6.0's refusal of its gated chunk_bwd_dqkwg on Hopper with Triton 3.4.0 to 3.7.0 (#640)."""
    text = str(e)
    return isinstance(e, RuntimeError) and "Hopper" in text and ("tilelang" in text or "3.7.1" in text)


def bypass_fla_hopper_guard():
    """Lets FLA's Triton GDN backward run on Hopper with Triton < 3.7.1: a TIMING PROXY ONLY, its dg and
    dbeta are wrong there (FLA #640; shared/FACTS.md: same speed within 3% as the tilelang backward).
    The guard (fla/ops/common/chunk_o.py, chunk_bwd_dqkwg) reads the module global TRITON_ABOVE_3_7_1."""
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "Triton backward with FLA's Hopper guard bypassed (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True): " \
           "timing proxy only, its gradients are wrong on this GPU"


def mamba_ssd():
    """(mamba_chunk_scan_combined, info) or (None, info with 'skipped')."""
    mod, err = _import("mamba_ssm.ops.triton.ssd_combined")
    if mod is None:
        return None, {"skipped": err}
    return mod.mamba_chunk_scan_combined, {"mamba_ssm": _version("mamba_ssm"),
                                          "mamba_path": os.path.dirname(getattr(mod, "__file__", "") or "")}
