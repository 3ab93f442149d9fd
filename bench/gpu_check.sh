#!/usr/bin/env bash
# The CUDA paths on a machine with a GPU, as one script: the CUDA tests (pinned staging,
# GPU tensors through dcp.save / async_save / load back to the GPU, bit-exact), then the
# GPU bench. Dependencies come from a local wheel folder (WHEELS, default .gpuwheels) when
# the machine has no package index; torch is the machine's own.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpuwheels}
OUT=${OUT:-bench/results}
if [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --find-links "$WHEELS" grpcio grpcio-health-checking \
    protobuf fsspec s3fs zstandard xxhash prometheus-client pytest pytest-timeout 2>&1 | tail -3
fi
export PYTHONPATH="$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
$PY -m pytest -q -p no:cacheprovider -rs \
  tests/unit/tierckpt/test_staging.py tests/integration/test_async_staging.py 2>&1 | tail -15
$PY bench/bench_gpu.py --gib "${GIB:-2}" --repeat 3 --out "$OUT/gpu.json"
