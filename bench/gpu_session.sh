#!/usr/bin/env bash
# One device session for the GPU issues: run on the H200 machine from the repo root, with the pydantic wheels
# carried in .whl (the device image has everything else).  PART=a: fingerprint kernel tests + benchmark,
# placements (multi-GPU) and capture overhead; PART=b: the DeepSeek-V3 case on the GPU.  Outputs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
if [ "${PART:-a}" = a ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fingerprint_gpu.py 2>&1 | tail -4
  timeout 150 python3 bench/bench_fingerprint_gpu.py --out "$OUT/fingerprint_gpu.json" 2>&1 | tail -20
  timeout 200 python3 bench/bench_placements.py cases/dsv3-gpu.yaml pp2-1f1b-mtp-with-loss \
      canonical-clip/pp2-1f1b-mtp-with-loss --out "$OUT/multi_gpu.json" 2>&1 | tail -6
  timeout 200 python3 bench/bench_gpu_capture.py --steps 4 --out "$OUT/gpu_capture.json" 2>&1 | tail -5
else
  timeout 560 python3 -m harness verify cases/dsv3-gpu.yaml --num-gpus 1 --out /tmp/rep \
      --only pp16-vpp2-mtp-with-loss --only pp8-vpp4-mtp-standalone --only pp2-1f1b-mtp-with-loss \
      --only pp1-no-pipelining --only canonical-clip/pp1-no-pipelining 2>&1 | grep -v "^ \|^\["
  cp /tmp/rep/dsv3-gpu/summary.json "$OUT/dsv3-gpu-summary.json"; cp /tmp/rep/dsv3-gpu/index.html "$OUT/dsv3-gpu-report.html"
fi
