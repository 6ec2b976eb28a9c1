"""Policy: how tree scans run (native kernel, fork per level, or rescan every path).

Precedence, lowest first: built-in defaults < the YAML file named by TREE_RECURRENCE_POLICY_FILE
< a YAML file given to ``Policy.from_yaml`` < the variables TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS,
TREE_RECURRENCE_STRATEGY, TREE_RECURRENCE_PREFER_NATIVE < keyword arguments.
"""

from __future__ import annotations

import os

from . import _core, settings

STRATEGIES = ("auto", "native", "fork", "rescan")


def _environment_file_policy() -> _core.Policy:
    """The defaults, then the file TREE_RECURRENCE_POLICY_FILE names (if set)."""
    base = _core.Policy()
    env_file = settings.get("TREE_RECURRENCE_POLICY_FILE")
    return _core.Policy.from_yaml_file(env_file, base) if env_file else base


class Policy:
    """``Policy(fork_min_saved_tokens=1024, strategy="auto", prefer_native=True)``.

    ``strategy="auto"`` uses the family's native tree kernel when it has one for the device (and
    ``prefer_native``), else forks level by level when the prefix tokens saved reach
    ``fork_min_saved_tokens`` per extra kernel call, else rescans every root-to-leaf path.
    """

    def __init__(self, fork_min_saved_tokens: int | None = None, strategy: str | None = None,
                 prefer_native: bool | None = None, *, _base: _core.Policy | None = None):
        if _base is None:
            _base = _environment_file_policy()
        core = _core.Policy.from_environment_variables(_base)
        if fork_min_saved_tokens is not None:
            if isinstance(fork_min_saved_tokens, bool) or not isinstance(fork_min_saved_tokens, int) or fork_min_saved_tokens < 0:
                raise ValueError(f"fork_min_saved_tokens must be a non-negative int, got {fork_min_saved_tokens!r}")
            core.fork_min_saved_tokens = fork_min_saved_tokens
        if strategy is not None:
            core.strategy = strategy  # ValueError names the choices
        if prefer_native is not None:
            core.prefer_native = bool(prefer_native)
        self._core = core

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "Policy":
        return cls(**overrides, _base=_core.Policy.from_yaml_file(os.fspath(path), _environment_file_policy()))

    fork_min_saved_tokens = property(lambda self: self._core.fork_min_saved_tokens)
    strategy = property(lambda self: self._core.strategy)
    prefer_native = property(lambda self: self._core.prefer_native)

    def choose(self, plan, native_available: bool, fork_available: bool) -> tuple[str, str]:
        """(strategy, reason) for one seam call on ``plan``."""
        return self._core.choose(plan._core, native_available, fork_available)

    def __repr__(self) -> str:
        return repr(self._core)

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and (self.fork_min_saved_tokens, self.strategy, self.prefer_native) == (
            other.fork_min_saved_tokens, other.strategy, other.prefer_native)
