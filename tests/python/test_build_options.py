"""Which build compiles the C++ test suites: a user's package build (`pip install .`) compiles neither the
doctest suites nor the deliberately broken test plugins of tests/plugins (nothing of them is installed);
the developer build that the test command uses (scripts/dev-install.sh, run by scripts/setup.sh and so by
scripts/test.sh and .ci/run) compiles both into build/py, where `ctest --test-dir build/py` and the Python
tests find them.

The settings are read the way the build backend reads them (scikit-build-core's SettingsReader over
pyproject.toml and the -C config settings the script passes), so no build runs here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cmake_defines(config_settings: dict[str, str]) -> dict[str, str]:
    """The CMake defines scikit-build-core passes for a wheel build with these config settings."""
    reader = pytest.importorskip("scikit_build_core.settings.skbuild_read_settings")
    settings = reader.SettingsReader.from_file(REPO / "pyproject.toml", config_settings, state="wheel", env={})
    return dict(settings.settings.cmake.define)


def script_config_settings(script: str) -> dict[str, str]:
    """The ``-Ckey=value`` arguments of the pip command that builds the package in ``scripts/<script>`` (line
    continuations joined, shell variables with a default taken at their default)."""
    text = (REPO / "scripts" / script).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "pip install --no-build-isolation" in line
                and not line.lstrip().startswith("#"))
    line = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", line)
    settings = {}
    for word in shlex.split(line):
        if word.startswith("-C") and "=" in word:
            key, _, value = word[2:].partition("=")
            settings[key] = value
    return settings


def test_a_package_build_compiles_no_cpp_tests():
    assert cmake_defines({}).get("TREE_RECURRENCE_TESTS") == "OFF"
    readme = (REPO / "README.md").read_text()  # its CMake options say so
    assert "`-DTREE_RECURRENCE_TESTS=ON|OFF`" in readme and "OFF in a package build" in readme


def test_the_developer_build_compiles_the_cpp_tests():
    settings = script_config_settings("dev-install.sh")
    assert settings.get("cmake.define.TREE_RECURRENCE_TESTS") == "ON", settings
    assert cmake_defines(settings)["TREE_RECURRENCE_TESTS"] == "ON"
    # the test command builds through dev-install.sh and then runs the C++ suites of build/py
    assert "bash scripts/dev-install.sh" in (REPO / "scripts" / "setup.sh").read_text()
    test = (REPO / "scripts" / "test.sh").read_text()
    assert "bash scripts/setup.sh" in test and "ctest --test-dir build/py" in test
    assert "--no-tests=error" in test  # a build/py without the suites fails the test command, never passes empty


def test_the_gpu_build_compiles_no_cpp_tests_by_default():
    """No GPU script runs the C++ suites or loads the broken plugins (their test ops are switched on at run
    time, TREE_RECURRENCE_TEST_OPS=1): the GPU machine's build is a package build for sm_90a."""
    settings = script_config_settings("gpu-build.sh")
    assert settings.get("cmake.define.CMAKE_CUDA_ARCHITECTURES") == "90a", settings
    assert cmake_defines(settings)["TREE_RECURRENCE_TESTS"] == "OFF"


def test_the_cmake_option_guards_the_tests_folder():
    """TREE_RECURRENCE_TESTS is what adds tests/ (doctest suites, tests/plugins) to the build."""
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert re.search(r"if\(TREE_RECURRENCE_TESTS\)\s*\n\s*enable_testing\(\)\s*\n\s*add_subdirectory\(tests\)", cmake)
    assert "add_subdirectory(plugins)" in (REPO / "tests" / "CMakeLists.txt").read_text()
