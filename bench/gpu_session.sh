#!/usr/bin/env bash
# One device session for the GPU issue, run on the H200 machine from the repo root with the pydantic wheels
# carried in .whl (the device image has everything else): fingerprint kernel tests and benchmark, capture
# overhead; then (second call, `bash bench/gpu_session.sh dsv3`) the DeepSeek-V3 layouts of cases/dsv3-gpu.yaml.
# Outputs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
if [ "${1:-}" = dsv3 ]; then
    shift
    timeout 560 python3 -m harness verify cases/dsv3-gpu.yaml --out /tmp/rep "$@" 2>&1 | grep -v "^ \|^\["
    cp /tmp/rep/dsv3-gpu/summary.json "$OUT/dsv3-gpu-summary.json" 2>/dev/null
    exit 0
fi
echo "== fingerprint kernel tests"; timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fingerprint_gpu.py 2>&1 | tail -3
echo "== fingerprint benchmark"; timeout 200 python3 bench/bench_fingerprint_gpu.py --quick --out "$OUT/fingerprint_gpu.json" 2>&1 | tail -40
echo "== capture overhead"; timeout 450 python3 bench/bench_gpu_capture.py --steps 6 --repeats 2 --out "$OUT/gpu_capture.json" 2>&1 | tail -4
