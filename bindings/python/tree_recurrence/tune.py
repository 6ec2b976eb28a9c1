"""``python -m tree_recurrence tune``: times every route a family's scan seam can take (native, fork and
rescan over the bound kernel) on the shapes given, and writes the medians to the router's record file
(``_routes.record_path()``, in the user's cache folder), keyed by the device's name, torch, this
package's version, the bound kernel (package, version, backend), family, seam, shape class, dtype and
phase. ``auto`` then takes the fastest route measured for a call like it (``_routes.decide``).

The bound kernel is what a model's seam calls (``--peer model``: the seam function of the family's
first modeling module that imports, a library kernel or transformers' PyTorch fallback), or the
family's library stand-in (``--peer stand_in``). Each route runs through the seam driver with the
policy forcing it (``components.tree_scan``), as a training step would run it.

The call is the family's manifest's ``tune:`` (its seam, tensors, dims and keywords: ``Inputs``): the
engine names no family. Shapes: the GRPO trie (``--prompts`` prompts of ``--prompt-len`` tokens, each with ``--completions``
completions of ``--completion-len``), its unique tokens as one flat row, and every sample as its own
chain. ``--tiny``: a small trie and small heads (tests, the CPU).

``route_report`` is what ``doctor`` prints: per family, the route ``auto`` takes on this machine for
its measured calls, or the default order when no record is there.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _routes, components, driver, plugins, stand_ins
from ._bound_kernels import bound_implementation
from ._peer_libraries import KernelId, bound_library, kernel_id
from ._tree_kwargs import tree_plan
from .policy import Policy


class TuneError(ValueError):
    """A manifest's ``tune:`` that does not describe a call: the message names the family and the key."""


@dataclass(frozen=True)
class Inputs:
    """A family's tuned call, from its manifest's ``tune:``: the seam, its tensors by name (shape over
    dim letters and ``n`` the tokens; fill; kept in fp32 or not), the dims (and ``--tiny``'s) and the
    constant keywords. ``make`` builds one call: (positional args in the seam's order, keywords)."""

    family: str
    seam: str
    names: tuple[str, ...]  # the seam's positional arguments
    tensors: dict
    dims: dict
    tiny: dict
    kwargs: dict

    @classmethod
    def of(cls, record: plugins.Family) -> "Inputs":
        value = record.manifest.get("tune")
        where = f"{record.manifest_path or record.name}: tune"
        if not isinstance(value, dict):
            raise TuneError(f"{where}: missing (the manifest names no call to tune)")
        seam = value.get("seam")
        if seam not in record.seams:
            raise TuneError(f"{where}.seam: {seam!r} is not a seam of the manifest")
        tensors, names = value.get("tensors") or {}, record.seams[seam].args
        missing = [n for n in names if n not in tensors]
        if missing:
            raise TuneError(f"{where}.tensors: the seam's arguments {missing} are missing")
        dims, tiny = value.get("dims") or {}, value.get("tiny") or value.get("dims") or {}
        for name, tensor in tensors.items():
            shape = tensor.get("shape") if isinstance(tensor, dict) else None
            if not isinstance(shape, list) or any(not (isinstance(d, int) or d == "n" or (d in dims and d in tiny))
                                                  for d in shape):
                raise TuneError(f"{where}.tensors.{name}: expected {{shape: [...]}} of ints, n and dims' letters")
            if tensor.get("fill", "normal") not in FILLS:
                raise TuneError(f"{where}.tensors.{name}.fill: expected one of {sorted(FILLS)}")
        return cls(record.name, seam, tuple(names), dict(tensors), dict(dims), dict(tiny), dict(value.get("kwargs") or {}))

    def make(self, n: int, tiny: bool, dtype: torch.dtype, device: torch.device,
             gen: torch.Generator) -> tuple[tuple, dict]:
        dims = {**(self.tiny if tiny else self.dims), "n": n}
        made = {}
        for name, tensor in self.tensors.items():
            shape = [d if isinstance(d, int) else int(dims[d]) for d in tensor["shape"]]
            made[name] = FILLS[tensor.get("fill", "normal")](shape, gen).to(device, torch.float32 if tensor.get("fp32")
                                                                              else dtype)
        positional = tuple(made.pop(name) for name in self.names)
        return positional, {**made, **self.kwargs}

    def describe(self, tiny: bool) -> str:
        return ", ".join(f"{k} {v}" for k, v in (self.tiny if tiny else self.dims).items())


FILLS: dict[str, Callable[[list, torch.Generator], torch.Tensor]] = {
    "normal": lambda shape, gen: torch.randn(shape, generator=gen),
    "unit": lambda shape, gen: torch.sigmoid(torch.randn(shape, generator=gen)),
    # decays as in Qwen3.5: A = exp(A_log) in 1..16 times a softplus: strong decays
    "log_decay": lambda shape, gen: -(torch.rand(shape, generator=gen) * 15 + 1)
    * torch.nn.functional.softplus(torch.randn(shape, generator=gen) - 4.0),
    "negative": lambda shape, gen: -torch.rand(shape, generator=gen) - 0.5,
}


