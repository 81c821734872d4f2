#!/usr/bin/env bash
# Everything the GPU figures need, in one call on the device machine (budgeted: each stage
# has its own time limit, and results are copied to $OUT after every stage).
#   PYTHONPATH=. bash bench/gpu_run.sh [stages...]     stages: tests kernels train memory
set -u
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tinysn-gpu}
mkdir -p "$OUT" bench/results
stages=${*:-tests kernels train memory}
save() { cp bench/results/*.json "$OUT"/ 2>/dev/null || true; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)   timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/kernels tests/pool 2>&1 | tail -25 | tee "$OUT/gpu-tests.log" ;;
    kernels) timeout 170 python3 bench/kernels.py 2>&1 | tail -60 | tee "$OUT/kernels.log" ;;
    train)   timeout 150 python3 bench/train.py --model resnet50 --batch 32 --policies baseline,all --pin-algos --steps 10 2>&1 | tail -8 | tee "$OUT/train.log" ;;
    memory)  timeout 110 python3 bench/memory.py --models resnet50 2>&1 | tail -8 | tee "$OUT/memory.log" ;;
  esac
  echo "stage $stage took $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.log"
  save
done
