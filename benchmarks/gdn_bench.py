"""Benchmark of the Gated DeltaNet tree core (op ``gdn_tree_scan``) beside FLA, in one
process: forward and forward + backward of each case (CUDA events, median of up to --repeats timed runs
after --warmup untimed ones, fewer for slow cases; peak memory above the inputs per run).

Dims (Qwen3.5 / Qwen3-Next): HK 16, HV 32, dk = dv = 128, bf16 q, k, v, beta, fp32 log-decay g, l2norm of
q and k in the kernel, gradients of q, k, v, g, beta. GRPO shape: 8 prompts x 8 completions, prompt 2048,
completion 512 (49,152 unique tokens, 163,840 sample tokens). Cases (--cases picks by name or glob):
  tree              ours on the trie (8 roots, 64 children), as the model's seam calls the op
  flat              ours on one row of the 49,152 unique tokens (one segment)
  fla_fork          FLA forked level by level on the same trie, as the seed package runs trees: the 8
                    prompts as one varlen batch (output_final_state=True), then the 64 completions as a
                    varlen batch from their prompt's final state (initial_state (64, HV, K, V)); the
                    backward goes through both levels
  fla_chains        FLA on the 64 samples as varlen chains (cu_seqlens, batch 1): 163,840 tokens
  fla_flat          FLA on the flat row of 49,152 tokens (batch 1, no cu_seqlens)
  qla_fork, qla_chains, qla_flat
                    the same three with FLA handing the call to FlashQLA (flash-qla installed, FLA_FLASH_QLA
                    on: what FLA >= 0.5.2 does by default where flash_qla imports); the fla_* rows run with
                    FLA_FLASH_QLA=0 (FLA's Triton forward, its tilelang backward where tilelang imports)
  chains            ours on the 64 samples as chains (64 roots of 2,560: 163,840 tokens)
  forest            ours on the no-sharing forest: each sample a prompt root with its one completion
                    child (128 segments, nothing shared)
  flat_all          ours on one row of the 163,840 tokens (the chains without resets)
Every FLA row records the backends FLA's dispatch really ran (peers.FlaDispatch), per mode.
FLA takes the grouped heads as they are (GVA: q, k with HK heads). Its backward on Hopper needs tilelang or
Triton >= 3.7.1; when its guard refuses, the guard is bypassed for timing only and the FLA rows say
"proxy" (gradients wrong there, speed within 3% of the correct backward: shared/FACTS.md).

  python benchmarks/gdn_bench.py [--out benchmarks/results/gdn_bench.json] [--cases tree,fla_*]
                                 [--repeats 10] [--small] [--peers auto|on|off]
``--small``: tiny sizes, peers off (a CPU smoke run of the script; its numbers mean nothing). FLA
imports from the environment, else from the fallback folders peers.py lists (/tmp/peers among them).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from timing import (Runner, Shape, bench_arguments, bench_result, cu_seqlens, parse_bench_arguments, peak_ratio,  # noqa: E402
                    modes, peer_modes, peer_skipped, plan_of, print_table, ratio, save, target, tokens_per_ms)

from tree_recurrence import plugins  # noqa: E402

FAMILY = "gated_delta_net"
CHUNK = 64
NAMES = ("q", "k", "v", "g", "beta")


def inputs(T, HK, HV, K, V, dtype, device, seed=0):
    """Random inputs of T tokens: q, k (T, HK, K), v (T, HV, V) in dtype; g (T, HV) fp32 log decays with
    Qwen3.5's A = exp(A_log) range (1 to 16: strong decays); beta (T, HV) in (0, 1) in dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    A = torch.rand(HV, generator=g) * 15 + 1
    gate = -A * torch.nn.functional.softplus(r(T, HV) - 4.0)
    return dict(q=r(T, HK, K).to(device, dtype), k=r(T, HK, K).to(device, dtype), v=r(T, HV, V).to(device, dtype),
                g=gate.to(device, torch.float32), beta=torch.sigmoid(r(T, HV)).to(device, dtype))


def ours(layout, dims, dtype, device):
    lengths, parents = layout
    HK, HV, K, V = dims
    T = sum(lengths)
    tables = plan_of(lengths, parents, device).chunk_tables(CHUNK, device)
    ins = inputs(T, HK, HV, K, V, dtype, device)
    leaves = [ins[n].requires_grad_() for n in NAMES]
    w = torch.randn(T, HV, V, device=device, dtype=dtype)
    op = plugins.ops(FAMILY).gdn_tree_scan

    def run():
        return op(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], tables.gather, tables.scatter,
                  *tables.state_args(), None, 0.0, True)

    info = {"tokens": T, "segments": len(lengths), "chunks": int(tables.num_chunks), "impl": "ours (gdn_tree_scan)"}
    return info, modes(run, leaves, w)


