# Sourced by setup.sh, test.sh, demo.sh and dev-install.sh: sets PY, the interpreter this checkout uses.
#   PYTHON=/path/to/python  use that interpreter (and the environment it belongs to), as is;
#   otherwise               the project's own virtual environment in the checkout, created here
#                           when missing (nothing is installed outside the checkout): .venv, or
#                           the folder VENV_DIR names (CI uses a throw-away one).
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  command -v "$PY" >/dev/null 2>&1 || { echo "PYTHON=$PY: no such interpreter" >&2; exit 1; }
else
  venv="${VENV_DIR:-.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "== creating the project's virtual environment $venv (python3 -m venv; set PYTHON=... to use another interpreter)"
    python3 -m venv "$venv"
  fi
  PY="$(cd "$venv" && pwd)/bin/python"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The compiler cache stays inside the checkout too (unless the user chose one).
export CCACHE_DIR="${CCACHE_DIR:-$PWD/build/ccache}"
