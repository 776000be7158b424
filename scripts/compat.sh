#!/usr/bin/env bash
# The kit in the installs users have, each in a fresh venv, one venv per torch version:
#
#   1. torch==VERSION alone (PyPI's build: for Linux the CUDA build, which must run on a
#      machine without a GPU), then the README's install line (<!-- install-command -->,
#      no extras, so no NumPy): it must keep that torch;
#   2. scripts/core_check.py on 2 ranks under axolotl-dist and under bare env vars (rank 0
#      hosts the store): the core helpers, gloo chosen, no NumPy warning;
#   3. a wheel built from the checkout, installed over it: core_check again from outside the
#      checkout, and two examples under axolotl-dist;
#   4. the test suite on that torch (--quick: the core modules below, the exit path of a
#      script that never calls cleanup_distributed() and the harness's forks; default: all of
#      tests/; tests needing an extra skip themselves).
#
# usage: scripts/compat.sh [--quick] [--python X.Y[.Z]] [TORCH_VERSION ...]
#   default versions: the newest torch installable here and the floor setup.cfg declares.
#   --python X.Y[.Z] runs the legs on that Python: pyenv's build of it (`pyenv versions`), else
#   pythonX.Y on PATH; torch then comes from PyPI (this machine's wheels are for 3.11). The
#   Pythons the kit supports and their legs: docs/testing.md, "Pythons".
#   PYTHON=path picks the interpreter otherwise (default python3.11, else python3);
#   COMPAT_DIR=dir keeps the venvs (default $TMPDIR/axolotl_dist_compat); a venv whose torch
#   is already VERSION is reused, the package is always reinstalled.
#   COMPAT_WORKERS=n: pytest-xdist workers for step 4 (default 4: at 2 a leg's tests left a
#   third of two cores idle, waiting on launches).
# Prints one summary line per version; exits non-zero at the first failing step, with its log.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
NEWEST=2.14.1  # the newest torch this machine's package index offers (a CUDA build)
FLOOR=$(sed -n 's/^ *torch>=\([0-9.]*\).*/\1/p' "$REPO/setup.cfg" | head -n 1)
QUICK_TESTS=(tests/test_installs.py tests/test_queries.py tests/test_init.py tests/test_values.py
             tests/test_collectives.py tests/test_ordering.py tests/test_zero_only.py
             tests/test_errors.py tests/test_pythons.py tests/test_default_install.py
             tests/test_launch.py::test_a_rank_that_exits_early_with_code_0_is_reported_first
             tests/test_launch.py::test_version_and_help_say_what_the_cli_has)

