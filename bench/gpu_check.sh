#!/usr/bin/env bash
# On a lent GPU machine (docs/development.md): bench/gpu_check.py under the python that has torch.
set -euo pipefail
cd "$(dirname "$0")/.."
for py in python3.12 python3 python; do
  if command -v "$py" >/dev/null && "$py" -c 'import torch' 2>/dev/null; then
    exec "$py" bench/gpu_check.py "$@"
  fi
done
echo "gpu_check.sh: no python with torch on PATH" >&2
exit 2
