"""What the op benchmarks (gdn_bench.py, ssd_bench.py) share: the plan of a workload, the timing loop
(CUDA events, warm-up, median of the timed runs, peak memory above what was allocated before each run;
wall clock on the CPU, where only the script itself is checked), the case runner (one failing or
out-of-memory case records its error and the rest still run; a --cases filter; a time budget), the
GRPO trie's shapes, the command line and result header both scripts take, the summary's measures,
the table printed at the end, the device's name and JSON writing."""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import os
import platform
import statistics
import time

import torch

from tree_recurrence._tree_kwargs import tree_plan


def plan_of(lengths, parents, device):
    """The tree plan of segments of ``lengths`` whose parents are ``parents`` (-1: a root)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return tree_plan({"tree_cu_seqlens_q": cu.to(device),
                      "tree_segment_parents": torch.tensor(parents, dtype=torch.int32, device=device)})


def cu_seqlens(lengths, device, dtype=torch.long):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    return cu.to(device=device, dtype=dtype)


class Shape:
    """The GRPO shape: ``prompts`` prompts of ``prompt`` tokens, each with ``per_prompt``
    completions of ``completion`` tokens. Layouts (lengths, parents), segments in DFS pre-order:
      trie      prompts roots, each followed by its per_prompt children
      flat      one segment of the trie's unique tokens
      chains    every sample (prompt + completion) as its own root
      forest    the same samples as a no-sharing forest: each sample a root prompt segment with one
                child completion segment (the trie machinery at work, nothing shared)
      flat_all  one segment of all the samples' tokens (the chains without resets)"""

    def __init__(self, small: bool):
        self.prompt, self.completion, self.prompts, self.per_prompt = (64, 16, 2, 3) if small else (2048, 512, 8, 8)
        self.samples = self.prompts * self.per_prompt
        self.path = self.prompt + self.completion

    def trie(self):
        lengths, parents = [], []
        for _ in range(self.prompts):
            root = len(lengths)
            lengths.append(self.prompt)
            parents.append(-1)
            lengths += [self.completion] * self.per_prompt
            parents += [root] * self.per_prompt
        return lengths, parents

    def unique(self):
        return self.prompts * self.prompt + self.samples * self.completion

    def layouts(self):
        forest_l, forest_p = [], []
        for _ in range(self.samples):
            forest_p += [-1, len(forest_l)]
            forest_l += [self.prompt, self.completion]
        return {"trie": self.trie(), "flat": ([self.unique()], [-1]),
                "chains": ([self.path] * self.samples, [-1] * self.samples),
                "forest": (forest_l, forest_p), "flat_all": ([self.path * self.samples], [-1])}

    def describe(self):
        return (f"{self.prompts} prompts x {self.per_prompt} completions, prompt {self.prompt}, completion "
                f"{self.completion}: {self.unique()} unique tokens, {self.samples * self.path} sample tokens")


def time_it(fn, repeats, device, warmup=3, budget_s=None):
    """{median_ms, min_ms, runs, peak_gib, warmup_ms} of up to ``repeats`` calls of ``fn`` after ``warmup``
    untimed ones (the first of which compiles / autotunes). With ``budget_s``, fewer runs (at least 3)
    when ``repeats`` runs of the last warm-up's duration would take longer. peak_gib: the largest
    torch.cuda.max_memory_allocated() of a run above what was allocated just before it."""
    cuda = device.type == "cuda"
    last = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        last = time.perf_counter() - t0
    if budget_s is not None and last > 0:
        repeats = max(min(3, repeats), min(repeats, int(budget_s / last)))
    times, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times),
            "peak_gib": max(peaks) if peaks else None, "warmup_ms": last * 1e3}


def modes(run, leaves, weights):
    """The two timed modes of an op call ``run()``: {"fwd": forward under no_grad, "fwd_bwd": forward
    and the gradients of ``leaves`` against ``weights`` (cast once to the output's dtype, the op's
    choice: untimed after the warm-up)}."""
    def fwd():
        with torch.no_grad():
            run()

    cast = {}

    def fwd_bwd():
        out = run()
        if out.dtype not in cast:
            cast[out.dtype] = weights.to(out.dtype)
        torch.autograd.grad(out, leaves, cast[out.dtype])

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def peer_modes(run, leaves, weights):
    """The two timed modes of a peer library's call ``run()`` (an output or a tuple of them, ``weights``
    alike, already in the outputs' dtypes): {"fwd": under no_grad, "fwd_bwd": the gradients of ``leaves``}."""
    def fwd():
        with torch.no_grad():
            run()

    def fwd_bwd():
        torch.autograd.grad(run(), leaves, weights)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def median_ms(fn, repeats=10, warmup=3):
    """(median, min) milliseconds of ``fn()``: CUDA events when CUDA is there, else the wall clock (the
    other benchmark scripts' timer)."""
    r = time_it(fn, repeats, torch.device("cuda" if torch.cuda.is_available() else "cpu"), warmup)
    return r["median_ms"], r["min_ms"]