def tunable() -> dict[str, Inputs | TuneError]:
    """Loaded families with a native scan: their tuned call, or why their manifest names none."""
    found: dict[str, Inputs | TuneError] = {}
    for name, record in plugins.families().items():
        if any(spec.native is not None for spec in record.seams.values()):
            try:
                found[name] = Inputs.of(record)
            except TuneError as error:
                found[name] = error
    return found


def layouts(prompts: int, completions: int, prompt: int, completion: int) -> dict[str, tuple[list, list]]:
    """Shape class -> (segment lengths, parents; -1 a root), segments in DFS pre-order."""
    trie_l, trie_p = [], []
    for _ in range(prompts):
        trie_p.append(-1)
        root = len(trie_l)
        trie_l.append(prompt)
        trie_l += [completion] * completions
        trie_p += [root] * completions
    samples = prompts * completions
    return {"tree": (trie_l, trie_p), "flat": ([sum(trie_l)], [-1]),
            "chains": ([prompt + completion] * samples, [-1] * samples)}


def _plan(lengths: list, parents: list, device: torch.device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return tree_plan({"tree_cu_seqlens_q": cu.to(device),
                      "tree_segment_parents": torch.tensor(parents, dtype=torch.int32, device=device)})


def bound_kernel(family: str, seam: str, peer: str) -> Any:
    """The kernel the routes run over: the seam function of the family's first modeling module that
    imports (``peer`` "model": what the model calls), or the family's library stand-in ("stand_in")."""
    if peer == "model":
        for model in plugins.families()[family].models:
            try:
                module = importlib.import_module(model["module"])
            except ImportError:
                continue
            if hasattr(module, seam):
                return getattr(module, seam)
    found = stand_ins.stand_in(family, seam)
    if found is None:
        raise LookupError(f"{family}: no modeling module with '{seam}' imports and the manifest names no stand-in")
    return found


def _time(run: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    def once() -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeats))


