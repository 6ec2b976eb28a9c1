"""The environment variables tree-recurrence reads, as declared once in C++ (sdk/include/tree_recurrence/sdk/settings.h).

``get(name)`` reads one at the time of the call (tests and scripts change them while a process runs) and
parses it with the core's parser, the one the C++ accessors use: a flag is a ``bool`` (1 / 0, true / false,
yes / no, on / off), a count an ``int``, a choice a ``str``, a path a ``str``, a path list or a list of
names a ``list`` of ``str``. An unset or empty variable has its default. A bad value raises ``ValueError``
naming the variable; a name that is not declared raises ``KeyError``. ``all_settings()`` lists every one
with its current value (``python -m tree_recurrence doctor`` prints them). This module is the one place
the Python package reads a TREE_RECURRENCE_* variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import _core


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # flag, count, choice, path, path list, names
    default: str  # the text an unset or empty variable stands for
    doc: str


def declared() -> list[Setting]:
    """Every setting, in the order settings.h declares them."""
    return [Setting(*row) for row in _core.settings()]


def names() -> list[str]:
    return [s.name for s in declared()]


def raw(name: str) -> str | None:
    """The variable's text, or None when unset or empty (then its default holds)."""
    _declaration(name)
    return os.environ.get(name) or None


def get(name: str) -> Any:
    """The variable's current value, typed; its default when unset or empty."""
    return _core.parse_setting(name, os.environ.get(name, ""))


def is_set(name: str) -> bool:
    return raw(name) is not None


def all_settings() -> list[dict[str, Any]]:
    """Each setting with its current value: name, kind, default, doc, set (bool), value (typed), and
    error (the parser's message, value None) for a value that does not parse."""
    out = []
    for s in declared():
        row: dict[str, Any] = {"name": s.name, "kind": s.kind, "default": s.default, "doc": s.doc,
                               "set": is_set(s.name), "text": raw(s.name), "value": None, "error": None}
        try:
            row["value"] = get(s.name)
        except ValueError as e:
            row["error"] = str(e)
        out.append(row)
    return out


def _declaration(name: str) -> Setting:
    for s in declared():
        if s.name == name:
            return s
    raise KeyError(f"{name} is not a tree-recurrence setting; the settings are {', '.join(names())}")
