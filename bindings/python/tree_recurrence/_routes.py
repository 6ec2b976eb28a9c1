"""The router: which route a seam call takes when policy and backend are ``auto``.

Routes register here with a verifier (``register``): ``native`` (the family's tree kernel), ``fork``
(the bound kernel once per trie level) and ``rescan`` (the bound kernel over every path); under backend
``stand_ins`` the bound kernel is the family's stand-in, over which fork and rescan run alike. A
verifier answers, from what the call is (``Facts``: device, dtype, shape class, phase, the bound
kernel), None when the route can run the call, else why not.

The routes that can run are ordered by measured cost where ``python -m tree_recurrence tune`` left a
measurement for this call (``tune.py``): same device name, torch, tree-recurrence version, bound kernel
(package, version, backend), family, seam, shape class, dtype and phase, at the measured token count
nearest the call's (within ``MAX_TOKEN_RATIO``). Without one, the family's default order holds: the
policy's rule (``Policy.choose``: native where it runs, else fork when it saves enough, else rescan).
Nothing is timed inside a call.

Measurements live in one JSON file in the user's cache folder (``record_path``); it is parsed once per
process and again when its modification time or size changes. A file that does not parse is ignored
with a warning (``record_problem`` says why; ``doctor`` shows it). Manifests hold no timings: a
manifest with ``routes:`` is refused at load (``plugins.manifest_error``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ._peer_libraries import KernelId, backward_problem, bound_library, kernel_id
from ._engine import ENGINE

SCHEMA = 1
SHAPES = ("tree", "flat", "chains")
PHASES = ("fwd", "fwd_bwd")
MAX_TOKEN_RATIO = 4.0  # a measurement further than this from the call's unique tokens does not decide
KEY_FIELDS = ("device", "torch", "tree_recurrence", "family", "seam", "shape", "dtype", "phase")


# --------------------------------------------------------------------------------------------
# what a call is, and which routes can run it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    family: str
    seam: str
    device: torch.device
    dtype: torch.dtype
    shape: str  # tree | flat | chains
    tokens: int  # the row's unique tokens
    phase: str  # fwd | fwd_bwd
    kernel: KernelId  # the bound kernel
    native: bool  # the family's native op runs on this device
    fork: bool  # the bound kernel can start sequences from given states (state arguments, varlen or neutral padding)


def device_name(device: torch.device) -> str:
    """The GPU's name (torch.cuda.get_device_name) on CUDA, else the device type ("cpu")."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def shape_class(plan) -> str:
    """``flat`` (one segment), ``chains`` (roots only, nothing shared) or ``tree``."""
    if plan.num_segments <= 1:
        return "flat"
    return "chains" if plan.num_levels <= 1 else "tree"


def phase() -> str:
    """``fwd_bwd`` under grad mode (training), else ``fwd``."""
    return "fwd_bwd" if torch.is_grad_enabled() else "fwd"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def call_facts(family: str, seam: str, plan, first: torch.Tensor, inputs: Mapping[str, Any], implementation: Any,
               native: bool, fork: bool) -> Facts:
    """A seam call's facts: device and dtype of its first sequence tensor ``first``, the bound kernel
    ``implementation`` as keyed (its package, version and the backend that package would run ``inputs`` on)."""
    dims = {name: int(t.shape[-1]) for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.dim()}
    kernel = kernel_id(bound_library(implementation), first.dtype, dims)
    return Facts(family, seam, first.device, first.dtype, shape_class(plan), plan.num_tokens, phase(), kernel,
                 native, fork)


VERIFIERS: dict[str, Callable[[Facts], str | None]] = ENGINE.verifiers


def register(name: str) -> Callable:
    """Registers ``verify(facts) -> None | why not`` as route ``name``'s verifier (registration order is
    the order ties are broken in)."""
    def add(verify: Callable[[Facts], str | None]):
        VERIFIERS[name] = verify
        return verify

    return add


def _peer_backward(f: Facts) -> str | None:
    if f.phase != "fwd_bwd":
        return None
    return backward_problem(f.kernel, f.device)


@register("native")
def _native(f: Facts) -> str | None:
    return None if f.native else f"no native {f.family} kernel for {f.device.type} in this build"


@register("fork")
def _fork(f: Facts) -> str | None:
    if not f.fork:
        return "the bound kernel cannot start sequences from given states (no varlen, no state-neutral padding)"
    return _peer_backward(f)


@register("rescan")
def _rescan(f: Facts) -> str | None:
    return _peer_backward(f)


def runnable(f: Facts) -> dict[str, str | None]:
    """Route -> None when it can run the call, else why not."""
    return {name: verify(f) for name, verify in VERIFIERS.items()}


# --------------------------------------------------------------------------------------------
# the measurement records
# --------------------------------------------------------------------------------------------


