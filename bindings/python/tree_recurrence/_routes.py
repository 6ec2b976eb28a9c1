"""Measured routes: ``auto`` never picks a route slower than another available one (issues 19 and 20,
item 6).

A family's manifest may hold ``routes:``, times measured per GPU name and shape class (docs/plugins.md,
section "routes"): for each class (``tree`` / ``flat`` / ``chains``, its unique tokens) the median
milliseconds of one core call, forward (``fwd``) and forward + backward (``fwd_bwd``), of the native
tree kernel and of forking / rescanning over the peer library the table names (``library``: FLA,
mamba-ssm). When the policy is ``auto`` and the backend ``auto``, a seam call whose native kernel is
available and whose bound kernel is that library's picks the fastest measured route among those it can
take (``choose``); the reason names the numbers and where they come from.

* A GPU table may name the peer's ``backend`` (FLA: ``triton``, its own kernels, or ``flash_qla``, which FLA
  >= 0.5.2 hands ``chunk_gated_delta_rule`` to whenever the ``flash_qla`` package imports): it decides only
  when the bound library would dispatch to that backend (``bound_backend``), so numbers measured on FLA's
  Triton kernels never route a call that FLA runs on FlashQLA; without a table for the bound backend the
  timed trial (or the policy's rule) decides.
* No peer library bound (transformers' torch fallback, another kernel): native, nothing to compare.
* A GPU the table does not name, a dtype or shape class it has no numbers for, the CPU: the policy's
  rule (``Policy.choose``), the reason says why the table did not decide.
* ``TREE_RECURRENCE_ROUTE_TRIAL=1``: where the table has no numbers, one timed trial per (family, seam,
  device, shape class, dtype, phase, token bucket) per process, cached (``trials``): every candidate
  route run once to warm up and once timed on the call's own inputs (copies; host syncs, once).
  Default: off on the CPU, on for CUDA devices (``=0`` turns it off everywhere).

``device_name(device)`` (torch.cuda's name, None off CUDA) and ``requirement_met`` are module globals
so that tests can stand in for a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Any, Callable, Mapping

import torch

from ._peer_libraries import bound_backend, bound_library, requirement_met

ROUTES = ("native", "fork", "rescan")
PEER_ROUTES = ("fork", "rescan")
SHAPES = ("tree", "flat", "chains")
PHASES = ("fwd", "fwd_bwd")
MAX_TOKEN_RATIO = 16.0  # a measured class further than this from the call's tokens does not decide
TRIAL_ENV = "TREE_RECURRENCE_ROUTE_TRIAL"
_TABLE_KEYS = ("library", "gpus")
_GPU_KEYS = ("gpu", "backend", "source", "dtypes", "dims", "backward_needs", "classes")
_CLASS_KEYS = ("shape", "tokens", "note") + ROUTES

trials: dict[tuple, tuple[str, dict]] = {}  # trial key -> (fastest strategy, {strategy: ms or error})


class RoutesError(ValueError):
    """A manifest's ``routes:`` that does not parse: the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Measured:
    shape: str
    tokens: int
    times: Mapping[str, Mapping[str, float]]  # route -> phase -> ms
    note: str = ""


@dataclasses.dataclass(frozen=True)
class GpuTable:
    gpu: str
    backend: str  # the peer library's backend the numbers were measured on ("": the library's only one)
    source: str
    dtypes: tuple[str, ...]
    dims: str
    backward_needs: tuple[str, ...]  # any one of these makes the peer's backward usable ("" list: always)
    classes: tuple[Measured, ...]


@dataclasses.dataclass(frozen=True)
class Table:
    library: str
    gpus: tuple[GpuTable, ...]

    def for_gpu(self, name: str, backend: str = "") -> GpuTable | None:
        """The table measured on GPU ``name`` with the peer on ``backend`` (a table naming no backend serves
        any; ``backend`` "": the first table of that GPU)."""
        return next((g for g in self.gpus if g.gpu == name and (not g.backend or not backend or g.backend == backend)),
                    None)


