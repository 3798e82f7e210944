#!/usr/bin/env bash
# One device session for the GPU issues, run on the H200 machine from the repo root with the pydantic wheels
# carried in .whl (the device image has everything else): fingerprint kernel tests and benchmark, multi-GPU
# placements, capture overhead, and DeepSeek-V3 layouts on the GPU.  Outputs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
echo "== fingerprint kernel tests"; timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_fingerprint_gpu.py 2>&1 | tail -3
echo "== fingerprint benchmark"; timeout 100 python3 bench/bench_fingerprint_gpu.py --quick --no-sweep --out "$OUT/fingerprint_gpu.json" 2>&1 | tail -14
echo "== placements"; timeout 150 python3 bench/bench_placements.py cases/dsv3-gpu.yaml pp2-1f1b-mtp-with-loss \
    --out "$OUT/multi_gpu.json" 2>&1 | tail -4
echo "== capture overhead"; timeout 130 python3 bench/bench_gpu_capture.py --steps 4 --out "$OUT/gpu_capture.json" 2>&1 | tail -4
echo "== dsv3-gpu"; timeout 150 python3 -m harness verify cases/dsv3-gpu.yaml --num-gpus 1 --out /tmp/rep \
    --only pp2-1f1b-mtp-with-loss --only pp1-no-pipelining 2>&1 | grep -v "^ \|^\["
cp /tmp/rep/dsv3-gpu/summary.json "$OUT/dsv3-gpu-summary.json" 2>/dev/null
