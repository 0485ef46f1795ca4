#!/usr/bin/env bash
# On the GPU machine, one lease in a few device calls:
#   bench/gpu_lease.sh start PLAN   runs bench/gpu_lease.sh's PLAN (a function below) in a
#                                   session of its own, so it outlives the device call
#   bench/gpu_lease.sh wait SECONDS follows the run until it ends or SECONDS pass, then packs
#                                   results and logs into $OUT/results.tgz (SECONDS well
#                                   under the call's limit, which is lower when little
#                                   device time is left: past it nothing is packed)
# Each step has its own time limit and log ($RES/<step>.log); $RES/log.txt says when each
# started and how it ended. Source bench/gpu_setup.sh first (wheels, editable install).
RES=${RES:-/tmp/lease}
CKPT=${CKPT:-/tmp/llama31-8b-random}
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== [$name] $(date -u +%T) started" >> "$RES/log.txt"
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?  # before $(date) resets $?
  echo "=== [$name] $(date -u +%T) exit $rc" >> "$RES/log.txt"
}

facts() {  # the machine: GPU and CPU
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  lscpu > "$RES/lscpu.txt" 2>&1
}

# pytest as the plans run it: pytest-timeout gives each hung test its stack
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)

ckpt_write() {  # ckpt_write [SECONDS]: the 8B-shaped checkpoint (a step; plans run it with &)
  step ckpt "${1:-150}" python3 bench/engine_bench.py --out-dir "$RES" --ckpt "$CKPT" --phases ckpt
}

ckpt_beside() {  # ckpt_beside NAME SECONDS COMMAND...: a step while GPU 0 writes the checkpoint
  (export CUDA_VISIBLE_DEVICES=0
   ckpt_write 300) &
  step "$@"
  wait
}

install_tree() {  # install_tree DIR NAME: DIR's kvscale, editable, in place of the current
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .) \
    > "$RES/install-$2.log" 2>&1
}

bench() {  # bench NAME SECONDS PHASES [ARGS]: engine_bench.py phases, results in $RES
  local name=$1 limit=$2 phases=$3
  shift 3
  step "$name" "$limit" python3 bench/engine_bench.py --out-dir "$RES" --ckpt "$CKPT" \
    --phases "$phases" "$@"
}

run_phase() {  # run_phase NAME SECONDS PHASES [VAR=VALUE ...]: engine_bench.py in $RES/NAME
  local name=$1 limit=$2 phases=$3
  shift 3
  step "$name" "$limit" env "$@" python3 bench/engine_bench.py --out-dir "$RES/$name" \
    --ckpt "$CKPT" --phases "$phases"
}

# Issue 23, first lease: GPU tests, then the measurements in priority order.
plan_round() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  step tests-kernels 600 env KVSCALE_KERNEL_TESTS=1 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels
  step tests-gpu 480 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu \
    --ignore=tests/gpu/test_tensor_parallel_cuda.py
  bench base 300 ckpt,ceilings,ours
  bench fp8 360 fp8
  step accuracy 240 python3 bench/fp8_accuracy.py --model "$CKPT" --tokens 4096 \
    --seq-len 1024 --out "$RES/fp8_accuracy.json"
  bench int4 300 int4
  step w4a16-gemm 180 python3 bench/kernels.py --only w4a16 --out-dir "$RES"
  bench piecewise 420 piecewise,serve-piecewise --piecewise-concurrency 256
  bench serve 300 serve --concurrency 1,64,256
  bench structured 150 structured
  bench peers 300 peer-latency,peer-a
}

# Issues 23 and 24 on nvidia-h200-x2 / nvidia-h100-x2: every single-GPU test, one GPU per
# group (the 8B-shaped checkpoint is written on GPU 0 first), then the TP=2 tests and the
# TP=1 vs TP=2 measurements on both. pytest-timeout gives each hung test its stack.
# tests/kernels natively takes ~8-10 minutes: the prefill file alone ~5 (r17: two tile
# configs compiled per case).
plan_x2() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  (export CUDA_VISIBLE_DEVICES=0
   ckpt_write 300
   step tests-kernels 600 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels) &
  (export CUDA_VISIBLE_DEVICES=1
   step tests-gpu 600 "${pt[@]}" tests/gpu --ignore=tests/gpu/test_tensor_parallel_cuda.py) &
  wait
  step tests-tp 300 "${pt[@]}" tests/gpu/test_tensor_parallel_cuda.py
  bench tp 600 ceilings,tp1,tp2,allreduce
  bench serve-tp 600 serve,serve-tp2 --concurrency 64,256
}

# Issue 24 on 2 GPUs: the one-shot all-reduce (kernel test against NCCL, its time alone
# per row count: where it stops beating NCCL), then TP=1 vs TP=2 with it and TP=2 without
# it (NCCL only) in one run, the TP=2 GPU tests and D at TP=2. r18b ran it without the
# all-reduce and serve-tp steps; r18 (the first version) also ran tests/kernels/
# test_elementwise.py beside ckpt. About 17 minutes.
plan_tp() {
  facts
  ckpt_beside tests-one-shot 240 "${PT[@]}" tests/gpu/test_one_shot_cuda.py
  step all-reduce 240 python3 bench/all_reduce.py --out-dir "$RES"
  bench tp 400 ceilings,tp1,tp2,tp2-nccl
  # a process of its own: only a process's first TP engine sets up the one-shot path
  bench tp-profile 200 allreduce
  step tests-tp 400 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py
  bench serve-tp 600 serve,serve-tp2 --concurrency 64,256
}