def parse(source: str, value: Any) -> Table | None:
    """A manifest's ``routes:`` (None when absent), or RoutesError naming ``source`` and the key."""
    if value is None:
        return None

    def fail(key: str, problem: str):
        raise RoutesError(f"{source}: routes: {key}: {problem}")

    def mapping(where: str, item, keys, what: str):
        if not isinstance(item, Mapping):
            fail(where, "expected a mapping")
        unknown = sorted(str(k) for k in item if k not in keys)
        if unknown:
            fail(f"{where}.{unknown[0]}", f"not a key of {what} (its keys: {list(keys)})")

    if not isinstance(value, Mapping):
        fail("routes", f"expected a mapping with keys {list(_TABLE_KEYS)}, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _TABLE_KEYS)
    if unknown:
        fail(unknown[0], f"not a key of routes (its keys: {list(_TABLE_KEYS)})")
    library = value.get("library")
    if not isinstance(library, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", library):
        fail("library", f"expected the peer library's top-level package name, got {library!r}")
    gpus = value.get("gpus")
    if not isinstance(gpus, list):
        fail("gpus", f"expected a list of per-GPU tables, got {gpus!r}")
    parsed = []
    for i, gpu in enumerate(gpus):
        where = f"gpus[{i}]"
        mapping(where, gpu, _GPU_KEYS, "a GPU table")
        name = gpu.get("gpu")
        if not isinstance(name, str) or not name:
            fail(f"{where}.gpu", f"expected the GPU's name as torch.cuda.get_device_name() gives it, got {name!r}")
        backend = gpu.get("backend", "")
        if not isinstance(backend, str) or (backend and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", backend)):
            fail(f"{where}.backend", f"expected the peer backend's name (e.g. triton, flash_qla), got {backend!r}")
        strings = {}
        for key in ("dtypes", "backward_needs"):
            items = gpu.get(key, [])
            if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
                fail(f"{where}.{key}", f"expected a list of names, got {items!r}")
            strings[key] = tuple(items)
        for need in strings["backward_needs"]:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*(>=[0-9][0-9A-Za-z.]*)?", need):
                fail(f"{where}.backward_needs", f"'{need}' is not 'module' or 'package>=version'")
        classes = gpu.get("classes")
        if not isinstance(classes, list) or not classes:
            fail(f"{where}.classes", f"expected a non-empty list of shape classes, got {classes!r}")
        measured = []
        for j, entry in enumerate(classes):
            at = f"{where}.classes[{j}]"
            mapping(at, entry, _CLASS_KEYS, "a shape class")
            shape, tokens = entry.get("shape"), entry.get("tokens")
            if shape not in SHAPES:
                fail(f"{at}.shape", f"expected one of {list(SHAPES)}, got {shape!r}")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                fail(f"{at}.tokens", f"expected a positive int (the row's unique tokens), got {tokens!r}")
            times = {}
            for route in ROUTES:
                phases = entry.get(route)
                if phases is None:
                    continue
                if not isinstance(phases, Mapping) or any(p not in PHASES for p in phases):
                    fail(f"{at}.{route}", f"expected {{fwd: ms, fwd_bwd: ms}}, got {phases!r}")
                bad = [p for p, ms in phases.items() if ms is not None and (isinstance(ms, bool) or
                       not isinstance(ms, (int, float)) or not ms > 0 or math.isinf(ms))]
                if bad:
                    fail(f"{at}.{route}.{bad[0]}", f"expected positive milliseconds or null, got {phases[bad[0]]!r}")
                times[route] = {p: float(ms) for p, ms in phases.items() if ms is not None}
            if "native" not in times:
                fail(f"{at}.native", "missing: a class compares the native kernel against the peer's routes")
            measured.append(Measured(shape, tokens, times, str(entry.get("note", ""))))
        parsed.append(GpuTable(name, backend, str(gpu.get("source", "")), strings["dtypes"], str(gpu.get("dims", "")),
                               strings["backward_needs"], tuple(measured)))
    return Table(library, tuple(parsed))


_PARSED: dict[int, tuple[Any, Table | None]] = {}  # id(routes mapping) -> (that mapping, its parsed table)


def family_table(record: Any) -> Table | None:
    """The routes table of a loaded family's record (its manifest's ``routes:``), parsed (load checked it).
    Parsed once per routes mapping (kept with the mapping itself, so a replaced table is parsed anew):
    route decisions run once per plan, i.e. every forward."""
    routes = (record.manifest if record is not None else {}).get("routes")
    if routes is None:
        return None
    hit = _PARSED.get(id(routes))
    if hit is not None and hit[0] is routes:
        return hit[1]
    table = parse(str(record.manifest_path or "?"), routes)
    _PARSED[id(routes)] = (routes, table)
    return table


# --------------------------------------------------------------------------------------------
# what a call is
# --------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str | None:
    """The GPU's name (torch.cuda.get_device_name), None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


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


# --------------------------------------------------------------------------------------------
# the choice
# --------------------------------------------------------------------------------------------


def _fmt(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def choose(table: Table | None, gpu: str | None, shape: str, tokens: int, dtype: str, phase_name: str,
           available: Mapping[str, bool], family: str = "", backend: str = "") -> tuple[str | None, str]:
    """(strategy, reason) from the table, or (None, why the table does not decide).

    ``available``: route -> whether this call can take it (native: the kernel is there; fork / rescan:
    the bound kernel is the table's library and can do it, its backward usable when ``phase_name`` is
    ``fwd_bwd``)."""
    what = f"{family}: " if family else ""
    if table is None:
        return None, f"{what}no measured routes in the manifest"
    if gpu is None:
        return None, f"{what}not on a GPU: measured routes are per GPU name"
    entry = table.for_gpu(gpu, backend)
    if entry is None:
        known = ", ".join(g.gpu + (f" ({table.library} on {g.backend})" if g.backend else "") for g in table.gpus) or "none"
        on = f" with {table.library} on {backend}" if backend else ""
        return None, f"{what}no measured routes for GPU '{gpu}'{on} (measured: {known})"
    if entry.dtypes and dtype not in entry.dtypes:
        return None, f"{what}routes on {gpu} measured for {'/'.join(entry.dtypes)}, not {dtype}"
    candidates = [m for m in entry.classes if m.shape == shape]
    if not candidates:
        return None, f"{what}no {shape} class measured on {gpu}"
    best = min(candidates, key=lambda m: abs(math.log(tokens / m.tokens)) if tokens > 0 else 0.0)
    ratio = max(tokens, 1) / best.tokens
    if not 1.0 / MAX_TOKEN_RATIO <= ratio <= MAX_TOKEN_RATIO:
        return None, (f"{what}the nearest {shape} class on {gpu} has {best.tokens} tokens, more than "
                      f"{MAX_TOKEN_RATIO:g}x from this call's {tokens}")
    times = {r: best.times[r][phase_name] for r in ROUTES if r in best.times and phase_name in best.times[r]}
    if "native" not in times:
        return None, f"{what}native not measured for {phase_name} on {gpu} ({shape}, {best.tokens} tokens)"
    usable = {r: ms for r, ms in times.items() if available.get(r)}
    if "native" not in usable:
        return None, f"{what}native kernel not available here"
    pick = min(usable, key=lambda r: (usable[r], ROUTES.index(r)))  # ties: native first
    ranking = " < ".join(f"{r} {_fmt(usable[r])}" for r in sorted(usable, key=lambda r: (usable[r], ROUTES.index(r))))
    left = [f"{r} {_fmt(ms)} (not available)" for r, ms in times.items() if r not in usable]
    peer = f", {table.library} on {entry.backend}" if entry.backend else ""
    reason = (f"{what}measured on {gpu} ({shape}, {best.tokens} tokens, {phase_name}, {dtype}{peer}): {ranking}"
              + (f"; {', '.join(left)}" if left else "") + (f" [{entry.source}]" if entry.source else ""))
    return pick, reason


def peer_available(table: Table | None, gpu: str | None, implementation: Any, is_library: bool,
                   phase_name: str) -> tuple[bool, str]:
    """Whether the bound kernel is the table's peer library with a usable backward, and why not."""
    if table is None:
        return False, "no measured routes"
    library = bound_library(implementation) if is_library else ""
    if library != table.library:
        bound = library or "transformers' torch fallback"
        return False, f"bound kernel is {bound}, not {table.library}: native"
    entry = table.for_gpu(gpu, bound_backend(table.library)) if gpu else None
    needs = entry.backward_needs if entry else ()
    if phase_name == "fwd_bwd" and needs and not any(requirement_met(n) for n in needs):
        return False, f"{table.library}'s backward on {gpu} needs one of {list(needs)}: none installed"
    return True, ""


def decide(family: str, record: Any, plan, device: torch.device, dtype: torch.dtype,
           implementation: Any, is_library: bool, peers: Mapping[str, bool],
           trial: Callable[[str], float] | None = None, seam: str = "") -> tuple[str | None, str]:
    """(strategy, reason) for a call whose native kernel is available and whose policy and backend are
    ``auto``; (None, why) when neither the table nor a trial decides (the caller applies the rule).

    ``peers``: fork / rescan -> whether the call could take it over its bound kernel. ``trial(route)``
    runs one route on the call's inputs and returns its milliseconds (or raises)."""
    try:
        table = family_table(record)
    except RoutesError as error:
        return None, str(error)
    gpu = device_name(device)
    phase_name = phase()
    ok, why = peer_available(table, gpu, implementation, is_library, phase_name)
    if table is not None and not ok:
        return "native", f"{family}: {why}"
    available = {"native": True, **{r: ok and bool(peers.get(r)) for r in PEER_ROUTES}}
    shape, dname = shape_class(plan), dtype_name(dtype)
    backend = bound_backend(table.library) if table is not None else ""
    strategy, reason = choose(table, gpu, shape, plan.num_tokens, dname, phase_name, available, family, backend)
    if strategy is not None or trial is None or not _trial_enabled(device):
        return strategy, reason
    if table is None:  # a trial compares against a peer: only with a table naming the library
        return None, reason
    key = (family, seam, str(device), shape, dname, phase_name, max(plan.num_tokens, 1).bit_length(), backend)
    if key not in trials:
        times: dict[str, Any] = {}
        for route in ROUTES:
            if not available.get(route):
                continue
            try:
                times[route] = float(trial(route))
            except Exception as error:  # noqa: BLE001 -- a route that fails its trial is not taken
                times[route] = f"failed: {type(error).__name__}: {str(error)[:200]}"
        measured = {r: ms for r, ms in times.items() if isinstance(ms, float)}
        if "native" not in measured:
            trials[key] = (None, times)
        else:
            trials[key] = (min(measured, key=lambda r: (measured[r], ROUTES.index(r))), times)
    pick, times = trials[key]
    shown = ", ".join(f"{r} {_fmt(v)}" if isinstance(v, float) else f"{r} {v}" for r, v in times.items())
    if pick is None:
        return None, f"{reason}; the timed trial failed natively ({shown})"
    return pick, f"{family}: timed trial on {gpu or device} ({shape}, {plan.num_tokens} tokens, {phase_name}, {dname}): {shown}"


def _trial_enabled(device: torch.device) -> bool:
    value = os.environ.get(TRIAL_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return device.type == "cuda"


def time_route(run: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Milliseconds of one ``run()`` (forward, and backward when its output needs grad), after one warm-up run."""

    def once() -> None:
        out = run()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward(torch.ones_like(out))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    once()
    sync()
    start = time.perf_counter()
    once()
    sync()
    return (time.perf_counter() - start) * 1000.0


def report(record: Any, device_gpu: str | None, dtype: str = "bfloat16") -> list[dict]:
    """For doctor: per measured shape class, the route ``auto`` takes on ``device_gpu`` (forward + backward
    and forward) with a peer library bound whose backward works, and why; or why the table does not decide."""
    family = record.name
    try:
        table = family_table(record)
    except RoutesError as error:
        return [{"family": family, "route": None, "reason": str(error)}]
    if table is None:
        return [{"family": family, "route": None, "reason": "no measured routes in the manifest: the policy's rule"}]
    backend = bound_backend(table.library)
    entry = table.for_gpu(device_gpu, backend) if device_gpu else None
    if entry is None:
        _, reason = choose(table, device_gpu, "tree", 1, dtype, "fwd_bwd", {"native": True}, family, backend)
        return [{"family": family, "route": None, "reason": reason + ": the policy's rule (native when available)"}]
    rows = []
    backward = not entry.backward_needs or any(requirement_met(n) for n in entry.backward_needs)
    installed = importlib.util.find_spec(table.library) is not None
    for m in entry.classes:
        for phase_name in PHASES:
            peer = installed and (backward or phase_name == "fwd")
            available = {"native": True, "fork": peer, "rescan": peer}
            route, reason = choose(table, device_gpu, m.shape, m.tokens, dtype, phase_name, available, family, backend)
            rows.append({"family": family, "shape": m.shape, "tokens": m.tokens, "phase": phase_name,
                         "library": table.library, "backend": backend, "library_installed": installed,
                         "backward_usable": backward,
                         "route": route, "reason": reason})
    return rows
