#!/usr/bin/env bash
# One device session for the megatron-core trainer on one GPU (run from the repo root on the H200 machine with
# the wheels carried in .whl: pydantic and megatron-core for the device's Python; see README "GPU"):
# cases/megatron-gpu.yaml in bf16 (fp32 main grads) and in fp32.  Summaries go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))' 2>&1 | tail -1
for dtype in bfloat16 float32; do
    echo "== megatron-gpu $dtype"
    timeout 250 python3 -m harness verify cases/megatron-gpu.yaml --params-dtype "$dtype" --out "/tmp/rep-$dtype" 2>&1 | grep -v "^\["
    cp "/tmp/rep-$dtype/megatron-gpu/summary.json" "$OUT/megatron-gpu-$dtype-summary.json" 2>/dev/null
    for r in /tmp/rep-$dtype/megatron-gpu/runs/*/; do
        n=$(basename "$r"); cp "$r/rank0.log" "$OUT/$dtype-$n-rank0.log" 2>/dev/null
        cp "$r/manifest.json" "$OUT/$dtype-$n-manifest.json" 2>/dev/null
    done
done
