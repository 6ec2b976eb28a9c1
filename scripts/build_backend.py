"""PEP 517 build backend of tree-recurrence: scikit-build-core, after one check.

The plugins are compiled against the very torch they will run with (the registry refuses any
other), so torch must be importable by the building interpreter. pip's default build isolation
builds in a throw-away environment without it: refuse that at once, in one line, instead of a
CMake traceback minutes later. (torch is not a build requirement on purpose: pip would put a
second, possibly different torch into that throw-away environment.)
"""

from scikit_build_core.build import *  # noqa: F401,F403  (every hook this file does not override)
from scikit_build_core import build as _skbuild

_MESSAGE = ("tree-recurrence must be built against the torch it will run with, which build isolation hides: "
            "install torch first, then run `pip install --no-build-isolation .`")


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(_MESSAGE) from None


def get_requires_for_build_wheel(config_settings=None):
    _require_torch()
    return _skbuild.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _require_torch()
    return _skbuild.get_requires_for_build_editable(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
