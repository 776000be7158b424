#!/usr/bin/env bash
# The GPU path, checked in one command on a machine with a CUDA GPU (docs/testing.md, "On a
# machine with a GPU"):
#
#   1. a Python whose torch sees a GPU: $PYTHON if set, else python3, python, python3.11 or
#      /opt/torch/.venv/bin/python3, the first that sees one. Where none does but nvidia-smi
#      lists a GPU, a fresh venv gets torch==$GPU_CHECK_TORCH (default 2.14.1, a CUDA build)
#      and .[test,hf] from the package index. No GPU at all: "no CUDA device: nothing
#      checked", exit 2, nothing else done.
#   2. nothing is installed into that Python: the checkout runs from PYTHONPATH; --wheels DIR
#      first installs the wheels in DIR into a folder of its own (offline; e.g. datasets for
#      examples/hf_finetune.py, which the GPU machines' image lacks);
#   3. pytest -m gpu: tests/test_gpu.py, the examples on CUDA among them, and NCCL in torch's
#      flight recorder (tests/runtime/liveness/test_flight.py);
#   4. benchmarks/collectives.py --device cuda: the helpers next to the raw torch collectives
#      on CUDA tensors, in the same run;
#   5. benchmarks/gpu_host.py: per helper, the host syncs and how long a call holds the host
#      with 40 ms of kernels queued, the kit's and accelerate's; a launch-bound step proxy;
#      a big gather's peak memory; flight-recorder NCCL entries; NCCL at 1 rank and the kit's
#      accelerator branches at 2 and 3 ranks (cpu:gloo,cuda:gloo);
#   6. a summary: the GPU, torch, the test counts, each example, both benchmarks' tables.
#
# usage: scripts/gpu_check.sh [--wheels DIR] [-- PYTEST_ARGS...]
#   GPU_CHECK_DIR=dir keeps the logs (default $TMPDIR/axolotl_dist_gpu_check);
#   GPU_CHECK_WORKERS=N pytest-xdist workers (default 4).
# Exit: 0 every gpu test passed and the benchmark ran; 1 something failed; 2 no CUDA device.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${GPU_CHECK_DIR:-${TMPDIR:-/tmp}/axolotl_dist_gpu_check}
WORKERS=${GPU_CHECK_WORKERS:-4}
FLOOR=$(sed -n 's/^ *torch>=\([0-9.]*\).*/\1/p' "$REPO/setup.cfg" | head -n 1)
wheels=""
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=${2:?--wheels needs a directory}; shift 2 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# Counted through NVML (torch.cuda.device_count): CUDA is not initialized by the question.
SEES_GPU='import sys, torch; sys.exit(0 if torch.cuda.device_count() > 0 else 1)'

find_python() {
  local py
  for py in ${PYTHON:-} python3 python python3.11 /opt/torch/.venv/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "$SEES_GPU" >/dev/null 2>&1; then
      command -v "$py"
      return 0
    fi
  done
  return 1
}

gpu_listed() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "
}

