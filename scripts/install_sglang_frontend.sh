#!/usr/bin/env bash
# Install SGLang's frontend language (sgl.function / gen / select, sgl.RuntimeEndpoint) for the
# server tests and examples, without SGLang's GPU runtime: `pip install sglang` would pull a
# different torch and gigabytes of CUDA packages.
#
# sglang 0.5.10 is the newest release whose `import sglang` does not import its server runtime
# (torch, triton); its frontend needs only the pure-Python-side packages below (numpy, tqdm and
# pydantic come with sloserve). Idempotent: does nothing when the pinned version already imports.
set -euo pipefail

SGLANG_VERSION=0.5.10
PYTHON=${PYTHON:-python}

check() {
    "$PYTHON" - "$SGLANG_VERSION" <<'PY'
import sys
import sglang as sgl
assert sgl.__version__ == sys.argv[1], sgl.__version__
assert all((sgl.RuntimeEndpoint, sgl.function, sgl.gen, sgl.select))
print(f"sglang frontend {sgl.__version__} OK")
PY
}

if check 2>/dev/null; then
    exit 0
fi
# The frontend's own dependencies first, sglang itself last with --no-deps: pip checks the
# installed packages for unmet requirements after an install with dependencies, and would
# print sglang's server-runtime requirements (torch, CUDA packages: deliberately absent) as a
# red "ERROR: pip's dependency resolver ..." block although everything worked; an install with
# --no-deps makes no such check.
"$PYTHON" -m pip install "pybase64==1.5.1" "aiohttp==3.14.5" "requests>=2.31" "ipython>=8.12"
"$PYTHON" -m pip install --no-deps "sglang==${SGLANG_VERSION}"
check
