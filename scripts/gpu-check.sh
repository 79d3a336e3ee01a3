#!/usr/bin/env bash
# The GPU checks of issue 15 as one short run: every CUDA-marked test, then
# `tensorhub bench gpu`, logs and the JSON report under $OUT (the device tool brings them
# back). On the GPU machine, after scripts/gpu-wheels.sh here:
#   device run, carry [".whl"], command: scripts/gpu-check.sh
# Here, first, on CPU (the CUDA tests skip with their reason; the bench runs its smoke):
#   PYTHON=.venv/bin/python WHEELS=0 DEVICE=cpu scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${WHEELS:-1}" = 1 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu-check: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' | tee "$out/device.txt"
tests=(tests/transport/test_cuda.py tests/transport/test_cuda_staging.py
  tests/transport/test_cuda_ipc.py tests/integrations/test_cuda.py
  tests/integrations/test_cuda_reshard.py)
timeout 300 "$py" -m pytest -p no:cacheprovider -q -rs -m gpu "${tests[@]}" 2>&1 \
  | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 240 "$py" -m ros.cli bench gpu --device "${DEVICE:-cuda}" --size-mb "${GPU_MB:-2048}" \
  --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu-check: tests exit $tests_rc, bench exit $bench"
[ "$tests_rc" = 0 ] && [ "$bench" = 0 ]