start=$(date +%s)
mkdir -p "$WORK"
PY=$(find_python)
if [ -z "$PY" ]; then
  if ! gpu_listed; then
    echo "no CUDA device: nothing checked"
    exit 2
  fi
  torch_version=${GPU_CHECK_TORCH:-2.14.1}
  base=$(command -v python3.11 || command -v python3)
  echo "gpu_check: no Python here has a torch that sees the GPU: a venv with torch==$torch_version"
  rm -rf "$WORK/venv" && "$base" -m venv "$WORK/venv" || exit 1
  if ! "$WORK/venv/bin/pip" install -q "torch==$torch_version" -e "$REPO[test,hf]" \
      >"$WORK/install.log" 2>&1; then
    echo "gpu_check: FAILED to install torch==$torch_version (see $WORK/install.log):"
    tail -n 20 "$WORK/install.log"
    exit 1
  fi
  PY=$WORK/venv/bin/python
  if ! "$PY" -c "$SEES_GPU"; then
    echo "no CUDA device: nothing checked (torch==$torch_version sees none)"
    exit 2
  fi
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$wheels" ]; then
  rm -rf "$WORK/site"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
      "$wheels"/*.whl >"$WORK/wheels.log" 2>&1; then
    echo "gpu_check: FAILED to install the wheels in $wheels (see $WORK/wheels.log):"
    tail -n 20 "$WORK/wheels.log"
    exit 1
  fi
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "gpu_check: $PY has no pytest (pass --wheels DIR with it)"
  exit 1
fi
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n "$WORKERS")

cd "$REPO" || exit 1
"$PY" - >"$WORK/about.txt" 2>&1 <<'EOF'
import platform, torch
cuda = torch.cuda
try:
    nccl = ".".join(map(str, cuda.nccl.version()))
except Exception as exc:  # noqa: BLE001 - a build without NCCL
    nccl = f"none ({type(exc).__name__})"
try:
    names = [cuda.get_device_name(i) for i in range(cuda.device_count())]
except Exception as exc:  # noqa: BLE001 - reported, the tests say more
    names = [f"unreadable ({type(exc).__name__}: {exc})"]
print(f"GPU: {', '.join(names)} ({len(names)} visible); CUDA {torch.version.cuda}, NCCL {nccl}")
print(f"torch {torch.__version__}, Python {platform.python_version()}")
EOF
echo "gpu_check: running pytest -m gpu (log: $WORK/pytest.log)"
t0=$(date +%s)
"$PY" -m pytest -m gpu -p no:cacheprovider -q -rfEs "${xdist[@]}" --junitxml "$WORK/gpu.xml" \
  "${pytest_args[@]}" tests/test_gpu.py tests/runtime/liveness/test_flight.py \
  >"$WORK/pytest.log" 2>&1
pytest_rc=$?
pytest_s=$(( $(date +%s) - t0 ))
echo "gpu_check: running benchmarks/collectives.py --device cuda (log: $WORK/bench.log)"
t0=$(date +%s)
timeout 240 "$PY" benchmarks/collectives.py --device cuda --iters 200 >"$WORK/bench.log" 2>&1
bench_rc=$?
bench_s=$(( $(date +%s) - t0 ))
echo "gpu_check: running benchmarks/gpu_host.py (log: $WORK/host.log)"
t0=$(date +%s)
timeout 240 "$PY" benchmarks/gpu_host.py >"$WORK/host.log" 2>&1
host_rc=$?
host_s=$(( $(date +%s) - t0 ))

"$PY" - "$WORK" "$pytest_rc" "$pytest_s" "$bench_rc" "$bench_s" "$FLOOR" "$host_rc" "$host_s" <<'EOF'
import sys, xml.etree.ElementTree as ET
from pathlib import Path

work, pytest_rc, pytest_s, bench_rc, bench_s, floor, host_rc, host_s = sys.argv[1:]
work = Path(work)
print("\n== axolotl_dist GPU check ==")
about = (work / "about.txt").read_text().strip()
print(about)
import torch
version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if version < tuple(int(p) for p in floor.split(".")[:2]):
    print(f"note: torch {torch.__version__} is below the floor setup.cfg declares ({floor}): "
          "what needs the floor skips, saying so")
cases = {"passed": [], "failed": [], "skipped": []}
try:
    root = ET.parse(work / "gpu.xml").getroot()
except (OSError, ET.ParseError):
    root = None
for case in ([] if root is None else root.iter("testcase")):
    name, secs = case.get("name", "?"), float(case.get("time", 0))
    if case.find("failure") is not None or case.find("error") is not None:
        cases["failed"].append((name, secs, ""))
    elif case.find("skipped") is not None:
        cases["skipped"].append((name, secs, case.find("skipped").get("message", "")))
    else:
        cases["passed"].append((name, secs, ""))
total = sum(len(v) for v in cases.values())
print(f"gpu tests: {len(cases['passed'])} passed, {len(cases['failed'])} failed, "
      f"{len(cases['skipped'])} skipped of {total} (pytest -m gpu, {pytest_s} s, exit {pytest_rc})")
for name, _, _ in cases["failed"]:
    print(f"  FAILED {name}")
reasons = {}
for name, _, why in cases["skipped"]:
    reasons.setdefault(why, []).append(name)
for why, names in sorted(reasons.items()):
    shown = ", ".join(sorted(names)) if len(names) <= 4 else f"{len(names)} tests"
    print(f"  skipped ({why}): {shown}")
print("examples on CUDA:")
for outcome in ("passed", "failed", "skipped"):
    for name, secs, _ in cases[outcome]:
        if name.startswith("test_example_"):
            print(f"  {outcome:7} {name} ({secs:.1f} s)")
print(f"benchmark (benchmarks/collectives.py --device cuda, {bench_s} s, exit {bench_rc}):")
bench = (work / "bench.log").read_text(errors="replace").splitlines()
table = [line for line in bench if line.startswith(("|", "## "))]
print("\n".join("  " + line for line in (table or bench[-15:])))
print(f"host cost (benchmarks/gpu_host.py, {host_s} s, exit {host_rc}):")
host = (work / "host.log").read_text(errors="replace").splitlines()
table = [line for line in host if line.startswith("|")]
print("\n".join("  " + line for line in (table or host[-15:])))
# nothing failed, and tests ran (a run where everything skipped proves nothing)
ok = pytest_rc == "0" and bench_rc == "0" and host_rc == "0" and cases["passed"] \
    and not cases["failed"]
print(f"result: {'PASS' if ok else 'FAIL'} (logs in {work})")
if not ok and pytest_rc != "0":
    log = (work / "pytest.log").read_text(errors="replace").splitlines()
    print("--- the end of pytest's log:\n" + "\n".join(log[-60:]))
sys.exit(0 if ok else 1)
EOF
rc=$?
echo "gpu_check: $(( $(date +%s) - start )) s in all"
exit "$rc"