def error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def free(device):
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001, S110  (a lost context: Runner.check records it)
            pass


class Runner:
    """Runs the selected cases in order; each records its error (out of memory included) without
    stopping the others; after ``budget_s`` seconds of the whole run, the rest are recorded as skipped.
    The result is saved after every case, so a run cut short keeps what it measured."""

    def __init__(self, result, out, patterns, budget_s, device):
        self.result, self.out, self.budget_s, self.device = result, out, budget_s, device
        self.patterns = [p.strip() for p in patterns.split(",") if p.strip()] if patterns else []
        self.start = time.perf_counter()
        self.lost = None  # the case after which the CUDA context failed (a sticky error: the rest cannot run)
        result.setdefault("cases", {})

    def check(self, where):
        if self.device.type != "cuda" or self.lost:
            return
        try:
            torch.cuda.synchronize()
            torch.empty(1, device=self.device).add_(1).item()  # host sync on purpose: outside any timed run
        except Exception as e:  # noqa: BLE001
            self.lost = f"after {where}: {error_text(e)}"

    def wanted(self, name):
        return not self.patterns or any(fnmatch.fnmatchcase(name, p) or p == name for p in self.patterns)

    def run(self, name, setup):
        """``setup()`` returns (info dict, {mode: fn}); each mode is timed by time_it separately (a failing
        backward keeps the forward's numbers). A mode given as (fn, extra dict) adds extra to its entry."""
        if not self.wanted(name):
            return
        cases = self.result["cases"]
        elapsed = time.perf_counter() - self.start
        if elapsed > self.budget_s:
            cases[name] = {"skipped": f"time budget ({self.budget_s:.0f} s) spent after {elapsed:.0f} s"}
            print(f"{name:<22} skipped (time budget)", flush=True)
            return
        if self.lost:
            cases[name] = {"skipped": f"CUDA context lost in an earlier case: {self.lost}"}
            print(f"{name:<22} skipped (CUDA context lost)", flush=True)
            return
        entry = cases[name] = {}
        t0 = time.perf_counter()
        try:
            info, modes = setup()
            entry.update(info)
            for mode, fn in modes.items():
                extra = {}
                if isinstance(fn, tuple):
                    fn, extra = fn
                failed = False
                try:
                    entry[mode] = time_it(fn, self.result["repeats"], self.device, warmup=self.result["warmup"],
                                          budget_s=self.result["case_budget_s"])
                    entry[mode].update(extra() if callable(extra) else extra)
                    if entry.get("tokens"):
                        entry[mode]["tokens_per_ms"] = entry["tokens"] / entry[mode]["median_ms"]
                except Exception as e:  # noqa: BLE001  (out of memory and any kernel error: record, go on)
                    entry[mode] = {"error": error_text(e)}
                    failed = True
                if failed:  # outside the handler: the traceback's frames (and their tensors) are gone
                    self.check(f"{name} {mode}")
                    free(self.device)
                    if self.lost:
                        break
            del modes
        except Exception as e:  # noqa: BLE001
            entry["error"] = error_text(e)
        if "error" in entry:
            self.check(name)
        free(self.device)
        entry["case_s"] = time.perf_counter() - t0
        print(f"{name:<22} " + json.dumps(entry)[:400], flush=True)
        save(self.result, self.out)


def ms(entry, mode):
    m = entry.get(mode) if isinstance(entry, dict) else None
    return m.get("median_ms") if isinstance(m, dict) else None


def ratio(cases, a, b, mode="fwd_bwd"):
    x, y = ms(cases.get(a, {}), mode), ms(cases.get(b, {}), mode)
    return x / y if x is not None and y else None


def peak(cases, name, mode="fwd_bwd"):
    m = cases.get(name, {}).get(mode) if isinstance(cases.get(name), dict) else None
    return m.get("peak_gib") if isinstance(m, dict) else None


