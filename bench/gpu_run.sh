#!/usr/bin/env bash
# Everything the GPU figures need, in few calls on the device machine (budgeted: each stage
# has its own time limit, and results are copied to $OUT after every stage).
#   PYTHONPATH=. bash bench/gpu_run.sh STAGE...
# stages: streams tests runtime cap kernels train memory-a memory-b
set -u
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tinysn-gpu}
mkdir -p "$OUT" bench/results
touch /tmp/tinysn-gpu-start      # only results written by this call go back (8 files at most)
save() { find bench/results \( -name '*.json' -o -name '*.txt' \) -newer /tmp/tinysn-gpu-start -exec cp {} "$OUT"/ \; ; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$OUT/gpu.log"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')
MEM="--memory 12GiB --host-memory 60GiB --merge"
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    streams)  TINYSN_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/sched/test_streams.py 2>&1 | tail -5 ;;
    # every gpu-marked test; each autotuned kernel's configs are all checked by the
    # *_every_config tests, so the rest run untuned (one compile per shape)
    tests)    TINYSN_AUTOTUNE=0 timeout ${TESTS_S:-420} python3 -m pytest -q -rfE --durations=10 -p no:benchmark -m gpu -n ${TEST_WORKERS:-14} -p no:cacheprovider tests 2>&1 | tee "bench/results/gpu-tests-$GPU.txt" | tail -30 ;;
    # the runtime's gpu tests alone (graph mode, streams, tensor moves): quick, after runtime changes
    runtime)  TINYSN_AUTOTUNE=0 timeout ${RUNTIME_S:-240} python3 -m pytest -q -rfE -p no:benchmark -m gpu -p no:cacheprovider tests/test_runtime.py tests/sched tests/test_tensor.py 2>&1 | tee "bench/results/gpu-tests-runtime-$GPU.txt" | tail -40 ;;
    # the process-wide cap (tests/test_cap.py) with autotuning ON: tuning must stay in the cap
    cap)      timeout ${CAP_S:-300} python3 -m pytest -q -s -rfE -p no:benchmark -m gpu -p no:cacheprovider tests/test_cap.py 2>&1 | tee "bench/results/gpu-tests-cap-$GPU.txt" | tail -30 ;;
    kernels)  timeout ${KERNELS_S:-330} python3 bench/kernels.py ${KERNELS_ONLY:+--only $KERNELS_ONLY} 2>&1 | tail -70 ;;
    train)    TINYSN_AUTOTUNE=0 timeout 200 python3 bench/train.py --model resnet50 --batch 32 --policies baseline,all --pin-algos backward_weight=splitk --steps 10 --cuda-graph both 2>&1 | tail -12 ;;
    memory-a) TINYSN_AUTOTUNE=0 timeout 420 python3 bench/memory.py $MEM --models resnet50,vgg16,inception_v4 --reference 120GiB --reference-models resnet50 2>&1 | tail -20 ;;
    # the deep ResNet alone, its step replayed as a CUDA graph (results memory-graph-<gpu>.json)
    deep-graph) TINYSN_AUTOTUNE=0 timeout ${DEEP_S:-330} python3 bench/memory.py --memory 12GiB --host-memory 60GiB --models "" --deep-n "${DEEP_N:-2021}" --cuda-graph --out "memory-graph-$GPU" 2>&1 | tail -12 ;;
    memory-b) TINYSN_AUTOTUNE=0 timeout 480 python3 bench/memory.py $MEM --models resnet101,resnet152 --deep-n "${DEEP_N:-0}" 2>&1 | tail -20 ;;
  esac 2>&1 | tee -a "$OUT/gpu.log"
  echo "stage $stage took $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.log"
  save
done
