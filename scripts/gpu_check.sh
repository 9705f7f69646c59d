#!/usr/bin/env bash
# make gpu-check: the CUDA copy engine on a real GPU, in one command, with one summary.
#
# Runs on the accelerator machine (no network; python3 with torch, numpy, pytest,
# pytest-timeout, hypothesis, xxhash, anyio...): installs this tree into that
# interpreter with --no-deps (plus the wheels `make gpu-wheels` put in .whl/, carried
# along: pytest-asyncio), then runs
#   1. the CUDA engine's tests (tests/test_copy_cuda*.py; the cuda-parametrised ones
#      run on the GPU, the simulated ones too) and the scripts' smoke tests, under
#      coverage where the interpreter has it (the real device's module is measured
#      only here);
#   2. benchmarks/gpu_copy.py: our engine per strategy against pinned cudaMemcpyAsync
#      and vLLM's CPUOffloadingWorker (where vLLM imports);
#   3. scripts/gpu_soak.py: a byte-exact soak of 3,000 random jobs;
# and prints one summary. Exit status 0 only if every part passed.
#
# Environment: PYTHON (default python3); GPU_CHECK_DEVICE=simulated runs the same
# steps on the simulated device (a dry run of this script where there is no GPU);
# GPU_CHECK_SOAK_JOBS (default 3000). The log and the benchmark's JSON go to $OUT
# when it is set (the device tool brings that folder back), else to /tmp/gpu-check.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SOAK_JOBS=${GPU_CHECK_SOAK_JOBS:-3000}
DEST=${OUT:-/tmp/gpu-check}
mkdir -p "$DEST"
LOG="$DEST/gpu-check.log"
: > "$LOG"
say() { printf '%s\n' "$*" | tee -a "$LOG"; }
START=$(date +%s)

if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  say "gpu-check: no CUDA device for $PY (torch.cuda.is_available() is False);"
  say "           GPU_CHECK_DEVICE=simulated runs the same steps on the simulated device"
  exit 2
fi

# -- install -------------------------------------------------------------------------
SITE=/tmp/kv-tiering-gpu-check-site
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl \
    >>"$LOG" 2>&1 || say "gpu-check: installing the carried wheels failed (see $LOG)"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
  INSTALL="installed with --no-deps"
else
  INSTALL="pip install failed (see the log); running from the tree on PYTHONPATH"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

ENV_LINE=$("$PY" - "$DEVICE" <<'EOF'
import subprocess, sys, torch
if sys.argv[1] != "cuda":
    print(f"simulated device (dry run), torch {torch.__version__}")
    raise SystemExit
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
except Exception:
    smi = "unknown"
print(f"{torch.cuda.get_device_name()}, driver {smi}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
)

# -- 1. tests ------------------------------------------------------------------------
say "== tests"
# Under coverage where the interpreter has it: CI's cuda-coverage leaves out the real
# device (torch_device.py), which only runs here, so this is where its lines are counted.
COV_RC="$DEST/coverage.rc"
RUNNER=(-m pytest)
if "$PY" -c "import coverage" 2>/dev/null; then
  printf '[run]\nsource = tiering/copy/cuda\ndata_file = %s\n' "$DEST/.coverage" > "$COV_RC"
  RUNNER=(-m coverage run --rcfile="$COV_RC" -m pytest)
fi
"$PY" "${RUNNER[@]}" -q -p no:cacheprovider -rs tests/test_copy_cuda.py tests/test_copy_cuda_faults.py \
  tests/test_copy_cuda_machine.py tests/test_copy_cuda_batch.py tests/test_gpu_check_scripts.py 2>&1 | tee -a "$LOG"
TEST_RC=${PIPESTATUS[0]}
TEST_LINE=$(grep -E ' in [0-9.]+s( \(.*\))?( =+)?$' "$LOG" | tail -1)
COV_LINE="not measured ($PY has no coverage module)"
if [ -f "$DEST/.coverage" ]; then
  cov_total() { "$PY" -m coverage report --rcfile="$COV_RC" --format=total "$@" 2>>"$LOG"; }
  DEVICE_COV=$(cov_total --include='*/torch_device.py') || DEVICE_COV="?"
  ENGINE_COV=$(cov_total) || ENGINE_COV="?"
  "$PY" -m coverage report --rcfile="$COV_RC" --show-missing >>"$LOG" 2>&1
  COV_LINE="torch_device.py ${DEVICE_COV}% on this device, tiering/copy/cuda/ ${ENGINE_COV}% (missing lines: the log)"
  rm -f "$DEST/.coverage" "$COV_RC"
fi

# -- 2. benchmark --------------------------------------------------------------------
say "== benchmark"
# The simulated device's figures mean nothing: a few reps check the script (minutes, not eight).
REPS=()
[ "$DEVICE" = simulated ] && REPS=(--reps 5)
"$PY" benchmarks/gpu_copy.py --device "$DEVICE" "${REPS[@]}" --json "$DEST/gpu_copy.json" 2>&1 | tee -a "$LOG"
BENCH_RC=${PIPESTATUS[0]}

# -- 3. soak -------------------------------------------------------------------------
say "== soak"
"$PY" scripts/gpu_soak.py --device "$DEVICE" --jobs "$SOAK_JOBS" 2>&1 | tee -a "$LOG"
SOAK_RC=${PIPESTATUS[0]}
SOAK_LINE=$(grep '^soak (' "$LOG" | tail -1)

# -- summary -------------------------------------------------------------------------
status() { [ "$1" -eq 0 ] && echo ok || echo "FAILED (exit $1)"; }
BELOW=$(grep -c '^verdict: .*BELOW' "$LOG" || true)
if [ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$SOAK_RC" -eq 0 ]; then
  VERDICT="PASS"
else
  VERDICT="FAIL"
fi
say ""
say "================ gpu-check summary ================"
say "device:     $ENV_LINE"
# The device tool copies the working tree beside a .git that may be older: name the commit,
# say whether the tree differs from it, and fingerprint the sources that ran (compare with
# the same line printed here by `make gpu-check-sources`).
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git status --porcelain 2>/dev/null | grep -q . && COMMIT="$COMMIT + changes"
say "date:       $(date -u +%Y-%m-%d) ($(( $(date +%s) - START )) s), commit $COMMIT"
say "sources:    $(bash scripts/gpu_check_sources.sh)"
say "install:    $INSTALL"
say "tests:      $(status "$TEST_RC"): ${TEST_LINE:-no summary line}"
say "coverage:   $COV_LINE"
say "benchmark:  $(status "$BENCH_RC"); targets missed: $BELOW"
VERDICTS=$(grep '^verdict: ' "$LOG" || true)
while IFS= read -r line; do [ -n "$line" ] && say "            $line"; done <<<"$VERDICTS"
say "soak:       $(status "$SOAK_RC"): ${SOAK_LINE:-no summary line}"
say "gpu-check:  $VERDICT (correctness: tests and soak; the benchmark's targets are reported, not gated)"
[ "$VERDICT" = PASS ]