def record_path() -> Path:
    """$XDG_CACHE_HOME/tree_recurrence/routes.json (~/.cache when XDG_CACHE_HOME is unset or relative)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "tree_recurrence" / "routes.json"


_loaded: dict[str, Any] = ENGINE.tune_records


def _check(entry: Any) -> bool:
    if not isinstance(entry, Mapping) or not all(isinstance(entry.get(k), str) for k in KEY_FIELDS):
        return False
    kernel, ms, tokens = entry.get("kernel"), entry.get("ms"), entry.get("tokens")
    if not isinstance(kernel, Mapping) or not all(isinstance(kernel.get(k), str) for k in ("package", "version", "backend")):
        return False
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1 or not isinstance(ms, Mapping):
        return False
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v) for v in ms.values())


def parse_records(text: str) -> list[dict]:
    """The records of a routes file's text, or ValueError saying what is wrong."""
    data = json.loads(text)
    if not isinstance(data, Mapping) or data.get("schema") != SCHEMA or not isinstance(data.get("records"), list):
        raise ValueError(f"expected {{\"schema\": {SCHEMA}, \"records\": [...]}}")
    for i, entry in enumerate(data["records"]):
        if not _check(entry):
            raise ValueError(f"records[{i}] is not a measurement record")
    return list(data["records"])


def records() -> list[dict]:
    """The records of ``record_path()``: parsed once, again when the file changes; [] when there is none or it
    does not parse (then a warning, once per change, and ``record_problem()`` says why)."""
    path = record_path()
    try:
        info = path.stat()
    except OSError:
        _loaded.update(stamp=None, records=[], problem=None)
        return []
    stamp = (str(path), info.st_ino, info.st_mtime_ns, info.st_size)
    if _loaded["stamp"] != stamp:
        try:
            found, problem = parse_records(path.read_text()), None
        except (OSError, ValueError, UnicodeDecodeError) as error:
            found, problem = [], f"{path}: not a tune record ({type(error).__name__}: {str(error)[:200]}); ignored"
            warnings.warn(f"tree_recurrence: {problem}: routes take the default order (run "
                          "`python -m tree_recurrence tune` to write it again)", RuntimeWarning, stacklevel=2)
        _loaded.update(stamp=stamp, records=found, problem=problem)
    return _loaded["records"]


def record_problem() -> str | None:
    """Why the routes file was ignored, or None."""
    records()
    return _loaded["problem"]


def versions() -> tuple[str, str]:
    """(torch version, tree-recurrence version): part of every record's key."""
    package = sys.modules.get(__package__ or "tree_recurrence")  # imported whole by the time a call runs
    return torch.__version__, str(getattr(package, "__version__", ""))


def key_of(f: Facts) -> dict:
    torch_version, ours = versions()
    return {"device": device_name(f.device), "torch": torch_version, "tree_recurrence": ours, "family": f.family,
            "seam": f.seam, "shape": f.shape, "dtype": dtype_name(f.dtype), "phase": f.phase}


def find(f: Facts, found: list[dict] | None = None) -> dict | None:
    """The record for this call: its key and bound kernel, the token count nearest the call's (within
    ``MAX_TOKEN_RATIO``), or None."""
    key, kernel = key_of(f), f.kernel.as_dict()
    matching = [r for r in (records() if found is None else found)
                if all(r[k] == v for k, v in key.items()) and dict(r["kernel"]) == kernel]
    if not matching:
        return None
    tokens = max(f.tokens, 1)
    best = min(matching, key=lambda r: abs(math.log(tokens / r["tokens"])))
    return best if abs(math.log(tokens / best["tokens"])) <= math.log(MAX_TOKEN_RATIO) else None


def _fmt(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def no_record(f: Facts) -> str:
    return f"default order (no tune record for {device_name(f.device)}, {f.kernel.describe()})"


def decide(f: Facts, default: tuple[str, str], entry: dict | None = None) -> tuple[str, str]:
    """(route, reason): the fastest route that can run the call as measured by its record (``find``, or
    ``entry`` given), else ``default`` (the policy's rule), its reason saying why no measurement decided."""
    strategy, reason = default
    entry = entry if entry is not None else find(f)
    if entry is None:
        return strategy, f"{reason}; {no_record(f)}"
    can = runnable(f)
    order = list(VERIFIERS)
    usable = {r: float(ms) for r, ms in entry["ms"].items() if r in can and can[r] is None}
    if not usable:
        return strategy, f"{reason}; default order (the tune record measured no route this call can take)"
    ranked = sorted(usable, key=lambda r: (usable[r], order.index(r)))
    left = [f"{r} {_fmt(float(ms))} ({can[r] or 'not available'})" for r, ms in entry["ms"].items() if r not in usable]
    return ranked[0], (f"measured by tune on {entry['device']} ({entry['shape']}, {entry['tokens']} tokens, "
                       f"{entry['phase']}, {entry['dtype']}, {f.kernel.describe()}): "
                       + " < ".join(f"{r} {_fmt(usable[r])}" for r in ranked)
                       + (f"; {', '.join(left)}" if left else "") + f" [{record_path()}]")


def store(new: list[dict]) -> Path:
    """Adds ``new`` records to the routes file, replacing those of the same key, kernel and tokens (a file
    that does not parse is replaced). Written whole, then renamed: a reader never sees half a file."""
    path = record_path()
    try:
        kept = parse_records(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        kept = []

    def ident(r: Mapping) -> tuple:
        return tuple(r[k] for k in KEY_FIELDS) + (tuple(sorted(r["kernel"].items())), r["tokens"])

    replaced = {ident(r) for r in new}
    merged = [r for r in kept if ident(r) not in replaced] + list(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"schema": SCHEMA, "records": merged}, indent=1) + "\n")
    os.replace(partial, path)
    return path