class Fla:
    """FLA's chunk_gated_delta_rule on time-major (1, T, H, D) tensors, with FlashQLA allowed (``qla``) or
    not; ``proxy`` once its Hopper guard had to be bypassed (then every later FLA backward is the proxy
    too). ``dispatch`` (peers.FlaDispatch) records the backends that ran."""

    def __init__(self, fn, info, dispatch, qla=False):
        self.fn, self.info, self.dispatch, self.qla, self.proxy = fn, info, dispatch, qla, None
        self.label = f"FLA {info.get('fla')}" + (f" + FlashQLA {info.get('flash_qla')}" if qla else "")

    def call(self, ins, cu=None, h0=None, final=False):
        peers.set_flash_qla(self.qla)
        return self.fn(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], initial_state=h0, output_final_state=final,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=None if cu is None else cu.cpu())

    def guarded(self, fn):
        """fn (a forward + backward) run so that FLA's Hopper guard, if it refuses, is bypassed once (the
        proxy) and fn re-run from its forward."""
        def run():
            try:
                fn()
            except RuntimeError as e:
                if self.proxy is not None or not peers.is_fla_hopper_guard(e):
                    raise
                self.proxy = peers.bypass_fla_hopper_guard()
                self.info["backward"] = self.proxy
                print(f"FLA backward refused ({str(e).splitlines()[0][:120]}); timing proxy: {self.proxy}", flush=True)
                fn()
        return run

    def note(self):
        return {"proxy": self.proxy is not None, "note": "proxy: FLA's Hopper guard bypassed" if self.proxy else "",
                **self.dispatch.take()}

    def ran(self):
        return self.dispatch.take()

    def tensors(self, T, dims, dtype, device, seed):
        HK, HV, K, V = dims
        ins = {n: t.unsqueeze(0) for n, t in inputs(T, HK, HV, K, V, dtype, device, seed).items()}
        leaves = [ins[n].requires_grad_() for n in NAMES]
        return ins, leaves, torch.randn(1, T, HV, V, device=device, dtype=dtype)

    def rows(self, lengths, dims, dtype, device, varlen):
        """FLA on the sequences ``lengths`` in one row (varlen through cu_seqlens when ``varlen``)."""
        T = sum(lengths)
        ins, leaves, w = self.tensors(T, dims, dtype, device, 0)
        cu = cu_seqlens(lengths, device) if varlen else None

        m = peer_modes(lambda: self.call(ins, cu)[0], leaves, w)
        self.dispatch.take()
        info = {"tokens": T, "segments": len(lengths), "impl": self.label}
        return info, {"fwd": (m["fwd"], self.ran), "fwd_bwd": (self.guarded(m["fwd_bwd"]), self.note)}

    def fork(self, shape: Shape, dims, dtype, device):
        """FLA forked level by level on the GRPO trie: roots, then children from their parent's final state."""
        roots, children = [shape.prompt] * shape.prompts, [shape.completion] * shape.samples
        r_ins, r_leaves, r_w = self.tensors(sum(roots), dims, dtype, device, 0)
        c_ins, c_leaves, c_w = self.tensors(sum(children), dims, dtype, device, 1)
        r_cu, c_cu = cu_seqlens(roots, device), cu_seqlens(children, device)
        parent = torch.arange(shape.prompts, device=device).repeat_interleave(shape.per_prompt)

        def run():
            o_r, h_r = self.call(r_ins, r_cu, final=True)
            o_c, _ = self.call(c_ins, c_cu, h0=h_r.index_select(0, parent))
            return o_r, o_c

        m = peer_modes(run, r_leaves + c_leaves, (r_w, c_w))
        self.dispatch.take()
        info = {"tokens": sum(roots) + sum(children), "segments": len(roots) + len(children),
                "impl": f"{self.label}, 2 calls (one per trie level)"}
        return info, {"fwd": (m["fwd"], self.ran), "fwd_bwd": (self.guarded(m["fwd_bwd"]), self.note)}