def tokens_per_ms(cases, name, mode="fwd_bwd"):
    m = cases.get(name, {}).get(mode) if isinstance(cases.get(name), dict) else None
    return cases[name]["tokens"] / m["median_ms"] if isinstance(m, dict) and "median_ms" in m else None


def peak_ratio(cases, a, b, mode="fwd_bwd"):
    x, y = peak(cases, a, mode), peak(cases, b, mode)
    return x / y if x is not None and y else None


def bench_arguments(doc, out, warmup, peer_help):
    """The options both op benchmarks take; the caller adds its own, then calls parse_bench_arguments."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--case-budget-s", type=float, default=3.0,
                    help="fewer timed runs (>= 3) when --repeats would take longer than this per mode")
    ap.add_argument("--budget-s", type=float, default=110.0, help="later cases are skipped after this many seconds")
    ap.add_argument("--cases", default="", help="comma-separated names or globs (default: all)")
    ap.add_argument("--peers", default="auto", choices=["auto", "on", "off"], help=peer_help)
    return ap


def parse_bench_arguments(ap):
    """(args, device, shape, use_peers); --small is a smoke run: each mode once after one warm-up."""
    args = ap.parse_args()
    if args.small:
        args.repeats, args.warmup, args.budget_s = min(args.repeats, 1), min(args.warmup, 1), max(args.budget_s, 900.0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_peers = args.peers == "on" or (args.peers == "auto" and device.type == "cuda" and not args.small)
    return args, device, Shape(args.small), use_peers


def bench_result(title, device, args, shape, dims, **fields):
    """The result's header: what ran, on what, how often."""
    return {"title": title, "device": device_name(device), "torch": torch.__version__, "dims": dims,
            "dtype": args.dtype, **fields, "shape": shape.describe(), "small": args.small, "repeats": args.repeats,
            "warmup": args.warmup, "case_budget_s": args.case_budget_s}


def peer_skipped(args) -> dict:
    return {"skipped": "--peers off" if args.peers == "off" else "--small or no CUDA"}


def target(value, bound, kind):
    """{value, target, met}: kind '<=' or '>='; met is None without a value."""
    met = None if value is None or bound is None else (value <= bound if kind == "<=" else value >= bound)
    return {"value": value, "target": f"{kind} {bound}" if bound is not None else None, "met": met}


def print_table(result):
    """One line per case (ms, tokens/ms, peak GiB for fwd and fwd_bwd), then the Targets' ratios."""
    def f(v, spec):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return format("-", f">{width}") if v is None else format(v, spec)

    print(f"\n{result.get('title', '')} on {result['device']} ({result['dtype']})")
    print(f"{'case':<22}{'tokens':>8} {'fwd ms':>9}{'tok/ms':>8}{'GiB':>6} {'f+b ms':>9}{'tok/ms':>8}{'GiB':>6}  note")
    for name, e in result["cases"].items():
        if "skipped" in e or ("error" in e and "fwd" not in e):
            print(f"{name:<22} {(e.get('skipped') or e.get('error'))[:90]}")
            continue
        cols = []
        for mode in ("fwd", "fwd_bwd"):
            m = e.get(mode, {})
            cols.append(f"{f(m.get('median_ms'), '9.2f')}{f(m.get('tokens_per_ms'), '8.0f')}"
                        f"{f(m.get('peak_gib'), '6.2f')}" if "error" not in m else f"{'error':>23}")
        errs = "; ".join(f"{mode}: {e[mode]['error'][:60]}" for mode in ("fwd", "fwd_bwd")
                         if isinstance(e.get(mode), dict) and "error" in e[mode])
        notes = [e.get("note", "")] + [e[m].get("note", "") for m in ("fwd", "fwd_bwd") if isinstance(e.get(m), dict)]
        note = " ".join(x for x in notes + [errs] if x)
        print(f"{name:<22}{e.get('tokens', 0):>8} {cols[0]} {cols[1]}  {note[:80]}")
    print("targets (forward + backward unless named):")
    for key, t in result.get("summary", {}).items():
        v = t.get("value")
        mark = {True: "met", False: "MISSED", None: "n/a"}[t.get("met")]
        print(f"  {key:<40} {f(v, '10.3f') if isinstance(v, float) else f(v, '10')}  {t.get('target') or '':<9} {mark}")


def device_name(device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"


def save(result, path):
    """Writes ``result`` as JSON to ``path`` (creating its folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
