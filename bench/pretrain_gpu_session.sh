#!/usr/bin/env bash
# One device session (one GPU): Megatron-LM's own pretrain_gpt.py with the bitparity capture, natively on CUDA
# (bf16, nccl, P = 1), compared with `bitparity compare`.  Carried: .whl (pydantic, megatron-core 0.19.2,
# pybind11 for the device's Python) and .mlm-main (a Megatron-LM checkout's pretrain_gpt.py, its root modules and
# megatron/, dataset helpers built for CPython 3.12).  Runs, each 3 steps of cases/pretrain/tiny-moe-mtp.args:
#   main-clip0, main-clip0-again   the checkout, clipping off, twice (run-to-run on the GPU)
#   main-clip005                   clipping on (0.05): must differ from step 0's update on
#   main-planted                   the checkout with the MTP loss scale doubled (a source edit): step 0's gradients
#   wheel-clip0                    bitparity's stand-in pretrain_gpt.py on the megatron-core 0.19.2 wheel
# Summaries (compare reports' summary.json, per-step capture and step times, trace bytes) go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/cap
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
command -v make g++ >/dev/null || echo "note: no make / g++ here (the checkout's dataset helpers are prebuilt)"
ARGS=$(grep -v '^ *#' cases/pretrain/tiny-moe-mtp.args)
rm -rf /tmp/planted && cp -r .mlm-main /tmp/planted
sed -i 's|mtp_loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers|mtp_loss_scale = 2 * config.mtp_loss_scaling_factor / config.mtp_num_layers|' \
    /tmp/planted/megatron/core/transformer/multi_token_prediction.py
grep -c "mtp_loss_scale = 2 \*" /tmp/planted/megatron/core/transformer/multi_token_prediction.py
run() {
    local name=$1 script=$2; shift 2
    local t0=$SECONDS
    timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m megatron_trainer.pretrain \
        --bitparity-out /tmp/cap/$name "$script" $ARGS --bf16 --distributed-backend nccl "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s; $(grep -o 'lm loss: [0-9.E+-]*' "$OUT/$name.log" | tail -1)"
}
run main-clip0 .mlm-main/pretrain_gpt.py
run main-clip0-again .mlm-main/pretrain_gpt.py
run main-clip005 .mlm-main/pretrain_gpt.py --clip-grad 0.05
run main-planted /tmp/planted/pretrain_gpt.py
run wheel-clip0 megatron_trainer/standin/pretrain_gpt.py
for pair in "main-clip0 main-clip0-again" "main-clip0 main-clip005" "main-clip0 main-planted" "main-clip0 wheel-clip0"; do
    set -- $pair
    python3 -m harness compare /tmp/cap/$1 /tmp/cap/$2 --out /tmp/rep --name "$1-vs-$2" 2>&1 | tail -2
    cp "/tmp/rep/$1-vs-$2/summary.json" "$OUT/$1-vs-$2.summary.json" 2>/dev/null
done
python3 - <<'EOF' > "$OUT/capture_cost.json"
import glob, json, os
out = {}
for d in sorted(glob.glob("/tmp/cap/*")):
    for f in sorted(glob.glob(d + "/rank*.jsonl")):
        recs = [json.loads(x) for x in open(f)]
        steps = [r for r in recs if r["type"] == "step"]
        head = recs[0]
        out[os.path.basename(d)] = {"params": len(head["params"]),
                                    "numel": sum(eval("*".join(map(str, p["shape"])) or "1") for p in head["params"]),
                                    "trace_bytes": os.path.getsize(f), "steps": len(steps),
                                    "time_s": [s["time_s"] for s in steps], "capture_s": [s.get("capture_s") for s in steps],
                                    "device": head.get("device"), "megatron_core": head["settings"].get("megatron_core"),
                                    "megatron_path": head["settings"].get("megatron_path")}
print(json.dumps(out, indent=1))
EOF
cat "$OUT/capture_cost.json" | head -60