# Issue 23 on one GPU (about 25 minutes): the GPU tests this round changed, then the
# measurements in priority order (the 2-GPU lease of 2026-11-26 ran every other GPU test).
plan_single() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write 300
  step tests-gpu 360 "${pt[@]}" tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py \
    tests/gpu/test_engine_cuda.py tests/gpu/test_structured_cuda.py
  bench base 300 ceilings,ours
  bench spec 540 spec
  bench fp8 360 fp8
  step accuracy 240 python3 bench/fp8_accuracy.py --model "$CKPT" --tokens 4096 \
    --seq-len 1024 --out "$RES/fp8_accuracy.json"
  bench int4 300 int4
  bench prefix 300 prefix
  bench serve 300 serve --concurrency 1,16,64,256
}

# Plans already run are removed once their results are committed: each results README
# names its plan (plan_rNN) and the commit it ran at, and
# `git log -S 'plan_rNN()' -- bench/gpu_lease.sh` finds its text. What follows is owed.

serve_d() {  # serve_d NAME [VAR=VALUE ...]: D at c=256, one server, in $RES/NAME
  local name=$1
  shift
  step "$name" 150 env "$@" python3 bench/engine_bench.py --out-dir "$RES/$name" \
    --ckpt "$CKPT" --phases serve --concurrency 256
}

# r86 (one H200 or H100, ~16 minutes; NOTES "e73 and e74 measured", e75): is a decode step
# slower when piecewise graphs were captured too? C default against auto, alternated twice
# on one machine, an engine a process; the decode step by kernel under each; then B default
# and with pieces, whose steps now carry their GPU time (decode_gpu_ms); D by default and
# with pieces at three prefill chunk sizes, and A and B at 1,024 against the default (e76).
plan_r86() {
  facts
  ckpt_write
  local round
  for round in 1 2; do
    run_phase "c-$round" 150 c
    run_phase "c-auto-$round" 150 c-auto
  done
  run_phase kernels-default 150 decode-kernels
  run_phase kernels-auto 150 decode-kernels-auto
  run_phase b-1 120 b
  run_phase b-pieces-eager-1 150 b-pieces-eager
  # D at c=256 with pieces and prefill chunks that every piece covers (1,024 tokens) or
  # twice that, against pieces at the default 8,192 (e76)
  serve_d d-default
  local chunk
  for chunk in 8192 1024 2048; do
    step "d-pieces-$chunk" 150 python3 bench/engine_bench.py --out-dir "$RES/d-pieces-$chunk" \
      --ckpt "$CKPT" --phases serve-pieces-eager --piecewise-concurrency 256 \
      --serve-args="--max-num-batched-tokens $chunk"
  done
  # what 1,024-token steps cost the offline workloads (A: 256 prompts of 512 at once)
  run_phase a-1 120 a
  for w in a b; do
    step "$w-1024" 150 python3 bench/engine_bench.py --out-dir "$RES/$w-1024" --ckpt "$CKPT" \
      --phases "$w" --engine-arg max_num_batched_tokens=1024
  done
}

# r87 (one H100 or H200, ~6 minutes; NOTES e78): ideally on the kind of issue 23's targets, with
# the code of 2026-12-06: C under auto and by default (the collector's passes in each,
# each step's host and GPU time), speculative decoding against bf16 in the same run
# (n-gram, the draft pair in process and as a sidecar), the ceilings (C's floor, B's
# bound) with C, A and B, int4 C.
plan_r87() {
  facts
  ckpt_write
  # e77's C under auto, +0.1 ms: is it the collector? (each C now records its passes)
  run_phase c-auto 150 c-auto
  run_phase c-default 150 c
  # ... or the number of graphs held: 2 piece sizes (66 graphs) instead of 40 (1,320)
  step c-auto-2sizes 150 python3 bench/engine_bench.py --out-dir "$RES/c-auto-2sizes" \
    --ckpt "$CKPT" --phases c-auto --engine-arg piecewise_capture_sizes=512,1024
  bench spec 300 spec
  bench base 300 ceilings,ours
  bench int4 200 int4
}

case "$1" in
  start)
    rm -f "$RES/finished"
    setsid bash -c "bash bench/gpu_lease.sh plan_$2 > '$RES/plan.txt' 2>&1; echo done > '$RES/finished'" \
      < /dev/null > /dev/null 2>&1 &
    ;;
  wait)
    deadline=$((SECONDS + $2))
    while [ ! -f "$RES/finished" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    cat "$RES/log.txt"
    [ -f "$RES/finished" ] && echo "plan finished"
    for f in "$RES"/tests-*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 4 "$f"; }; done
    # one archive: the device tool returns at most 8 files
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" --exclude='compile-cache*' \
      --exclude='*.safetensors' -C "$RES" .
    ;;
  plan_*)
    "$1"
    ;;
esac