def tune_family(spec: Inputs, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                say: Callable[[str], None]) -> list[dict]:
    """The records of one family: per shape and phase, the median ms of every route that ran."""
    family = spec.family
    kernel = bound_kernel(family, spec.seam, args.peer)
    identity = _kernel(spec, bound_implementation(kernel)[0], args.tiny, dtype)
    say(f"{family}: {spec.seam} over {identity.describe()}, {spec.describe(args.tiny)}")
    torch_version, ours = _routes.versions()
    out = []
    for shape, (lengths, parents) in layouts(args.prompts, args.completions, args.prompt_len, args.completion_len).items():
        if shape not in args.shapes:
            continue
        plan = _plan(lengths, parents, device)
        gen = torch.Generator().manual_seed(0)
        positional, keywords = spec.make(plan.num_tokens, args.tiny, dtype, device, gen)
        leaves = [t.requires_grad_() for t in positional if t.is_floating_point()]
        for phase in args.phases:
            ms, failed = {}, {}
            for route in _routes.VERIFIERS:
                def call(route=route):
                    out = components.tree_scan(kernel, *positional, plan=plan, family=family, seam=spec.seam,
                                               policy=Policy(strategy=route), **keywords)
                    return out[0] if isinstance(out, tuple) else out

                def run(call=call):
                    if phase == "fwd":
                        with torch.no_grad():
                            call()
                    else:
                        y = call()
                        torch.autograd.grad(y, leaves, torch.ones_like(y), allow_unused=True)

                try:
                    driver.decisions.clear()
                    run()
                    taken = [d[2] for d in driver.decisions if d[0] == family]
                    if taken != [route]:
                        raise RuntimeError(f"the driver ran {taken or 'nothing'}")
                    ms[route] = _time(run, device, args.repeats, args.warmup)
                    shown = f"{ms[route]:.3f} ms"
                except Exception as error:  # noqa: BLE001 -- a route that cannot run this call is recorded so
                    failed[route] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
                    shown = f"not timed ({failed[route]})"
                say(f"  {family} {route:<6} {shape:<6} {plan.num_tokens:>7} tokens {phase:<7} {_routes.dtype_name(dtype)}: "
                    f"{shown}")
            if ms:
                out.append({"device": _routes.device_name(device), "torch": torch_version, "tree_recurrence": ours,
                            "kernel": identity.as_dict(), "family": family, "seam": spec.seam, "shape": shape,
                            "tokens": plan.num_tokens, "dtype": _routes.dtype_name(dtype), "phase": phase,
                            "dims": spec.describe(args.tiny), "ms": ms, "failed": failed})
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", nargs="+", default=None, help="families to tune (default: every loaded family "
                        "whose manifest names a call to tune)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--completions", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--completion-len", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="2 prompts x 3 completions of 64 + 16 tokens, small heads")
    parser.add_argument("--shapes", nargs="+", choices=_routes.SHAPES, default=list(_routes.SHAPES))
    parser.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bfloat16 on CUDA, "
                        "float32 on the CPU)")
    parser.add_argument("--phase", choices=("fwd", "fwd_bwd", "both"), default="both")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--peer", choices=("model", "stand_in"), default="model",
                        help="the bound kernel: what the family's modeling module calls, or the family's stand-in")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per route (median; default 10, tiny 3)")
    parser.add_argument("--warmup", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    if args.tiny:
        args.prompts, args.completions, args.prompt_len, args.completion_len = 2, 3, 64, 16
    args.repeats = args.repeats or (3 if args.tiny else 10)
    args.phases = ("fwd", "fwd_bwd") if args.phase == "both" else (args.phase,)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    found = tunable()
    ready = {name: spec for name, spec in found.items() if isinstance(spec, Inputs)}
    families = args.families or list(ready)
    unknown = [f for f in families if f not in ready]
    if unknown:
        why = "; ".join(str(found[f]) if f in found else f"{f}: no loaded family with a native scan" for f in unknown)
        print(f"tune: cannot tune {unknown}: {why} (tunable: {sorted(ready)})")
        return 2
    print(f"tune on {_routes.device_name(device)}, {_routes.dtype_name(dtype)}, "
          f"{args.prompts} prompts x {args.completions} completions, prompt {args.prompt_len}, completion "
          f"{args.completion_len}", flush=True)
    measured = []
    for family in families:
        measured += tune_family(ready[family], args, device, dtype, lambda line: print(line, flush=True))
    if not measured:
        print("tune: no route ran: nothing written")
        return 1
    path = _routes.store(measured)
    print(f"tune: {len(measured)} records written to {path}")
    return 0


# --------------------------------------------------------------------------------------------
# doctor's lines
# --------------------------------------------------------------------------------------------


def _kernel(spec: Inputs, implementation: Any, tiny: bool, dtype: torch.dtype) -> KernelId:
    """The bound kernel as the router keys a call of ``spec``'s inputs (the backend may depend on them)."""
    positional, _ = spec.make(1, tiny, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    dims_of = {n: int(t.shape[-1]) for n, t in zip(spec.names, positional) if t.dim()}
    return kernel_id(bound_library(implementation), dtype, dims_of)


def route_report(record: plugins.Family, gpu: str | None = None) -> list[dict]:
    """Per measured call of the family on this machine (``gpu``: as on the device of that name), the route
    ``auto`` takes and why; without a record, one row: the default order for the family's typical call
    (the GRPO trie, forward + backward, bf16 on CUDA, fp32 on the CPU)."""
    family = record.name
    try:
        spec = Inputs.of(record)
    except TuneError as error:
        return [{"family": family, "route": None, "reason": f"the policy's rule ({error})"}]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = gpu or _routes.device_name(device)
    native = any(record.has_kernel(v.native.op, device.type) for v in record.seams.values() if v.native is not None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        implementation = bound_implementation(bound_kernel(family, spec.seam, "model"))[0]
    except (LookupError, ImportError, ValueError) as error:
        return [{"family": family, "seam": spec.seam, "route": None, "reason": f"no bound kernel found: {error}"}]
    torch_version, ours = _routes.versions()
    rows = []
    for r in _routes.records():
        recorded = getattr(torch, r["dtype"], None)
        if (r["device"], r["family"], r["seam"], r["torch"], r["tree_recurrence"]) != \
                (name, family, spec.seam, torch_version, ours) or not isinstance(recorded, torch.dtype):
            continue
        kernel = _kernel(spec, implementation, False, recorded)  # the backend may depend on the dtype
        if dict(r["kernel"]) != kernel.as_dict():
            continue
        facts = _routes.Facts(family, spec.seam, device, recorded, r["shape"], r["tokens"], r["phase"], kernel, native, True)
        route, reason = _routes.decide(facts, ("native", "default order"), entry=r)
        rows.append({"family": family, "seam": spec.seam, "shape": r["shape"], "tokens": r["tokens"],
                     "phase": r["phase"], "dtype": r["dtype"], "kernel": kernel.describe(), "route": route,
                     "reason": reason})
    if not rows:
        kernel = _kernel(spec, implementation, False, dtype)
        rows.append({"family": family, "seam": spec.seam, "kernel": kernel.describe(),
                     "route": "native" if native else "fork or rescan (the policy's rule)",
                     "reason": f"default order (no tune record for {name}, {kernel.describe()})"})
    return rows
