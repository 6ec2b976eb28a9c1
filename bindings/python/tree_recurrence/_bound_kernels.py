"""What a transformers seam is bound to: the kernel its hub wrapper picked (a library kernel or the
torch reference), the parameters that wrapper lets through, and whether it is a library kernel.
The driver reads it to decide a seam call's route (``driver.decide_route``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ._engine import ENGINE

_bound_cache: dict[int, tuple[Any, Any]] = ENGINE.bound_cache


def instance_forward(seam: Any) -> Any:
    """A hub seam's (nn.Module's) instance-level forward: kernelize swaps it on the object."""
    return seam.__dict__.get("forward") if isinstance(seam, torch.nn.Module) else None


def bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """Cached per seam object and its instance forward (seams are module globals, alive while bound; a
    kernel that kernelize puts on a hub seam's instance is read again)."""
    forward = instance_forward(seam)
    cached = _bound_cache.get(id(seam))
    if cached is not None and cached[0] is seam and cached[1] is forward:
        return cached[2]
    found = _find_bound_implementation(seam)
    _bound_cache[id(seam)] = (seam, forward, found)
    return found


def _hub_wrapper_inside(f: Any, depth: int = 4) -> Any:
    """transformers' use_kernel_func_from_hub_with_fallback wrapper (its closure holds
    ``implementation`` and ``applicable_params``) at ``f`` or inside it (``__wrapped__``, bound
    methods, closure cells: a profiler or spy around the seam), or None."""
    frontier, seen = [f], set()
    for _ in range(depth):
        following = []
        for item in frontier:
            if item is None or id(item) in seen or isinstance(item, type):
                continue
            seen.add(id(item))
            code, closure = getattr(item, "__code__", None), getattr(item, "__closure__", None)
            if code is not None and closure:
                cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
                if "implementation" in cells and "applicable_params" in cells:
                    return item
                following += list(cells.values())
            following += [getattr(item, "__wrapped__", None), getattr(item, "__func__", None)]
        frontier = following
    return None


def takes_keyword(f: Any, name: str) -> bool:
    """Whether ``f`` takes keyword ``name``: a parameter of that name, or ``**kwargs``."""
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _find_bound_implementation(seam: Any) -> tuple[Any, tuple, bool]:
    """(implementation, named parameters, is_library_kernel) of a transformers seam object.

    transformers wraps each seam with use_kernel_func_from_hub_with_fallback, which picks a
    library kernel (or the torch reference) at import and drops every keyword the pick does not
    name; with the `kernels` package the seam is an nn.Module around that wrapper.
    """
    f = seam
    if isinstance(f, torch.nn.Module):
        if instance_forward(f) is not None:  # kernelize put a kernel on the instance
            f = instance_forward(f)
        else:
            forward = type(f).forward
            cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__ or ())))
            f = cells.get("func", f)
    hub = _hub_wrapper_inside(f)
    if hub is not None:
        cells = dict(zip(hub.__code__.co_freevars, (c.cell_contents for c in hub.__closure__)))
        return cells["implementation"], tuple(cells["applicable_params"]), bool(cells.get("is_new_implementation"))
    try:
        params = tuple(inspect.signature(f).parameters)
    except (TypeError, ValueError):
        params = ()
    return f, params, True