quick=0
want_python=
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --python) want_python=${2:?compat.sh: --python needs a version, e.g. 3.12.1}; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) echo "compat.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
[ ${#versions[@]} -eq 0 ] && versions=("$NEWEST" "$FLOOR")

find_python() {  # find_python X.Y[.Z]: pyenv's build of that Python, else pythonX.Y on PATH
  local want=$1 root found
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  found=$(ls -d "$root/versions/$want"* 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$found" ] && [ -x "$found/bin/python" ]; then echo "$found/bin/python"; return; fi
  command -v "python${want%.*}" 2>/dev/null || command -v "python$want" 2>/dev/null || {
    echo "compat.sh: no Python $want here (pyenv versions; python$want on PATH)" >&2; exit 2; }
}

if [ -n "$want_python" ]; then PYTHON=$(find_python "$want_python"); fi
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
WORK=${COMPAT_DIR:-${TMPDIR:-/tmp}/axolotl_dist_compat}
INSTALL=$(awk '/<!-- install-command -->/{f=1; next} f && /^```/{if (s) exit; s=1; next} f && s' \
  "$REPO/README.md")
if [ -z "$INSTALL" ]; then
  echo "compat.sh: no install line after <!-- install-command --> in README.md" >&2
  exit 2
fi
mkdir -p "$WORK"
summary=()

fail() {  # fail STEP LOG...: say what failed, show the logs, stop
  echo "compat.sh: FAILED: $1" >&2
  shift
  for log in "$@"; do echo "--- $log" >&2; tail -n 60 "$log" >&2; done
  exit 1
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

core_check() {  # core_check VENV LOGDIR LABEL: under axolotl-dist, then bare env vars
  local venv=$1 logs=$2 label=$3 log port r
  log="$logs/$label-launcher.log"
  (cd "$logs" && PATH="$venv/bin:$PATH" timeout 180 axolotl-dist -n 2 "$REPO/scripts/core_check.py") \
    >"$log" 2>&1 || fail "$label: core_check under axolotl-dist -n 2" "$log"
  [ "$(grep -cE '^(\[rank [01]\] )?core check passed' "$log")" -eq 2 ] || fail "$label: not every rank passed" "$log"
  ! grep -q NumPy "$log" || fail "$label: a NumPy warning was printed" "$log"
  # core_check ends without cleanup_distributed(): the exit hook's path, on this Python
  ! grep -qE 'Traceback|Exception ignored' "$log" || fail "$label: a traceback at exit" "$log"
  port=$(free_port)
  local pids=()
  for r in 0 1; do
    (cd "$logs" && MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \
      LOCAL_WORLD_SIZE=2 timeout 180 "$venv/bin/python" "$REPO/scripts/core_check.py") \
      >"$logs/$label-env$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do
    wait "${pids[$r]}" || fail "$label: core_check rank $r under bare env vars" "$logs/$label-env$r.log"
    ! grep -q NumPy "$logs/$label-env$r.log" || fail "$label: NumPy warning" "$logs/$label-env$r.log"
    ! grep -qE 'Traceback|Exception ignored' "$logs/$label-env$r.log" \
      || fail "$label: a traceback at exit (rank $r, bare env vars)" "$logs/$label-env$r.log"
  done
}

for version in "${versions[@]}"; do
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  venv="$WORK/py$pyver-torch$version"
  logs="$WORK/logs-py$pyver-torch$version"
  rm -rf "$logs"; mkdir -p "$logs"
  echo "compat.sh: torch $version on python $pyver in $venv"
  if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" \
      >/dev/null 2>&1; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$version" >"$logs/torch.log" 2>&1 \
      || fail "pip install torch==$version" "$logs/torch.log"
  fi
  "$venv/bin/pip" uninstall -y -q axolotl-dist >/dev/null 2>&1 || true
  for extra in pytest pytest-xdist pytest-timeout; do  # a previous run's test tools
    "$venv/bin/pip" uninstall -y -q "$extra" >/dev/null 2>&1 || true
  done
  before=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)

  # 1. the README's install line, as a user types it in the clone
  (cd "$REPO" && PATH="$venv/bin:$PATH" bash -c "$INSTALL") >"$logs/install.log" 2>&1 \
    || fail "the README's install line: $INSTALL" "$logs/install.log"
  after=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  [ "$before" = "$after" ] || fail "the install line replaced torch $before with $after" "$logs/install.log"
  numpy=$("$venv/bin/python" -c 'import importlib.util as u; print("with" if u.find_spec("numpy") else "without")')

  # 2. the core helpers on 2 ranks
  core_check "$venv" "$logs" editable

  # 3. a wheel, installed over the editable install; run from outside the checkout
  rm -rf "$logs/wheel"
  "$venv/bin/pip" wheel -q --no-deps -w "$logs/wheel" "$REPO" >"$logs/wheel.log" 2>&1 \
    || fail "building a wheel" "$logs/wheel.log"
  "$venv/bin/pip" install -q --no-deps --force-reinstall "$logs/wheel/"*.whl >>"$logs/wheel.log" 2>&1 \
    || fail "installing the wheel" "$logs/wheel.log"
  where=$(cd "$logs" && "$venv/bin/python" -c 'import axolotl_dist; print(axolotl_dist.__file__)')
  case "$where" in */site-packages/*) ;; *) fail "the wheel is not what imports: $where" ;; esac
  core_check "$venv" "$logs" wheel
  for example in quickstart.py preprocess_dataset.py; do
    (cd "$logs" && PATH="$venv/bin:$PATH" timeout 180 axolotl-dist -n 2 "$REPO/examples/$example") \
      >"$logs/example-$example.log" 2>&1 || fail "examples/$example from the wheel" "$logs/example-$example.log"
    ! grep -q NumPy "$logs/example-$example.log" || fail "NumPy warning" "$logs/example-$example.log"
  done

  # 4. the tests, on this torch (they import the checkout: setup.cfg's pythonpath)
  "$venv/bin/pip" install -q pytest pytest-xdist pytest-timeout >"$logs/pytest-install.log" 2>&1 \
    || fail "installing pytest" "$logs/pytest-install.log"
  if [ "$quick" -eq 1 ]; then tests=("${QUICK_TESTS[@]}"); else tests=(tests); fi
  start=$(date +%s)
  (cd "$REPO" && "$venv/bin/python" -m pytest -n "${COMPAT_WORKERS:-4}" -q -p no:cacheprovider "${tests[@]}") \
    >"$logs/pytest.log" 2>&1 || fail "pytest ${tests[*]} on torch $after" "$logs/pytest.log"
  counts=$(tail -n 1 "$logs/pytest.log" | sed 's/=//g; s/^ *//; s/ in [0-9.]*s.*//')
  summary+=("torch $after, python $pyver, $numpy numpy: install line kept torch; core_check 2 ranks \
(axolotl-dist, bare env) editable and wheel ok; examples ok; pytest ${tests[*]}: $counts in $(( $(date +%s) - start )) s")
done

echo "compat.sh: summary"
for line in "${summary[@]}"; do echo "  $line"; done
