#!/usr/bin/env bash
# Device diagnosis of "a C++ error whose message formats a number crashes the process" (docs/kernels.md):
# (1) probes built here with this machine's g++ (benchmarks/gpu/abi_probe.cpp: plain ostream, c10's
# TORCH_CHECK; hidden and default visibility), loaded by ctypes into a python that imported torch;
# (2) the failing call (ssd_tree_scan on CPU with A misshaped) under segv_trace.so, with each native
# frame resolved by addr2line; (3) what our plugin library links and which GLIBCXX versions it needs.
# Run after the package build (kernels.sh part "abi"). Prints everything to stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=/tmp/abi; mkdir -p $W
gcc -shared -fPIC -O1 -o $W/segv.so benchmarks/gpu/segv_trace.c -ldl || echo "segv_trace: compile failed"
TI=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
TL=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
echo "g++: $(g++ --version | head -1); torch ABI $ABI; torch lib $TL"
for vis in hidden default; do
  for c10 in 0 1; do
    extra=(); [ $c10 = 1 ] && extra=(-DWITH_C10 $TI -L$TL -lc10 -Wl,-rpath,$TL)
    g++ -std=c++17 -O2 -shared -fPIC -fvisibility=$vis -fvisibility-inlines-hidden -D_GLIBCXX_USE_CXX11_ABI=$ABI \
      benchmarks/gpu/abi_probe.cpp "${extra[@]}" -o $W/probe_${vis}_$c10.so 2>$W/probe_${vis}_$c10.err \
      || { echo "probe $vis c10=$c10: compile failed"; tail -5 $W/probe_${vis}_$c10.err; continue; }
    for imp in notorch torch; do
      timeout 60 python3 - "$W/probe_${vis}_$c10.so" $c10 $imp <<'PY' 2>&1 | tail -3
import ctypes, sys
lib, c10, imp = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
if imp == "torch":
    import torch  # noqa: F401
L = ctypes.CDLL(lib)
buf = ctypes.create_string_buffer(256)
L.probe_ostream(5, buf, 256); r1 = buf.value.decode()
r2 = "-"
if c10:
    L.probe_c10(7, buf, 256); r2 = buf.value.decode()
print(f"probe {lib.split('/')[-1]} after {imp}: ostream '{r1}' c10 '{r2}'")
PY
      [ ${PIPESTATUS[0]} -ne 0 ] && echo "probe ${vis} c10=$c10 after $imp: exit ${PIPESTATUS[0]}"
    done
  done
done
echo "--- the failing call under segv_trace"
LD_PRELOAD=$W/segv.so timeout 120 python3 - >$W/crash.txt 2>&1 <<'PY'
import sys, torch
sys.path.insert(0, "tests/python")
import test_ssd_fused_gpu as T
seg, par = T.BENCH_TRIE
tabs = T.chunk_tables(seg, par, 64, "cpu")
n, H, P, G, N = seg[-1], 4, 32, 2, 16
ins = dict(x=torch.randn(n, H, P), dt=torch.randn(n, H), B=torch.randn(n, G, N), C=torch.randn(n, G, N),
           z=torch.randn(n, H, P), D=torch.rand(H), dt_bias=torch.zeros(H), A=torch.zeros(3))
try:
    T.bench_call(ins, tabs)
    print("no exception")
except Exception as e:
    print("raised", type(e).__name__, str(e)[:200])
PY
echo "exit $?"; grep -v "^SEGV_FRAME" $W/crash.txt | tail -8
grep "^SEGV_FRAME" $W/crash.txt | head -40 | while read -r _ lib off sym; do
  fn=$(addr2line -f -C -e "$lib" "$off" 2>/dev/null | head -1)
  echo "  $(basename "$lib") $off $sym -> ${fn:-?}"
done
echo "--- our plugin libraries"
for so in $(python3 -c "import tree_recurrence, pathlib; print(' '.join(str(p) for p in pathlib.Path(tree_recurrence.__file__).parent.rglob('*.so')))"); do
  echo "$so"; ldd "$so" | grep -E "stdc|gcc_s|c10|torch_cpu|yaml|boost" | sed 's/^/    /'
  echo "    GLIBCXX needed: $(objdump -T "$so" 2>/dev/null | grep -oE 'GLIBCXX_[0-9.]+' | sort -uV | tail -3 | tr '\n' ' ')"
  echo "    ostream / locale symbols the library defines itself (dynamic table): $(nm -D -C --defined-only "$so" 2>/dev/null | grep -cE 'num_put|ostream::_M_insert|locale::id')"
  nm -D -C --defined-only "$so" 2>/dev/null | grep -E " [tTwWvVuU] .*(num_put|_M_insert<|locale::id|ios_base::Init)" | head -8 | sed 's/^/      /'
done
