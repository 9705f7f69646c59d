#!/usr/bin/env bash
# Build (or reuse) the CPU-only virtualenv in which vLLM 0.33.0's KV-offload tiering
# code imports and runs, plus what kv-tiering itself and its tests need. Prints the
# environment's python on stdout (logs go to stderr), so callers can do
#
#     PY=$(scripts/vllm_env.sh) && PYTHONPATH=. "$PY" -m pytest tests/vllm
#
# Layers, each skipped while unchanged:
#   1. base (~4 min fresh): torch==2.13.0 (CPU build) first, then the vLLM wheel with
#      --no-deps (its declared dependencies would pull a CUDA torch, triton, nvidia-*),
#      then the plain packages importing vLLM's kv_offload modules needs
#      (scripts/vllm-env/requirements.txt, locked by constraints.txt), xgrammar
#      --no-deps, and three empty shared objects named after the CUDA libraries that
#      vLLM's C file-I/O extension (vllm/fs_io_C) lists as NEEDED but never calls, so
#      vLLM's filesystem tier runs its C fast path as on a GPU machine. The directory
#      is keyed by a hash of this script and the pin files: changing a pin builds a
#      new environment next to the old one.
#   2. project (seconds): kv-tiering's runtime dependencies read from pyproject.toml
#      (plus the redis/uring extras) and the test tools, constrained by the same lock.
#      Re-run whenever pyproject.toml changes. kv-tiering itself is not installed:
#      callers put the repository on PYTHONPATH, so the code under test is the tree's.
#
# Environment:
#   KV_TIERING_VLLM_ENV         use exactly this directory for the environment
#   KV_TIERING_CACHE_DIR        parent of the keyed directories (default ~/.cache/kv-tiering)
#   PYTHON                      interpreter to create the venv from (default python3, 3.11)
# Exit status non-zero (with the failing step on stderr) if anything fails to build or
# import; a half-built environment is finished on the next run, never used as is.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
PINS="$HERE/vllm-env"
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.8
STUB_LIBS=(libc10_cuda.so libnvrtc.so.13 libtorch_cuda.so)

log() { printf '[vllm_env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

key=$(cat "${BASH_SOURCE[0]}" "$PINS/requirements.txt" "$PINS/constraints.txt" \
  | sha256sum | cut -c1-12)
if [ -n "${KV_TIERING_VLLM_ENV:-}" ]; then
  ENV_DIR=$KV_TIERING_VLLM_ENV
else
  ENV_DIR="${KV_TIERING_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-tiering}/vllm-$VLLM_VERSION-$key"
fi
mkdir -p "$(dirname "$ENV_DIR")"
PY="$ENV_DIR/bin/python"
BASE_STAMP="$ENV_DIR/.kv-tiering-base-$key"

# One builder at a time per environment (a test run and a benchmark may race).
exec 9>"$ENV_DIR.lock"
flock 9

pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@" >&2; }

if [ ! -f "$BASE_STAMP" ]; then
  log "building $ENV_DIR (about 4 minutes)"
  [ -x "$PY" ] || "$PYTHON" -m venv "$ENV_DIR" >&2 || die "cannot create venv with $PYTHON"

  log "1/5 torch==$TORCH_VERSION (CPU build)"
  pip_install "torch==$TORCH_VERSION" || die "torch install failed"
  "$PY" -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
    || die "a CUDA build of torch was installed; this environment must be CPU-only"

  log "2/5 vllm==$VLLM_VERSION --no-deps"
  pip_install --no-deps "vllm==$VLLM_VERSION" || die "vllm install failed"

  log "3/5 import-time dependencies (pinned)"
  pip_install -c "$PINS/constraints.txt" -r "$PINS/requirements.txt" \
    || die "dependency install failed"

  log "4/5 xgrammar==$XGRAMMAR_VERSION --no-deps (its torch/triton deps are not needed to import)"
  pip_install --no-deps "xgrammar==$XGRAMMAR_VERSION" || die "xgrammar install failed"

  log "5/5 CUDA-library stand-ins for vllm/fs_io_C"
  if command -v gcc >/dev/null 2>&1; then
    mkdir -p "$ENV_DIR/fsio_cuda_stubs"
    for lib in "${STUB_LIBS[@]}"; do
      gcc -shared -fPIC -Wl,-soname,"$lib" -o "$ENV_DIR/fsio_cuda_stubs/$lib" -x c /dev/null \
        || die "gcc could not build $lib"
    done
  else
    log "   no gcc: vLLM's filesystem tier will use its pure-Python I/O"
  fi

  for mod in vllm.v1.kv_offload.base vllm.v1.kv_offload.factory \
    vllm.v1.kv_offload.cpu.manager vllm.v1.kv_offload.cpu.shared_offload_region \
    vllm.v1.kv_offload.tiering.base vllm.v1.kv_offload.tiering.factory \
    vllm.v1.kv_offload.tiering.manager vllm.v1.kv_offload.tiering.spec \
    vllm.v1.kv_offload.tiering.fs.manager; do
    VLLM_LOGGING_LEVEL=ERROR "$PY" -c "import $mod" >/dev/null 2>&1 \
      || { VLLM_LOGGING_LEVEL=ERROR "$PY" -c "import $mod" >&2 || true; die "import $mod failed"; }
  done
  touch "$BASE_STAMP"
  log "base ready"
fi

# Layer 2: kv-tiering's own dependencies, keyed by pyproject.toml.
proj_key=$(cat "$REPO/pyproject.toml" "$PINS/constraints.txt" | sha256sum | cut -c1-12)
PROJ_STAMP="$ENV_DIR/.kv-tiering-project-$proj_key"
if [ ! -f "$PROJ_STAMP" ]; then
  log "project dependencies from pyproject.toml"
  mapfile -t deps < <("$PY" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project.get("optional-dependencies", {})
deps = list(project.get("dependencies", []))
for extra in ("redis", "uring"):
    deps += extras.get(extra, [])
# the test tools tests/conftest.py and the pytest config in pyproject.toml use
deps += ["pytest", "pytest-asyncio", "pytest-timeout", "hypothesis"]
print("\n".join(deps))
EOF
  )
  pip_install -c "$PINS/constraints.txt" "${deps[@]}" || die "project dependency install failed"
  rm -f "$ENV_DIR"/.kv-tiering-project-*
  touch "$PROJ_STAMP"
fi

echo "$PY"
