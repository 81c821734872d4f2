#!/usr/bin/env bash
# Every GPU figure in few calls on the device machine; each stage has its own time limit and
# writes its results straight into $OUT (never into the tracked bench/results/).
#   PYTHONPATH=. OUT=/some/dir bash bench/gpu_run.sh STAGE...
# stages: first-run streams tests runtime conv-check conv-gap cap kernels conv-configs linear-configs bn-configs timer-queue profile eager-profile pool train host-probe memory-a memory-b deep-graph trace oversub ddp-b32 ddp-largest
# (the ddp stages need two GPUs: bench/ddp.py, one file with both stages' configurations)
# Copy a result into bench/results/ by hand once it is checked, one file per configuration.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tinysn-gpu}
STAGES="first-run streams tests runtime conv-check conv-gap cap kernels conv-configs linear-configs bn-configs timer-queue profile eager-profile pool train host-probe memory-a memory-b deep-graph trace oversub ddp-b32 ddp-largest"
for stage in "$@"; do
  case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage '$stage' (stages: $STAGES)"; exit 2 ;; esac
done
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$OUT/gpu.log"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')
MEM="--memory 12GiB --host-memory 60GiB --merge --out $OUT/memory-$GPU.json"
# memory-a and memory-b fill one file (oversub too, over several calls); start from the
# tracked one so the other stage's rows stay
seed() { [ -e "$OUT/$1" ] || cp "bench/results/$1" "$OUT/" 2>/dev/null || true; }
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    first-run) timeout ${FIRST_S:-300} python3 bench/first_run.py --out "$OUT/first-run-$GPU.json" 2>&1 | tail -14 ;;
    streams)  TINYSN_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/sched/test_streams.py 2>&1 | tail -5 ;;
    # every gpu-marked test but the conv's every-config check (stage conv-check: each of its
    # 16 cases compiles every conv kernel, 96-208 s, and together they cut this stage off at
    # 370 s); each autotuned kernel's configs are all checked by the *_every_config tests, so
    # the rest run untuned (one compile per shape); idle workers take queued tests from
    # busy ones (--dist worksteal): in the last run its finished tests added up to 4,054 s,
    # 290 s over 14 workers, yet the run was cut off at 424 s; gpu_tests.py writes one row
    # per test, also when timeout's SIGTERM cuts the run short; the tests that assert on measured
    # times (marker "timing") run after, alone: beside 13 other workers their host is loaded
    tests)    TINYSN_COMPILE_PROCESSES=0 TINYSN_AUTOTUNE=0 timeout -k 30 ${TESTS_S:-420} python3 bench/gpu_tests.py --out "$OUT/gpu-tests-$GPU.json" -- -q -rfE --durations=10 -p no:benchmark -m "gpu and not timing" -n ${TEST_WORKERS:-14} --dist worksteal -p no:cacheprovider -k "not test_conv_gpu_every_config" tests 2>&1 | tail -30
              TINYSN_AUTOTUNE=0 timeout -k 30 ${TIMING_S:-200} python3 bench/gpu_tests.py --out "$OUT/gpu-tests-timing-$GPU.json" -- -q -rfE -p no:benchmark -m "gpu and timing" -p no:cacheprovider tests 2>&1 | tail -8 ;;
    # the runtime's gpu tests alone (graph mode, streams, tensor moves): quick, after runtime changes
    runtime)  TINYSN_AUTOTUNE=0 timeout ${RUNTIME_S:-240} python3 -m pytest -q -rfE -p no:benchmark -m gpu -p no:cacheprovider tests/test_runtime.py tests/sched tests/test_tensor.py 2>&1 | tail -40 ;;
    # the conv kernels pinned to chosen configs (CHECK_INDEXES, default "0 1 2 3", then
    # "4 5 6 7" in a second call: each index pins every conv autotuner to its config of that
    # index, ieee and tf32, in parallel); one index compiles every conv kernel and took
    # 90-210 s on the H200's 16 cores, an ieee one up to 450 s on the H100's (two cut off
    # at 200 and 265 s), so after a config-list change check only the indexes that changed
    conv-check) ids=""; for i in ${CHECK_INDEXES:-0 1 2 3}; do for p in ieee tf32; do
                  ids="$ids tests/kernels/test_conv.py::test_conv_gpu_every_config[$i-$p]"; done; done
                # gpu_tests.py keeps one row per test, so a run cut short says which finished
                TINYSN_AUTOTUNE=0 timeout -k 30 ${CHECK_S:-500} python3 bench/gpu_tests.py --out "$OUT/gpu-tests-conv-check-$GPU.json" -- -q -rfE -p no:benchmark -m gpu -p no:cacheprovider -n $(echo $ids | wc -w) $ids 2>&1 | tail -12 ;;
    # VGG16's conv passes as the step runs them (ReLU mask, bias and ReLU, cold L2) beside
    # the rankings' plain calls
    conv-gap) timeout ${GAP_S:-150} python3 bench/conv_gap.py --out "$OUT/conv-gap-$GPU.json" 2>&1 | tail -40 ;;
    # the process-wide cap (tests/test_cap.py) with autotuning ON: tuning must stay in the cap
    cap)      timeout -k 30 ${CAP_S:-300} python3 bench/gpu_tests.py --out "$OUT/gpu-tests-cap-$GPU.json" -- -q -s -rfE -p no:benchmark -m gpu -p no:cacheprovider tests/test_cap.py 2>&1 | tail -30 ;;
    kernels)  timeout ${KERNELS_S:-330} python3 bench/kernels.py ${KERNELS_ONLY:+--only $KERNELS_ONLY} --out "$OUT/kernels-$GPU.json" 2>&1 | tail -70 ;;
    # the conv autotuners' config lists: every tuner under a wider sweep on VGG16 / ResNet-50 shapes, greedy pick
    # (CONFIGS_ARGS="--tuners weight --kernel-size 3" CONFIGS_NAME=weight-3x3: one tuner's 3x3 rows)
    conv-configs) timeout ${CONFIGS_S:-300} python3 bench/conv_configs.py ${CONFIGS_ARGS:-} --out "$OUT/conv-configs${CONFIGS_NAME:+-$CONFIGS_NAME}-$GPU.json" 2>&1 | tail -34 ;;
    # every config of the fully connected GEMM on fc6 / fc7 / AlexNet's fc6 / ResNet-50's fc, each
    # pass (the fused SGD step too), beside cuBLAS (LINEAR_ARGS="--grid --passes dw+db+sgd"
    # LINEAR_NAME=grid: a grid of one-step tiles after the list, the fused step alone)
    linear-configs) timeout ${LINEAR_S:-240} python3 bench/linear_configs.py ${LINEAR_ARGS:-} --out "$OUT/linear-configs${LINEAR_NAME:+-$LINEAR_NAME}-$GPU.json" 2>&1 | tail -18 ;;
    # kernels/bn.py's block-shape constants swept on ResNet-50's batch-norm shapes (BN_ARGS:
    # e.g. --tiles 2048 --warps 8 to narrow it; 36 combinations by default; --last-first 0,1
    # the elementwise passes' channel order, --channel-max 0,8192,32768 the one-launch form)
    bn-configs) timeout ${BN_S:-420} python3 bench/bn_configs.py ${BN_ARGS:-} --out "$OUT/bn-configs${BN_NAME:+-$BN_NAME}-$GPU.json" 2>&1 | tail -42 ;;
    # the GPU's launch queue against bench_ms's held batches (the timer of every ranking)
    timer-queue) timeout ${QUEUE_S:-150} python3 bench/timer_queue.py --out "$OUT/timer-queue-$GPU.json" 2>&1 | tail -20 ;;
    # device time per kernel of an eager step at batch 32 (PROFILE_MODELS picks models;
    # PROFILE_ARGS=--pytorch also profiles the torch.compile step, in the same file)
    profile)  for model in ${PROFILE_MODELS:-alexnet vgg16 resnet50}; do
                timeout ${PROFILE_S:-120} python3 bench/step_profile.py --model "$model" ${PROFILE_ARGS:-} --out "$OUT/profile-$model-b32-$GPU.json" 2>&1 | tail -${PROFILE_LINES:-22}
              done ;;
    # where an eager step's host time goes (cProfile; EAGER_MODELS picks models)
    eager-profile) for model in ${EAGER_MODELS:-resnet50}; do
                timeout ${EAGER_S:-150} python3 bench/eager_profile.py --model "$model" --out "$OUT/eager-profile-$model-b32-$GPU.json" 2>&1 | tail -16
              done ;;
    pool)     timeout 120 python3 bench/pool.py --out "$OUT/pool-$GPU.json" 2>&1 | tail -12 ;;
    # batch 32, each model in its own process and time limit (default kernels, autotuned;
    # cold, torch.compile, compiling and the conv rankings take most of it: a ResNet-50 and
    # an Inception-v4 run were cut off at 190 s before tinysn's graphed row, so the limits
    # are per model unless TRAIN_S sets one for all; TRAIN_MODELS picks models):
    # PyTorch eager NCHW / channels-last / torch.compile, tinysn eager / graphed; TRAIN_ARGS
    # go to train.py and TRAIN_NAME into the file name (TRAIN_ARGS=--no-fuse-bn-relu
    # TRAIN_NAME=bn-apart: the batch norms' ReLUs planned apart, beside a default run)
    train)    for model in ${TRAIN_MODELS:-resnet50 vgg16 alexnet inception_v4}; do
                case $model in resnet50) limit=300 ;; inception_v4) limit=450 ;; vgg16) limit=240 ;; *) limit=150 ;; esac
                timeout ${TRAIN_S:-$limit} python3 bench/train.py --model "$model" --batch 32 ${TRAIN_ARGS:-} --out "$OUT/train-$model-b32${TRAIN_NAME:+-$TRAIN_NAME}-$GPU.json" 2>&1 | tail -8
              done ;;
    # the host probe against ResNet-50's and AlexNet's eager steps, paired over a minute (untuned)
    host-probe) TINYSN_AUTOTUNE=0 timeout ${PROBE_S:-240} python3 bench/host_probe.py --out "$OUT/host-probe-$GPU.json" 2>&1 | tail -16 ;;
    memory-a) seed "memory-$GPU.json"; TINYSN_AUTOTUNE=0 timeout 420 python3 bench/memory.py $MEM --models resnet50,vgg16,inception_v4 --reference 120GiB --reference-models resnet50 2>&1 | tail -20 ;;
    memory-b) seed "memory-$GPU.json"; TINYSN_AUTOTUNE=0 timeout 480 python3 bench/memory.py $MEM --models resnet101,resnet152 --deep-n "${DEEP_N:-0}" 2>&1 | tail -20 ;;
    # the deep ResNet alone, its step replayed as a CUDA graph
    deep-graph) TINYSN_AUTOTUNE=0 timeout ${DEEP_S:-330} python3 bench/memory.py --memory 12GiB --host-memory 60GiB --models "" --deep-n "${DEEP_N:-2021}" --cuda-graph --out "$OUT/memory-graph-$GPU.json" 2>&1 | tail -12 ;;
    # one step of ResNet-50 at its largest 12 GiB batch (TRACE_BATCH, else the tracked memory
    # result's) as a Chrome trace; draw it off the device: python3 -m tinysn trace F --plot P
    trace)    B=${TRACE_BATCH:-$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['models']['resnet50']['max_batch_all'])" "bench/results/memory-$GPU.json")}
              TINYSN_AUTOTUNE=0 timeout ${TRACE_S:-420} python3 -m tinysn train --model resnet50 --batch "$B" --memory 12GiB --host-memory 60GiB --momentum 0 --steps 3 --schedule constant --device cuda --trace "$OUT/trace-resnet50-b$B-$GPU.json" 2>&1 | tail -6 ;;
    # images/s against batch beyond the cap: each model's ladder under 12 GiB and 120 GiB,
    # then PyTorch eager / checkpoint / save_on_cpu at their largest batches; one model and
    # part per call (OVERSUB_MODELS, OVERSUB_PARTS) keeps each call under 10 minutes;
    # OVERSUB_FIRST starts the ladder later, OVERSUB_ONLY runs just those batches
    oversub)  seed "oversub-$GPU.json"; TINYSN_AUTOTUNE=0 timeout ${OVERSUB_S:-540} python3 bench/oversub.py --models ${OVERSUB_MODELS:-resnet50} --parts ${OVERSUB_PARTS:-tinysn,pytorch} --memory 12GiB --reference 120GiB --host-memory 60GiB --batches ${OVERSUB_BATCHES:-resnet50=995,vgg16=320,inception_v4=842} ${OVERSUB_FIRST:+--first $OVERSUB_FIRST} ${OVERSUB_ONLY:+--only $OVERSUB_ONLY} --merge --out "$OUT/oversub-$GPU.json" 2>&1 | tail -30 ;;
    ddp-b32)  NCCL_NVLS_ENABLE=0 timeout ${DDP_S:-540} python3 bench/ddp.py --gpus 2 --configs b32-graph,b32 --merge --out "$OUT/ddp-$GPU.json" 2>&1 | tail -6 ;;
    ddp-largest) NCCL_NVLS_ENABLE=0 timeout ${DDP_S:-540} python3 bench/ddp.py --gpus 2 --configs largest --merge --out "$OUT/ddp-$GPU.json" 2>&1 | tail -6 ;;
  esac 2>&1 | tee -a "$OUT/gpu.log"
  echo "stage $stage took $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.log"
done
