"""Diagnosis of the open bug "a C++ error thrown on the fused SSD CUDA path ends the process with SIGSEGV
instead of raising" (docs/kernels.md, Known next steps; GPU runs 3 and 4, in
tests/python/test_ssd_fused_gpu.py::test_benchmark_argument_pattern[128-interim_bwd]).

Each case runs in its own subprocess (`python -X faulthandler`), so a crash does not stop the others, and
prints one line: raised cleanly / no exception / CRASHED (signal) / crashed at exit / timed out, then the
last 30 lines of the child's output (faulthandler's Python stacks show where a crash happened). After
the expected exception the child also runs a CUDA op and a synchronize ("healthy") before exiting, so a
crash at interpreter exit is told apart from one at the throw. Crashed cases are re-run with
TORCH_SHOW_CPP_STACKTRACES=1 (another c10::Error backtrace path) and, where gdb exists, under gdb
(`thread apply all bt`).

Cases (SSD = ssd_tree_scan of the mamba2 family, bf16 on CUDA unless named):
  torch_main          control: an ATen shape error on CUDA (main thread)
  torch_bwd_thread    control: a C++ check in the autograd engine's CUDA worker thread (a Python Function
                      returning a wrongly shaped gradient: validate_outputs throws there)
  ssd_cpu_check       control: ssd_tree_scan on CPU with A misshaped (the plugin's check(), composite)
  ssd_cuda_check      ssd_tree_scan on CUDA with A misshaped (check() in chunked_scan, before fused::*)
  ssd_stages_refusal  ssd_fused_stages with fp32 x on CUDA (stages_op's refusal; no autograd Function)
  ssd_bad_table       the fused path with a non-contiguous parents table (the table() check inside
                      fused::forward, inside ScanFn::forward, inside Function::apply)
  ssd_diag_scan       TREE_RECURRENCE_SSD_DIAG_THROW=scan: a ValueError in fused::scan before
                      Function::apply, grad mode with inputs requiring grad (GPU run 4's refusal)
  ssd_diag_scan_nograd  the same under no_grad
  ssd_diag_forward    TREE_RECURRENCE_SSD_DIAG_THROW=forward: inside ScanFn::forward
  ssd_diag_backward   TREE_RECURRENCE_SSD_DIAG_THROW=backward: inside ScanFn::backward, in the autograd
                      thread (GPU run 3's throw from the interim backward's recompute)
  ssd_cuda_composite_chunk128  TREE_RECURRENCE_SSD_FUSED=0 at chunk 128: the composite's state pass
                      refuses chunk > 64 on CUDA (main thread)
  gdn_cuda_check      control: gdn_tree_scan on CUDA with beta misshaped
  gdn_bad_table       control: gdn_tree_scan on CUDA with a non-contiguous parents table
  pytest_diag_scan / pytest_diag_backward / pytest_after_stages
                      the ssd_diag_* throws under pytest (pytest.raises, monkeypatch, -s -q as
                      benchmarks/gpu/kernels.sh runs the file); pytest_after_stages first runs the stage
                      and benchmark-pattern tests of test_ssd_fused_gpu.py that precede the crashing
                      case in the file, then the run-4 throw, in one process.

Run on the GPU (from the repository root, after the package build):
  .venv/bin/python benchmarks/gpu/diag_throw.py            (all cases; ~2-4 minutes)
  .venv/bin/python benchmarks/gpu/diag_throw.py ssd_diag_scan ssd_diag_backward   (some)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "python"
TIMEOUT_S = int(os.environ.get("DIAG_TIMEOUT_S", "150"))


# --- the cases (run in the child) ---------------------------------------------------------------
def _setup():
    sys.path.insert(0, str(TESTS))
    import torch  # noqa: F401

    import test_ssd_fused_gpu as T  # inputs / tables / calls of the SSD GPU tests

    return T


def _ssd_inputs(chunk=64, grad=True):
    import torch

    T = _setup()
    seg, par = T.BENCH_TRIE
    tabs = T.chunk_tables(seg, par, chunk, "cuda")
    base = T.bench_inputs(seg[-1])
    ins = {k: v.detach().clone().requires_grad_(grad) for k, v in base.items()}
    return T, torch, tabs, ins


def case_torch_main():
    import torch

    a, b = torch.randn(2, 3, device="cuda"), torch.randn(4, 5, device="cuda")
    torch.mm(a, b)


def case_torch_bwd_thread():
    import torch

    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g[:1]  # wrong shape: the engine's validate_outputs (C++) throws in the CUDA worker thread

    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    Bad.apply(x).sum().backward()


def case_ssd_cpu_check():
    import torch

    T = _setup()
    seg, par = T.BENCH_TRIE
    tabs = T.chunk_tables(seg, par, 64, "cpu")
    n, H, P, G, N = seg[-1], 4, 32, 2, 16
    ins = dict(x=torch.randn(n, H, P), dt=torch.randn(n, H), B=torch.randn(n, G, N), C=torch.randn(n, G, N),
               z=torch.randn(n, H, P), D=torch.rand(H), dt_bias=torch.zeros(H))
    ins["A"] = torch.zeros(3)  # (H) expected, H = 4
    T.bench_call(ins, tabs)


def case_ssd_cuda_check():
    import torch

    T, _, tabs, ins = _ssd_inputs()
    ins["A"] = torch.zeros(3, device="cuda")
    T.bench_call(ins, tabs)


def case_ssd_stages_refusal():
    T, _, tabs, ins = _ssd_inputs(grad=False)
    ins["x"] = ins["x"].float()
    T._ops().ssd_fused_stages(ins["x"], ins["dt"], ins["B"], ins["C"], tabs["gather"], tabs["scatter"],
                              tabs["seg_chunk_offsets"], tabs["parents"], tabs["root_index"], tabs["level_segments"],
                              tabs["level_offsets"], tabs["child_offsets"], tabs["children"], None, A=ins["A"],
                              dt_limit=[0.0, float("inf")], D=ins["D"], dt_bias=ins["dt_bias"], dt_softplus=True,
                              z=ins["z"])


def case_ssd_bad_table():
    import torch

    T, _, tabs, ins = _ssd_inputs()
    p = tabs["parents"]
    tabs = dict(tabs, parents=torch.stack([p, p], 1)[:, 0])  # same values, stride 2: not contiguous
    assert not tabs["parents"].is_contiguous()
    T.bench_call(ins, tabs)


def _diag(where, grad=True, backward=False):
    os.environ["TREE_RECURRENCE_SSD_DIAG_THROW"] = where
    os.environ["TREE_RECURRENCE_TEST_OPS"] = "1"  # the hook is armed only in test processes (ssd_fused.cpp)
    T, torch, tabs, ins = _ssd_inputs(grad=grad)
    if not grad:
        with torch.no_grad():
            T.bench_call(ins, tabs)
        return
    y = T.bench_call(ins, tabs)
    if backward:
        torch.autograd.grad(y.sum(), [ins["x"], ins["A"]])


def case_ssd_diag_scan():
    _diag("scan")


def case_ssd_diag_scan_nograd():
    _diag("scan", grad=False)


def case_ssd_diag_forward():
    _diag("forward")


def case_ssd_diag_backward():
    _diag("backward", backward=True)


def case_ssd_cuda_composite_chunk128():
    os.environ["TREE_RECURRENCE_SSD_FUSED"] = "0"
    T, torch, tabs, ins = _ssd_inputs(chunk=128)
    T.bench_call(ins, tabs)


def _gdn():
    import torch

    sys.path.insert(0, str(TESTS))
    import test_gdn_fused_gpu as G

    c = G.make_case("around_chunk_strong", torch.bfloat16)
    return G, torch, c


def case_gdn_cuda_check():
    G, torch, c = _gdn()
    x = dict(c["x"])
    x["beta"] = x["beta"][:, :1].contiguous()
    G.call_op(c, x)


def case_gdn_bad_table():
    G, torch, c = _gdn()
    tabs = list(c["tabs"])
    p = tabs[3]
    tabs[3] = torch.stack([p, p], 1)[:, 0]
    G.call_op(dict(c, tabs=tuple(tabs)))


PYTEST_BODY = '''
import os, sys, pytest, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
import diag_throw as D

def test_diag_scan(monkeypatch):
    monkeypatch.setenv("TREE_RECURRENCE_SSD_FUSED_BWD", "0")
    with pytest.raises(ValueError, match="DIAG_THROW"):
        D._diag("scan")

def test_diag_backward(monkeypatch):
    monkeypatch.setenv("TREE_RECURRENCE_SSD_FUSED_BWD", "0")
    with pytest.raises(ValueError, match="DIAG_THROW"):
        D._diag("backward", backward=True)

def test_after(monkeypatch):
    torch.cuda.synchronize()
    print("DIAG_RESULT healthy (pytest)")
'''


def _pytest(select, pre=()):
    here = str(Path(__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "test_diag_throw_tmp.py"
        f.write_text(PYTEST_BODY.format(tests=str(TESTS), here=here))
        args = [sys.executable, "-X", "faulthandler", "-m", "pytest", *pre, f"{f}::{select}", f"{f}::test_after", "-q",
                "-s", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
        rc = subprocess.call(args, cwd=str(ROOT))
    print(f"DIAG_RESULT pytest rc {rc}")
    if rc < 0:
        os.kill(os.getpid(), -rc)  # report the signal as this child's own
    sys.exit(0 if rc == 0 else 3)


def case_pytest_diag_scan():
    _pytest("test_diag_scan")


def case_pytest_diag_backward():
    _pytest("test_diag_backward")


def case_pytest_after_stages():
    f = TESTS / "test_ssd_fused_gpu.py"
    _pytest("test_diag_scan", pre=[f"{f}::test_stages_variants", f"{f}::test_benchmark_argument_pattern"])


CASES = [n[len("case_"):] for n in list(globals()) if n.startswith("case_")]
# expected exception class name per case (anything raised counts as clean; the name is printed)
PYTEST_CASES = {"pytest_diag_scan", "pytest_diag_backward", "pytest_after_stages"}


def print_loaded_libraries():
    """The C++ runtime / unwinder / CUDA runtime copies mapped in this process (two copies of libstdc++,
    libgcc_s or libcudart would be a candidate cause: an exception thrown through one, caught by another)."""
    keys = ("libstdc++", "libgcc_s", "libcudart", "libc10.so", "libtorch_python", "libtree_recurrence", "libunwind")
    seen = {}
    try:
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) >= 6 and any(k in parts[5] for k in keys):
                seen.setdefault(os.path.basename(parts[5]).split(".so")[0], set()).add(parts[5])
    except OSError:
        return
    for k, paths in sorted(seen.items()):
        flag = "  <-- MORE THAN ONE COPY" if len(paths) > 1 else ""
        print(f"loaded {k}: {', '.join(sorted(paths))}{flag}")


def child(name):
    fn = globals()["case_" + name]
    if name in PYTEST_CASES:
        fn()
        return
    try:
        fn()
        print("DIAG_RESULT no exception", flush=True)
        status = 2
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"DIAG_RESULT raised {type(e).__name__}: {msg[:300]}", flush=True)
        status = 0
    import torch

    if torch.cuda.is_available():
        torch.ones(8, device="cuda").sum().item()
        torch.cuda.synchronize()
    print("DIAG_RESULT healthy", flush=True)
    print_loaded_libraries()
    sys.stdout.flush()
    sys.exit(status)


def run_case(name, env_extra=None, gdb=False):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(env_extra or {})
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", name]
    if gdb:
        cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop noprint",
               "-ex", "run", "-ex", "thread apply all bt 30", "--args", *cmd]
    try:
        p = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=TIMEOUT_S, text=True, errors="replace")
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    lines = out.splitlines()
    results = [l[len("DIAG_RESULT "):] for l in lines if l.startswith("DIAG_RESULT ")]
    if rc is None:
        verdict = "TIMED OUT"
    elif rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        verdict = (f"crashed at exit ({sig}) after the exception was raised and the process was healthy"
                   if any(r.startswith("healthy") for r in results) else f"CRASHED ({sig})")
    elif rc == 0:
        verdict = "raised cleanly"
    elif rc == 2:
        verdict = "no exception (the case did not throw)"
    else:
        verdict = f"exit {rc}"
    return verdict, results, lines


def main(argv):
    if len(argv) >= 2 and argv[0] == "--child":
        child(argv[1])
        return 0
    names = argv or CASES
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {CASES}")
        return 2
    summary = []
    for name in names:
        verdict, results, lines = run_case(name)
        summary.append((name, verdict, results))
        print(f"\n=== {name}: {verdict}  {' | '.join(results)}")
        print("\n".join("    " + l for l in lines[-30:]))
        if verdict.startswith("CRASHED") or verdict.startswith("crashed"):
            v2, r2, l2 = run_case(name, {"TORCH_SHOW_CPP_STACKTRACES": "1"})
            print(f"--- {name} with TORCH_SHOW_CPP_STACKTRACES=1: {v2}  {' | '.join(r2)}")
            print("\n".join("    " + l for l in l2[-30:]))
            summary.append((name + " (TORCH_SHOW_CPP_STACKTRACES=1)", v2, r2))
            if shutil.which("gdb"):
                v3, r3, l3 = run_case(name, gdb=True)
                print(f"--- {name} under gdb: {v3}")
                print("\n".join("    " + l for l in l3[-80:]))
            else:
                print(f"--- {name}: no gdb on this machine")
    print("\n=== summary")
    for name, verdict, results in summary:
        print(f"{name:36s} {verdict}  {' | '.join(results)[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