def summarize(result):
    c = result["cases"]
    tok = lambda name, mode: tokens_per_ms(c, name, mode)  # noqa: E731
    pr = lambda a, b: peak_ratio(c, a, b)  # noqa: E731
    result["summary"] = {
        "tree / FLA+FlashQLA fork": target(ratio(c, "tree", "qla_fork"), 0.8, "<="),
        "flat / FLA+FlashQLA flat": target(ratio(c, "flat", "qla_flat"), 1.0, "<="),
        "chains / FLA+FlashQLA chains": target(ratio(c, "chains", "qla_chains"), 1.0, "<="),
        "peak: tree / FLA+FlashQLA fork": target(pr("tree", "qla_fork"), 1.0, "<="),
        "peak: flat / FLA+FlashQLA flat": target(pr("flat", "qla_flat"), 1.0, "<="),
        "peak: chains / FLA+FlashQLA chains": target(pr("chains", "qla_chains"), 1.0, "<="),
        "tree / FLA fork": target(ratio(c, "tree", "fla_fork"), 1.0, "<="),
        "tree / FLA chains": target(ratio(c, "tree", "fla_chains"), round(1 / 3, 3), "<="),
        "flat tokens/ms": target(tok("flat", "fwd_bwd"), 4000, ">="),
        "flat tokens/ms, forward": target(tok("flat", "fwd"), 14000, ">="),
        "tree / flat": target(ratio(c, "tree", "flat"), 1.05, "<="),
        "forest / chains": target(ratio(c, "forest", "chains"), 1.03, "<="),
        "chains / flat_all (resets' cost)": target(ratio(c, "chains", "flat_all"), 1.03, "<="),
        "peak: tree / FLA fork": target(pr("tree", "fla_fork"), 1.0, "<="),
        "peak: flat / FLA flat": target(pr("flat", "fla_flat"), 1.0, "<="),
        "FLA chains / tree (speed-up)": target(ratio(c, "fla_chains", "tree"), 3.0, ">="),
        "FLA flat tokens/ms": target(tok("fla_flat", "fwd_bwd"), None, ">="),
    }


def main():
    ap = bench_arguments(__doc__, "benchmarks/results/gdn_bench.json", 3, "time FLA (auto: on CUDA unless --small)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args, device, shape, use_peers = parse_bench_arguments(ap)
    dims = (2, 4, 16, 16) if args.small else (16, 32, 128, 128)
    dtype = getattr(torch, args.dtype)
    result = bench_result("GDN core (gdn_tree_scan) beside FLA", device, args, shape,
                          dict(zip(("HK", "HV", "dk", "dv"), dims)), chunk=CHUNK, l2norm_in_kernel=True)
    fla = qla = None
    if use_peers:
        fn, info = peers.fla_gdn()
        result["fla"] = info
        if fn is not None:
            dispatch = peers.FlaDispatch()
            fla = Fla(fn, info, dispatch)
            qla = Fla(fn, info, dispatch, qla=True) if info.get("flash_qla") else None
            if qla is None:
                result["flash_qla"] = {"skipped": "flash_qla does not import"}
    else:
        result["fla"] = peer_skipped(args)
    print("FLA:", result["fla"], flush=True)
    runner = Runner(result, args.out, args.cases, args.budget_s, device)
    L = shape.layouts()
    runner.run("tree", lambda: ours(L["trie"], dims, dtype, device))
    runner.run("flat", lambda: ours(L["flat"], dims, dtype, device))
    if qla is not None:
        runner.run("qla_fork", lambda: qla.fork(shape, dims, dtype, device))
        runner.run("qla_flat", lambda: qla.rows(L["flat"][0], dims, dtype, device, varlen=False))
        runner.run("qla_chains", lambda: qla.rows(L["chains"][0], dims, dtype, device, varlen=True))
    if fla is not None:
        runner.run("fla_fork", lambda: fla.fork(shape, dims, dtype, device))
        runner.run("fla_chains", lambda: fla.rows(L["chains"][0], dims, dtype, device, varlen=True))
        runner.run("fla_flat", lambda: fla.rows(L["flat"][0], dims, dtype, device, varlen=False))
    runner.run("chains", lambda: ours(L["chains"], dims, dtype, device))
    runner.run("forest", lambda: ours(L["forest"], dims, dtype, device))
    runner.run("flat_all", lambda: ours(L["flat_all"], dims, dtype, device))
    summarize(result)
    save(result, args.out)
    print_table(result)


if __name__ == "__main__":
    main()
