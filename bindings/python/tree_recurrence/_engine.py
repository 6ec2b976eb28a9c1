"""The engine's process-wide state, in one object: ``ENGINE``, an ``Engine`` with one field per piece of
state that changes at run time. Each module reads and writes its part here (modules that name a container
under their own name hold this same object, never a copy), so one place shows, and ``reset`` clears, all
of it. This module sits at the bottom layer and imports nothing of the package.

Containers are reset in place (cleared, never replaced), so every name bound to one stays valid."""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

DECISIONS_KEPT = 256  # the driver's last (family, seam, strategy, reason) decisions kept for inspection
# Tables the modules fill once, on import (register_backend, the route verifiers, the seams' hooks): a plain
# reset() keeps them.
REGISTRATIONS = ("verifiers", "on_unpatch", "release_hooks", "backends", "handoff_backends", "handoff_actions",
                 "fallbacks", "owns", "notes")


def _tune_records() -> dict[str, Any]:
    return {"stamp": None, "records": [], "problem": None}


@dataclass(eq=False)
class Engine:
    """Every piece of the engine's process-wide mutable state."""

    # plan memos: parsed seam-spec mappings (id -> mapping, a deep copy, its spec), plans of tree fields
    # given as int sequences (id of tree_cu_seqlens_q -> entry, newest last), what a layer class's forward reaches
    mapping_specs: dict = field(default_factory=dict)
    sequence_plans: dict = field(default_factory=dict)
    reach_cache: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # driver: its recent decisions, and the families already warned that they run on reference code
    decisions: collections.deque = field(default_factory=lambda: collections.deque(maxlen=DECISIONS_KEPT))
    warned_reference: set = field(default_factory=set)
    # bound kernels: id(function) -> (function, what binding it found); stand-ins wrapped as libraries
    bound_cache: dict = field(default_factory=dict)
    wrapped_stand_ins: dict = field(default_factory=dict)
    # routes: the tune records read from disk (stamp of the file, its records, why it could not be read)
    tune_records: dict = field(default_factory=_tune_records)
    # routes: route name -> its verifier (registered on import)
    verifiers: dict = field(default_factory=dict)
    # seams: patched modules (name -> owner), wrappers stepped aside for a foreign one, what runs when a
    # module is unpatched, ids of installed models collected since the last sweep and who forgets them,
    # and how deep the holder of the seams lock is in locked() blocks
    owners: dict = field(default_factory=dict)
    stepped_aside: dict = field(default_factory=dict)
    on_unpatch: list = field(default_factory=list)
    collected: list = field(default_factory=list)
    release_hooks: list = field(default_factory=list)
    lock_depth: int = 0
    # install: installed models (id -> support, weak reference), their forward pre-hooks, and whether the
    # use_cache notice was given
    installed: dict = field(default_factory=dict)
    installed_refs: dict = field(default_factory=dict)
    guards: dict = field(default_factory=dict)
    cache_hooks: dict = field(default_factory=dict)
    told_use_cache: bool = False
    # backends: name -> availability check, hand-off backends and their actions, fallbacks, how a library
    # tells that it patched a module first / is told that this package did, and modules handed off
    backends: dict = field(default_factory=dict)
    handoff_backends: set = field(default_factory=set)
    handoff_actions: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)
    owns: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    handoffs: dict = field(default_factory=dict)
    # the shared op library: "error" -> None once loaded, the reason when it could not be
    shared_ops: dict = field(default_factory=dict)
    # attention: flex_attention compiled once, on first use
    compiled_flex: Any = None
    # FLOPs integration: model shapes by id of the config/model, models loaded by id of their config
    flops_shapes: dict = field(default_factory=dict)
    flops_models_by_config: dict = field(default_factory=dict)

    def reset(self, *names: str) -> None:
        """Puts the named pieces back to their start, containers in place; with no name, every piece but the
        registrations (``REGISTRATIONS``: filled once, on import). For tests, with no model installed:
        resetting ``owners`` leaves patched modules patched."""
        known = [f.name for f in fields(self)]
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"Engine.reset: no such state {unknown}")
        fresh = Engine()
        for name in names or [n for n in known if n not in REGISTRATIONS]:
            now, start = getattr(self, name), getattr(fresh, name)
            if hasattr(now, "clear"):
                now.clear()
                if hasattr(start, "items"):
                    now.update(start)
            else:
                setattr(self, name, start)


ENGINE = Engine()
