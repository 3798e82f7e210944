#!/usr/bin/env bash
# Device sessions for the GPU benchmarks, run on the H200 machine from the repo root with the pydantic wheels
# carried in .whl (the device image has everything else).  Outputs go to $OUT.
#
#   bash bench/gpu_session.sh           fingerprint vs torch.sum (bench_fingerprint_gpu); capture / step inside the
#                                       rank with CUDA events (bench_gpu_capture, ~1.35B parameters); where a dsv3-gpu
#                                       P = 1 step's time goes (profile_rank, 1 step); the fingerprint kernel tests
#   bash bench/gpu_session.sh table     the dsv3 four-run table, GPU against this box's CPU cores (bench_gpu_cpu), the
#                                       fingerprint against torch.sum without the sweep (the former kernel beside it),
#                                       one MoE layer on a CPU core / GPU eager / GPU graphed (bench_graph_layer), the
#                                       grouped-expert, MoE host-read and fingerprint kernel tests
#   bash bench/gpu_session.sh packing   dsv3-gpu's 16-rank runs packed 1, 2, 4 ranks per core (PACKING_SETTINGS), with
#                                       and without MPS (bench_packing, bits compared across settings); the
#                                       grouped-expert and MoE host-read tests on the GPU
#   bash bench/gpu_session.sh dsv3 ...  cases/dsv3-gpu.yaml within DSV3_BUDGET (default 540s; extra args go to
#                                       bitparity verify, default --mps --ranks-per-core 2); the summary with every
#                                       run's time to $OUT/dsv3-gpu-summary.json
#   bash bench/gpu_session.sh dsv3-and-kernels ...   the same within 460s, then the fingerprint (no sweep) and the
#                                       graphed layer: one call where device time is short
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "cpus", __import__("os").cpu_count())'
# where a dsv3-gpu P = 1 step's time goes (one step under the profiler; both the default session and `table`)
profile_pp1() {
    echo "== profile: dsv3-gpu pp1, one step"
    timeout 130 python3 bench/profile_rank.py cases/dsv3-gpu.yaml pp1-no-pipelining --steps 1 --out "$OUT" --rows 30 \
        > "$OUT/profile_pp1.txt" 2>&1
    echo "exit $?"; head -c 3000 "$OUT/profile_pp1.txt"
}
# the fingerprint against torch.sum without the sweep, the former kernel beside it (~40 s with the imports)
fingerprint_nosweep() {
    echo "== fingerprint benchmark (no sweep; the former kernel beside it)"
    timeout -k 5 "${1:-120}" python3 bench/bench_fingerprint_gpu.py --no-sweep --out "$OUT/fingerprint_gpu.json" 2>&1 | tail -16
}
# one MoE layer on a CPU core, eagerly on the GPU, replayed as CUDA graphs (~40 s)
graph_layer() {
    echo "== one MoE layer: CPU core, GPU eager, GPU graphed"
    timeout -k 5 "${1:-90}" python3 bench/bench_graph_layer.py --out "$OUT/graph_layer.json" 2>&1 | tail -6
}
if [ "${1:-}" = dsv3 ] || [ "${1:-}" = dsv3-and-kernels ]; then
    mode=$1; shift
    start=$(date +%s)
    # the whole case took ~13 min on one H200 with one rank per core, over the device's 10-minute call: --budget
    # stops starting runs and cuts those in flight in time for the report, so the runs that finished still get
    # their verdicts (the rest are errors, "not run"); the outer timeout only guards against a hang in the report
    # the ranks through MPS, two 16-rank runs at a time: 1.78x on the 16-rank runs (bench/results, packing)
    [ $# -eq 0 ] && set -- --mps --ranks-per-core 2
    # dsv3-and-kernels: the case in less (DSV3_BUDGET default 460s), then the fingerprint and the graphed layer
    # (40 s each); keep DSV3_BUDGET ~20 s under the outer timeout, which leaves verify time for its report
    budget=${DSV3_BUDGET:-$([ "$mode" = dsv3 ] && echo 540s || echo 460s)}
    rm -rf /tmp/rep
    timeout -k 10 "$([ "$mode" = dsv3 ] && echo 570 || echo 480)" python3 -m harness verify cases/dsv3-gpu.yaml \
        --out /tmp/rep --budget "$budget" "$@" > "$OUT/dsv3-gpu.log" 2>&1
    rc=$?
    echo "verify exit $rc after $(( $(date +%s) - start )) s"
    grep -v "^      collecting" "$OUT/dsv3-gpu.log" | tail -40
    cp /tmp/rep/dsv3-gpu/summary.json "$OUT/dsv3-gpu-summary.json" 2>/dev/null
    if [ "$mode" = dsv3-and-kernels ]; then fingerprint_nosweep 40; graph_layer 40; fi
    exit $rc
fi
if [ "${1:-}" = packing ]; then
    echo "== packing: ranks per core, MPS"; timeout 540 python3 bench/bench_packing.py --mps --timeout 150 \
        --settings "${PACKING_SETTINGS:-1,2,4}" --out "$OUT/packing.json" 2>&1 | tail -16
    echo "== grouped-expert and MoE host-read tests"; timeout 60 python3 -m pytest -q -p no:cacheprovider \
        tests/test_grouped_experts.py tests/test_expert_parallel.py 2>&1 | tail -3
    exit 0
fi
if [ "${1:-}" = table ]; then
    echo "== grouped-expert and MoE host-read tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider \
        tests/test_grouped_experts.py tests/test_expert_parallel.py 2>&1 | tail -15
    echo "== dsv3: GPU against CPU, side by side"; timeout 400 python3 bench/bench_gpu_cpu.py --out "$OUT/gpu_cpu.json" 2>&1 | tail -8
    fingerprint_nosweep
    graph_layer
    echo "== fingerprint kernel tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fingerprint_gpu.py 2>&1 | tail -3
    exit 0
fi
echo "== fingerprint benchmark"; timeout 150 python3 bench/bench_fingerprint_gpu.py --out "$OUT/fingerprint_gpu.json" 2>&1 | tail -45
echo "== capture inside the rank"; timeout 200 python3 bench/bench_gpu_capture.py --steps 5 --out "$OUT/gpu_capture.json" 2>&1 | tail -8
profile_pp1
echo "== fingerprint kernel tests"; timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_fingerprint_gpu.py 2>&1 | tail -3
