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
  # what else holds the CPUs as each step starts (r88's B ran at 0.70x r86's)
  { echo "=== [$name]"; top -b -n 2 -d 0.5 -w 160 | awk '/^top -/ {n++} n == 2' | head -14
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; } \
    >> "$RES/top.txt" 2>&1
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

engine_args() {  # engine_args PHASE NAME KEY=VALUE...: one engine_bench phase, an engine
  # of its own with these settings, in $RES/NAME
  local phase=$1 name=$2 args=()
  shift 2
  for kv in "$@"; do args+=(--engine-arg "$kv"); done
  step "$name" 200 python3 bench/engine_bench.py --out-dir "$RES/$name" --ckpt "$CKPT" \
    --phases "$phase" "${args[@]}"
}

b_args() { engine_args b "$@"; }  # b_args NAME KEY=VALUE...: workload B
c_args() { engine_args c "$@"; }  # c_args NAME KEY=VALUE...: workload C

b_seqs() {  # b_seqs MAX_NUM_SEQS NAME: workload B, an engine of its own, in $RES/NAME
  b_args "$2" "max_num_seqs=$1"
}

# Builds a variant of this tree from a patch (bench/patches) for a plan to measure.
variant_tree() {  # variant_tree PATCH NAME: a copy of this tree in /tmp/NAME with
  # bench/patches/PATCH applied, installed in place of the current (install_tree . head undoes it)
  rm -rf "/tmp/$2" && mkdir -p "/tmp/$2"
  tar -c --exclude=./.git --exclude=./.whl --exclude=./.venv --exclude=./bench/results . |
    tar -x -C "/tmp/$2"
  (cd "/tmp/$2" && patch -p1 < "bench/patches/$1") > "$RES/patch-$2.log" 2>&1
  install_tree "/tmp/$2" "$2"
}

# Plans already run are removed once their results are committed: each results README
# names its plan (plan_rNN) and the commit it ran at, and
# `git log -S 'plan_rNN()' -- bench/gpu_lease.sh` finds its text. What follows is owed.

serve_c64() {  # serve_c64 NAME [FLAGS]: D at c=64 on a server of its own, in $RES/NAME,
  # with each request's TTFT and inter-token latencies
  step "$1" 150 python3 bench/engine_bench.py --out-dir "$RES/$1" --ckpt "$CKPT" \
    --phases serve --concurrency 64 --serve-detailed "--serve-args=${2:-}"
}

plan_r110() {  # e102 (one H100, ~10 minutes): `auto` now takes piecewise graphs for FP8 at
  # load; D c=64 with it, bf16 under `auto`, FP8's and bf16's defaults
  facts
  ckpt_write
  serve_c64 fp8-auto "--quantization=fp8 --cuda-graph-mode=auto --log-level info"
  serve_c64 bf16-auto "--cuda-graph-mode=auto --log-level info"
  serve_c64 fp8-default --quantization=fp8
  # bf16 default with and without the detailed client (r109's 10.04 / 10.91 ms against
  # r106's 8.91: the client's --save-detailed is the one change between them)
  step bf16-plain 150 python3 bench/engine_bench.py --out-dir "$RES/bf16-plain" --ckpt "$CKPT" \
    --phases serve --concurrency 64
  serve_c64 bf16-default
  serve_c64 fp8-auto-2 "--quantization=fp8 --cuda-graph-mode=auto"
  step itl 30 python3 bench/serve_itl.py "$RES"/*/serve_kvscale_c64.json
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
