#!/usr/bin/env bash
# One fingerprint of the Python sources and scripts a GPU check ran (the engine, its tests,
# the benchmark, the soak): the same files give the same line here and on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
find tiering tests benchmarks scripts -type f \( -name '*.py' -o -name '*.sh' -o -name '*.c' \) \
  -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12
