"""Deprecated: the old name of :mod:`tree_recurrence.stand_ins` (the library stand-ins), kept for one
release. ``bind_reference_kernels``, ``family_reference`` and ``reference_seam`` are now
``bind_stand_ins``, ``family_stand_ins`` and ``stand_in_seam``; every other name is the same."""

from __future__ import annotations

import warnings

from . import stand_ins

warnings.warn("tree_recurrence.reference is deprecated: use tree_recurrence.stand_ins (bind_reference_kernels -> "
              "bind_stand_ins, family_reference -> family_stand_ins, reference_seam -> stand_in_seam)",
              DeprecationWarning, stacklevel=2)

_RENAMED = {"bind_reference_kernels": "bind_stand_ins", "family_reference": "family_stand_ins",
            "reference_seam": "stand_in_seam"}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(stand_ins, _RENAMED.get(name, name))
