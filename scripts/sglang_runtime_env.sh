#!/usr/bin/env bash
# Create (first time) or reuse the virtual environment that runs SGLang's own runtime with the
# sloserve plugin, and print that environment's python as the LAST line of output.
#
#   PY=$(bash scripts/sglang_runtime_env.sh | tail -1)
#   "$PY" -m sloserve.launch --engine sglang --tpot-slo 30ms
#
# With --no-create an environment that does not exist yet is not created: the script says so
# and exits with status 3 (tests use this to skip instead of downloading 11 GB).
#
# SGLang pins its own torch (2.14.1), transformers and CUDA packages, so it lives apart from the
# project's environment. The environment is keyed by the pinned SGLang version and the Python
# version and cached under $SLOSERVE_SGLANG_ENV_ROOT (default ~/.cache/sloserve/sglang-env):
# the first creation downloads about 11 GB and takes 6-15 minutes; later calls only re-install
# this checkout of sloserve into it (seconds). A half-built environment is never reused: the
# marker file is written only after SGLang imports.
set -euo pipefail

SGLANG_VERSION=0.5.23
repo=$(cd "$(dirname "$0")/.." && pwd)
base_python=${SLOSERVE_SGLANG_BASE_PYTHON:-python3}
pyver=$("$base_python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
root=${SLOSERVE_SGLANG_ENV_ROOT:-$HOME/.cache/sloserve/sglang-env}
env_dir="$root/sglang-${SGLANG_VERSION}-py${pyver}"
marker="$env_dir/.sloserve-ready"
py="$env_dir/bin/python"

log() { echo "[sglang_runtime_env] $*" >&2; }

no_create=0
for arg in "$@"; do
    case "$arg" in
        --no-create) no_create=1 ;;
        *) log "unknown argument: $arg"; exit 2 ;;
    esac
done

mkdir -p "$root"
exec 9>"$root/.lock"
if ! flock -w 3600 9; then
    log "timed out waiting for another creation of $env_dir"
    exit 1
fi

if [ ! -f "$marker" ] && [ "$no_create" = 1 ]; then
    log "no SGLang environment at $env_dir (run this script without --no-create to create it)"
    exit 3
fi

if [ ! -f "$marker" ]; then
    log "creating $env_dir (sglang==$SGLANG_VERSION; about 11 GB, 6-15 minutes the first time)"
    start=$(date +%s)
    rm -rf "$env_dir"
    "$base_python" -m venv "$env_dir"
    "$py" -m pip install -q --upgrade pip >&2
    # --progress-bar off: CI logs stay readable; pip still names every package it fetches.
    "$py" -m pip install --progress-bar off "sglang==${SGLANG_VERSION}" >&2
    "$py" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2
    touch "$marker"
    log "created in $(( $(date +%s) - start )) s"
fi

# This checkout of sloserve, without touching SGLang's pins (its torch, transformers stay).
# Re-installed when the checkout or its pyproject.toml (entry points, package data) changes.
source_key="$repo $(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"
installed_from=$(cat "$env_dir/.sloserve-source" 2>/dev/null || true)
if [ "$installed_from" != "$source_key" ]; then
    log "installing sloserve from $repo"
    "$py" - <<'PY' > "$env_dir/.pins.txt"
import importlib.metadata as md
for name in ("torch", "transformers", "tokenizers", "sglang", "numpy"):
    print(f"{name}=={md.version(name)}")
PY
    PIP_CONSTRAINT="$env_dir/.pins.txt" "$py" -m pip install -q -e "$repo" >&2
    # The CPU shim's attention runs the project's C++ kernels, built for SGLang's torch: build
    # them now (15-30 s once per machine, torch and kernel sources) rather than in a server's
    # first request. A failed build is not fatal: the shim then attends in plain torch.
    if ! "$py" -c "import torch; torch.cuda.is_available() and exit(0)
from sloserve.runtime.cpu_kernels import cpu_ops; exit(cpu_ops() is None)" >&2; then
        log "the C++ CPU kernels did not build for SGLang's torch; its CPU shim will attend in plain torch"
    fi
    echo "$source_key" > "$env_dir/.sloserve-source"
fi
echo "$py"
