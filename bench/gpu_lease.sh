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

# Issue 23, second single-GPU lease: the speculative phase and the FP8 accuracy script
# (both failed in the first for bench bugs), and the GPU tests fixed after it.
plan_spec() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  ckpt_write 300
  step tests-gpu 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150 \
    tests/gpu/test_spec_cuda.py "tests/gpu/test_engine_cuda.py::test_fp8_engine_with_cuda_graphs_matches_eager" \
    "tests/gpu/test_engine_cuda.py::test_fp8_kv_cache_with_cuda_graphs_matches_eager"
  bench spec 420 spec
  step accuracy 240 python3 bench/fp8_accuracy.py --model "$CKPT" --tokens 4096 \
    --seq-len 1024 --out "$RES/fp8_accuracy.json"
}

# Issue 23, third single-GPU lease: the FP8 graph tests by logprobs, and verify steps as
# piecewise graphs.
plan_pw() {
  ckpt_write 300
  step tests-fp8 200 python3 -m pytest -q -s -p no:cacheprovider --tb=short --timeout=150 \
    "tests/gpu/test_engine_cuda.py::test_fp8_engine_with_cuda_graphs_matches_eager" \
    "tests/gpu/test_engine_cuda.py::test_fp8_kv_cache_with_cuda_graphs_matches_eager"
  bench spec-piecewise 360 spec-piecewise
}

plan_pw2() {
  ckpt_write 300
  bench spec-piecewise 360 spec-piecewise
}

# Issue 23, 2026-11-26 second session (one GPU): this session's changes first (verify steps
# and draft steps replaying decode graphs, the one-kernel FP8 activation quantization, the
# one-row W4A16 GEMV), then what no lease has measured yet (piecewise graphs, prefix
# caching's noise and TTFT, the transformers peers). Tests run beside the checkpoint write.
plan_r3() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write 300 &
  (step tests-kernels 240 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_fp8_gemm.py \
     tests/kernels/test_w4a16.py
   step tests-gpu 420 "${pt[@]}" -s tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py \
     tests/gpu/test_engine_cuda.py) &
  wait
  bench base 300 ceilings,ours
  bench spec 420 spec
  bench fp8 360 fp8
  bench int4 300 int4
  step w4a16-gemm 300 python3 bench/kernels.py --only w4a16 --w4a16-sweep --out-dir "$RES"
  bench piecewise 480 piecewise,serve-piecewise --piecewise-concurrency 256
  step profile-piecewise 240 python3 bench/profile_step.py --ckpt "$CKPT" \
    --modes full_decode_only,full_and_piecewise --sections 4 \
    --compile-cache-dir "$RES/compile-cache"
  bench prefix 420 prefix,prefix-noise
  bench peers 300 peer-latency,peer-a
}

# The same session's second lease (one call, under 10 minutes): the GPU tests fixed after
# r3 (the FP8 reference's division, the draft's graphs, speculation past batch 8), the
# GEMV layouts, int4 C with the new default, and piecewise graphs (each phase in its own
# process: r3's piecewise engine held its weights through Dynamo and starved the next).
plan_r4() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write 120 &
  (step tests-kernels 150 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_fp8_gemm.py \
     tests/kernels/test_w4a16.py -k "quantize_groups or gemv or 8b_shapes or graph"
   step tests-gpu 170 "${pt[@]}" -s tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py) &
  wait
  step w4a16-gemm 100 python3 bench/kernels.py --only w4a16 --w4a16-sweep --out-dir "$RES"
  bench int4 60 int4
  bench piecewise 130 piecewise
  bench serve-piecewise 150 serve-piecewise --piecewise-concurrency 256
}

# Next single-GPU lease: what r3/r4 left unmeasured. B with and without piecewise graphs
# (r3 and r4 lost it: a piecewise engine's memory outlived it in the bench process; the
# GPU test below says what holds it), the warm start in a process of its own, int4 C with
# the GEMV defaults chosen from r4's sweep.
plan_next() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write 120 &
  step tests-gpu 200 "${pt[@]}" tests/gpu/test_piecewise_cuda.py tests/gpu/test_int4_cuda.py &
  wait
  bench int4 150 int4
  bench piecewise 200 piecewise
  bench piecewise-warm 120 piecewise-warm
}

# Issue 23/18, 2026-11-26 third session (one GPU): the GPU tests no lease has run since
# their last change (piecewise free-memory, int4 after the GEMV refactor, the engine after
# the FP8 reference fix, draft and spec after the sidecar's array bookkeeping), the host
# costs of speculation on this machine's CPU (n-gram proposals for 256 sequences, the
# sidecar's round trip), where a batch-1 decode step's GPU time goes, then the measurements
# r3/r4 left: speculation at batch 16 forced on, int4 C with the GEMV defaults, piecewise
# graphs' B and warm start.
plan_r5() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write &
  (step tests-kernels 150 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_w4a16.py \
     tests/kernels/test_fp8_gemm.py
   step tests-gpu 330 "${pt[@]}" -s tests/gpu/test_piecewise_cuda.py tests/gpu/test_int4_cuda.py \
     tests/gpu/test_engine_cuda.py tests/gpu/test_draft_cuda.py tests/gpu/test_spec_cuda.py) &
  wait
  step tests-host 150 "${pt[@]}" -s tests/test_ngram_proposer.py tests/test_draft_sidecar.py
  bench decode-kernels 120 decode-kernels
  bench base 150 ceilings,ours
  bench spec 360 spec
  bench int4 150 int4
  bench piecewise 200 piecewise
  bench piecewise-warm 120 piecewise-warm
}

# Issue 18, 2026-11-26 fourth session (one GPU): the n-gram lookup on the GPU (kernel
# tests natively, greedy identity and its cost for 256 sequences beside the host
# proposer's), the sidecar client polling through the GPU draft's time (round trip beyond
# the model), then every speculation configuration at batch 1 and 16 with the default
# pause at 16 and the empty-proposal back-off.
plan_r7() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write &
  (step tests-kernels 120 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_ngram_match.py
   step tests-gpu 300 "${pt[@]}" -s tests/gpu/test_spec_cuda.py) &
  wait
  step tests-draft 200 "${pt[@]}" -s tests/gpu/test_draft_cuda.py
  step tests-host 100 "${pt[@]}" -s tests/test_draft_sidecar.py -k "stand_in or polls_through"
  bench spec 420 spec
}

# Issue 18, lease r9: the spec tests, where a speculative step's time goes at batch 1
# (bench/profile_spec.py), then the spec bench.
plan_r9() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write &
  (step tests-kernels 120 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_ngram_match.py
   step tests-gpu 300 "${pt[@]}" -s tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py) &
  wait
  step profile-spec 240 python3 bench/profile_spec.py --ckpt "$CKPT"
  bench spec 420 spec
}

# lease r9b: only the spec-step profile (r9's ran out of memory after its first engine)
plan_r9b() {
  ckpt_write
  step profile-spec 300 python3 bench/profile_spec.py --ckpt "$CKPT"
}

# Issue 23, 2026-11-26 sixth session (one GPU): the W4A16 kernels with the codes turned
# into floats by the 2**23 bit trick and split-K summed inside the product kernel:
# kernel tests natively, the per-layer times with the sweep (FIXUP 0 = the old second
# kernel), int4 C against bf16 C, and where int4 C's step goes.
plan_r10() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write &
  (step tests-kernels 200 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_w4a16.py
   step kernels-w4a16 200 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep) &
  wait
  step tests-gpu 200 "${pt[@]}" -s tests/gpu/test_int4_cuda.py
  bench int4 200 int4
  bench decode-kernels-int4 120 decode-kernels-int4
}

# r10b: a second GEMV (GEMV 2: first unpacking by nibble, then, in r10b's second call,
# prefetching the next tile) beside r10's (GEMV 1): kernel tests natively and the sweep,
# which picks the default for r10c (the engine's int4 C). Both GEMV 2 variants were removed
# after r10b; the plan now sweeps the one GEMV.
plan_r10b() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  step tests-kernels 200 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_w4a16.py
  step kernels-w4a16 200 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
}

plan_r10c() {
  ckpt_write
  bench int4 200 int4
  bench decode-kernels-int4 120 decode-kernels-int4
}

# Issue 23, r11: prefix caching's cost at a 0% hit rate, per engine (as in e13) and in
# one engine with the runs interleaved, after the scheduler stopped slicing every
# sequence's hash list on every step.
plan_r11() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  ckpt_write
  bench prefix-noise 240 prefix-noise
  bench prefix-interleaved 240 prefix-interleaved
}

# r11b: the per-engine comparison with the engines in the other order (caching on first)
plan_r11b() {
  ckpt_write
  bench prefix-noise-reversed 240 prefix-noise-reversed
}

# Issue 23, r12: the GPU checks still owed to the code as it stands: the int4 kernels and
# engine after the in-kernel split-K sum, the n-gram kernel after its shared argument
# check, speculative decoding after `Speculator.follows_verify`, and the sidecar's round
# trip on this host.
plan_r12() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  step tests-kernels 200 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_w4a16.py \
    tests/kernels/test_ngram_match.py
  step tests-gpu 330 "${pt[@]}" -s tests/gpu/test_int4_cuda.py tests/gpu/test_spec_cuda.py \
    tests/gpu/test_draft_cuda.py
}

# r12b: the sidecar's round trip beyond its model on this host, with a CPU stand-in for
# the draft (bench/profile_sidecar.py), beside the real bf16 GPU draft's (the GPU test).
plan_r12b() {
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  step profile-sidecar 120 python3 bench/profile_sidecar.py --model-ms 0,7.8,0,7.8
  step profile-sidecar-cuda 60 python3 bench/profile_sidecar.py --model-ms 7.8 --cuda
  step profile-sidecar-prof 60 python3 bench/profile_sidecar.py --model-ms 7.8 --profile
  step tests-sidecar 120 "${pt[@]}" -s \
    tests/gpu/test_draft_cuda.py::test_sidecar_on_cuda_round_trip
}

# Next single-GPU lease (e22, e23), two calls. r13: the GPU tests owed since r12 (the
# draft runner's decode-step layout; the fused rotary + KV-write kernel natively and in
# the engine on CUDA), where a batch-1 decode step's GPU time goes with the fused kernel,
# C/A/B, and the elementwise kernels. r13b: the draft runner's host time on CUDA and the
# draft pair's speed.
plan_r13() {
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_write &
  step tests-kernels 150 env KVSCALE_KERNEL_TESTS=1 "${pt[@]}" tests/kernels/test_rope_kv_cache.py \
    tests/kernels/test_argmax.py tests/kernels/test_elementwise.py tests/kernels/test_kv_cache.py tests/kernels/test_fp8_kv.py
  step tests-gpu 360 "${pt[@]}" -s tests/gpu/test_engine_cuda.py tests/gpu/test_draft_cuda.py \
    tests/gpu/test_spec_cuda.py tests/gpu/test_piecewise_cuda.py
  wait
  bench decode-kernels 90 decode-kernels
  bench ours 150 ours
  step kernels-elementwise 90 python3 bench/kernels.py --out-dir "$RES" --only elementwise
}

plan_r13b() {
  ckpt_write &
  step profile-draft 120 python3 bench/profile_draft_runner.py --device cuda
  wait
  step profile-spec 200 python3 bench/profile_spec.py --ckpt "$CKPT" --configs none,draft
  bench spec 300 spec
}

# r14: is r13's slower A and B (8,917 and 7,436 tok/s against r5's 9,332 and 8,309) the
# code or the host? The same bench on one machine: HEAD, the code r5 measured (76583c1),
# the code of r12 (104fe83), HEAD again. Each tree is an untracked copy made here before
# the call (`mkdir ab-old && git archive 76583c1 | tar -x -C ab-old`; ab-mid the same),
# installed editable in turn.
plan_r14() {
  facts
  ckpt_write
  local tree
  for tree in . ab-old ab-mid .; do
    local name=ours-${tree#ab-}; [ "$tree" = . ] && name=ours-head
    [ -d "$RES/$name" ] && name=$name-2
    install_tree "$tree" "$name"
    step "$name" 150 python3 "$tree/bench/engine_bench.py" --out-dir "$RES/$name" --ckpt "$CKPT" \
      --phases ours
  done
}

# r15: where a mixed step's host time goes (B's and D c=256's steps are host-bound):
# profile_step's mixed-step launch times (section 4) and its cProfile of ten mixed steps
# (section 5), eager and piecewise.
plan_r15() {
  facts
  ckpt_write
  step profile-mixed 400 python3 bench/profile_step.py --ckpt "$CKPT" --sections 45 \
    --modes full_decode_only,full_and_piecewise
}

# r16 (e26): decode rows of mixed steps in 16-row tiles. The kernel tests natively, the
# small tiles' sweep, the attention kernels with the B-shaped mixed step, B eager and
# piecewise with this code and with the code before it (ab-prev: `git archive a34a871`)
# on one machine, then the engine's GPU tests.
# ckpt_and_prefill_tests LIMIT PER_TEST: the prefill and FP8-KV kernel tests natively
# while the checkpoint is written
ckpt_and_prefill_tests() {
  ckpt_write &
  step tests-kernels "$1" env KVSCALE_KERNEL_TESTS=1 python3 -m pytest -q -p no:cacheprovider -rs \
    --tb=short --timeout="$2" tests/kernels/test_paged_prefill.py tests/kernels/test_fp8_kv.py
  wait
}

plan_r16() {
  facts
  local pt=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --timeout=150)
  ckpt_and_prefill_tests 150 150
  step tune-short 90 python3 bench/tune_kernels.py --only short
  step kernels-attention 120 python3 bench/kernels.py --out-dir "$RES" --only attention
  bench b-head 200 piecewise
  install_tree ab-prev prev
  step b-prev 200 python3 ab-prev/bench/engine_bench.py --out-dir "$RES/prev" --ckpt "$CKPT" \
    --phases piecewise
  install_tree . head
  step tests-gpu 240 "${pt[@]}" -s tests/gpu/test_engine_cuda.py tests/gpu/test_spec_cuda.py
}

# r17: the prefill kernel's native tests in full (r16's ran out of time compiling both
# tile configs of every case), then D at c=256 eager and piecewise after the small tiles.
plan_r17() {
  facts
  ckpt_and_prefill_tests 480 300
  bench serve-pw 420 serve-piecewise --piecewise-concurrency 256
}

# r19 (issue 24, and issue 18's sidecar overhead on that host): plan_tp with the sidecar's
# round trip timed first (CPU only, a few seconds).
plan_r19() {
  step sidecar 60 python3 bench/profile_sidecar.py --model-ms 0,7.8 --steps 200
  plan_tp
}

# r19b: r19's TP=2 engines ended their processes in "terminate called" (exit 134) and a
# TP=2 serve engine did not stop in 10 s: bench/tp_shutdown.py's variants say where;
# then the one-shot path for sums of up to 2,048 rows (r19's sweep: it beats NCCL at
# every size to 2,048): C, A, the TP tests, D.
plan_r19b() {
  facts
  # r19b ran tp_shutdown.py as of 614399e: variants one-shot, nccl, one-shot-released
  # (failed: a frozen dataclass), one-shot-no-leave
  ckpt_beside tp-shutdown 240 python3 bench/tp_shutdown.py --out-dir "$RES" --hang-s 45 \
    --variants one-shot,nccl,no-leave
  bench tp 300 ceilings,tp1,tp2,tp2-nccl
  step tests-tp 330 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py
  bench serve-tp 300 serve,serve-tp2 --concurrency 64,256
}

# Next 2-GPU lease (issue 24, ~15 minutes): the shutdown with the graphs dropped first
# (tp_shutdown: one-shot and nccl should leave the group in well under 10 s, keep-graphs
# should not); the one-shot kernel's push version (its GPU test, the per-launch sweep
# against r19's pull numbers, C and A); the TP tests (the fp32 test now checks the
# shutdown); D at TP=2 twice, to see D c=256's spread (r19 14.35 ms, r19b 16.26).
plan_r20() {
  facts
  ckpt_beside tp-shutdown 240 python3 bench/tp_shutdown.py --out-dir "$RES" --hang-s 45 \
    --variants one-shot,nccl,keep-graphs
  step tests-one-shot 240 "${PT[@]}" tests/gpu/test_one_shot_cuda.py
  step all-reduce 240 python3 bench/all_reduce.py --out-dir "$RES"
  bench tp 300 ceilings,tp1,tp2,tp2-nccl
  step tests-tp 330 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py
  bench serve-tp 300 serve,serve-tp2 --concurrency 64,256
  mkdir -p "$RES/again"
  step serve-tp2-again 200 python3 bench/engine_bench.py --out-dir "$RES/again" \
    --ckpt "$CKPT" --phases serve-tp2 --concurrency 64,256
}

# Next single-GPU lease (issue 23, on an H100: its targets are H100 figures; ~15 minutes):
# the baseline workloads on HEAD with repeats, which the issue asks for (C, A and B three
# times, D at c=64 and 256 twice: spread, not one run), after the engine's GPU tests.
plan_r21() {
  facts
  ckpt_write 300
  step tests-gpu 300 "${PT[@]}" tests/gpu/test_engine_cuda.py
  local i
  for i in 1 2 3; do
    mkdir -p "$RES/ours-$i"
    step "ours-$i" 200 python3 bench/engine_bench.py --out-dir "$RES/ours-$i" --ckpt "$CKPT" \
      --phases ceilings,ours
  done
  for i in 1 2; do
    mkdir -p "$RES/serve-$i"
    step "serve-$i" 240 python3 bench/engine_bench.py --out-dir "$RES/serve-$i" --ckpt "$CKPT" \
      --phases serve --concurrency 64,256
  done
}

# r22 (one H100, issues 23 and 18; as it ran at b0c5a42: --best-nibble and the nibble
# GEMV's setting are gone since 6aec381, where that GEMV became the only one): the nibble GEMV (GEMV 2, NOTES e33) natively and in the
# sweep beside the tile GEMV; int4 C with the tile GEMV and with the sweep's best nibble
# tiles (KVSCALE_W4A16_NIBBLE), each against bf16 in its own run; the FP8 GEMM's rate
# against bf16 (bench/fp8_mm.py); the sidecar's overhead on this host; then C, A, B and D
# (c=64, 256: the API process's changes, NOTES e32) once.
plan_r22() {
  facts
  ckpt_write &
  (step tests-w4a16 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py
   step kernels-w4a16 240 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep) &
  wait
  bench int4 200 int4
  local nib
  nib=$(python3 bench/kernels.py --best-nibble "$RES/w4a16_sweep.json")
  echo "best nibble tiles: ${nib:-none}" >> "$RES/log.txt"
  if [ -n "$nib" ]; then
    mkdir -p "$RES/nibble"
    step int4-nibble 200 env KVSCALE_W4A16_NIBBLE="$nib" python3 bench/engine_bench.py \
      --out-dir "$RES/nibble" --ckpt "$CKPT" --phases int4
  fi
  step fp8-mm 150 python3 bench/fp8_mm.py --out-dir "$RES"
  step profile-sidecar 120 python3 bench/profile_sidecar.py --model-ms 0,7.8,0,7.8
  bench ours 200 ceilings,ours
  bench serve 240 serve --concurrency 64,256
}

# r23 (one H100, issue 23): the GEMV as default (natively, the int4 GPU tests, int4 C, the
# sweep's heuristic rows), the FP8 GEMM's rate with the quantization kernel (bench/fp8_mm.py
# fixed), A's decode step kernel by kernel in bf16, FP8 weights and FP8 weights + KV, C, A,
# B a second time today, and D (c=64, 256) with the default graphs and with piecewise ones.
plan_r23() {
  facts
  ckpt_write &
  step tests-w4a16 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py
  wait
  step tests-int4 200 "${PT[@]}" tests/gpu/test_int4_cuda.py
  bench int4 200 int4
  step fp8-mm 150 python3 bench/fp8_mm.py --out-dir "$RES"
  bench decode-kernels-a 300 decode-kernels-a
  bench ours 200 ceilings,ours
  step kernels-w4a16 240 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
  bench serve 240 serve --concurrency 64,256
  bench serve-piecewise 420 serve-piecewise --piecewise-concurrency 64,256
}

# r24 (one H100, issue 23; ran 2026-11-27, NOTES e36-e38 measured): FP8 after fast accumulation and the fp16 read
# of an FP8 KV cache (NOTES e36), the W4A16 GEMV's MAGIC and mask-free loop (e37): kernel
# tests, the W4A16 sweep, A's decode step, the fp8 phase (C, A, D
# c=64 for FP8 weights and weights + KV) and the accuracy script against bf16; then D
# from a cold Triton cache, twice, with the three-request warm-up (e35's first-server
# penalty).
plan_r24() {
  facts
  ckpt_write &
  step tests-fp8 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_fp8_kv.py \
    tests/kernels/test_paged_decode.py tests/kernels/test_w4a16.py
  wait
  step kernels-w4a16 300 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
  bench decode-kernels-a 300 decode-kernels-a
  step fp8-mm 150 python3 bench/fp8_mm.py --out-dir "$RES"
  bench fp8 360 fp8
  step accuracy 240 python3 bench/fp8_accuracy.py --model "$CKPT" --tokens 4096 \
    --seq-len 1024 --out "$RES/fp8_accuracy.json"
  rm -rf "$HOME/.triton/cache"
  mkdir -p "$RES/cold" "$RES/warm"
  step serve-cold 240 python3 bench/engine_bench.py --out-dir "$RES/cold" --ckpt "$CKPT" \
    --phases serve --concurrency 64,256
  step serve-warm 240 python3 bench/engine_bench.py --out-dir "$RES/warm" --ckpt "$CKPT" \
    --phases serve --concurrency 64,256
}

# r25 (2 GPUs, issue 24; next session): where C's TP=2 step goes with the push kernel
# (the allreduce profile: rank 0's kernels at batch 1 and 64), C and A at TP=1 / TP=2
# once more, and the single-GPU files owed since this session's kernel changes on GPU 1
# while GPU 0 writes the checkpoint.
plan_r25() {
  facts
  ckpt_beside tests-kernels 300 env CUDA_VISIBLE_DEVICES=1 KVSCALE_KERNEL_TESTS=1 \
    "${PT[@]}" tests/kernels/test_w4a16.py tests/kernels/test_fp8_kv.py \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_paged_decode.py
  bench tp-profile 200 allreduce
  bench tp 300 ceilings,tp1,tp2
}

# r26 (one H100, issue 23; ran 2026-11-27, NOTES e39 measured): FP8 activations quantized by the norm and SiLU-and-mul kernels,
# the W4A16 GEMV's 128-row tiles (NOTES e39): the changed kernels' tests natively and the
# FP8 engine GPU tests, A's decode step, bf16 C/A/B beside the fp8 phase (FP8 A's ratio in
# one lease), int4 C; then the int4 engine tests and the accuracy script.
plan_r26() {
  facts
  ckpt_write &
  step tests-kernels 280 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_elementwise.py \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_w4a16.py
  wait
  step tests-fp8 240 "${PT[@]}" tests/gpu/test_engine_cuda.py -k fp8
  bench decode-kernels-a 200 decode-kernels-a
  bench ours 200 ours
  bench fp8 300 fp8
  bench int4 200 int4
  step tests-int4 200 "${PT[@]}" tests/gpu/test_int4_cuda.py
  step accuracy 150 python3 bench/fp8_accuracy.py --model "$CKPT" --tokens 4096 \
    --seq-len 1024 --out "$RES/fp8_accuracy.json"
}

# r27 (one H100, issue 23; next session): why r26's GPTQ int4 C (4.17 ms) fell behind AWQ's
# (3.47) after the GEMV's 128-row tiles: the W4A16 sweep (its default GEMV also without
# zero points, in 128- and 64-row tiles), the int4 phase twice, the GPTQ model's decode
# step kernel by kernel; and the FP8 engine tests with the fused quantization's new one.
plan_r27() {
  facts
  ckpt_write &
  step tests-fp8 240 "${PT[@]}" -s tests/gpu/test_engine_cuda.py -k fp8
  wait
  step kernels-w4a16 240 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv \
    > "$RES/gpu-apps-before-int4.txt" 2>&1  # r26: was another process still on the GPU?
  bench int4 200 ours,int4
  mv "$RES/phase_int4.json" "$RES/phase_int4_first.json"
  bench int4-again 200 int4
  bench decode-kernels-int4 200 decode-kernels-int4
}

# r28 and r29 ran at 66dab5e-1f93c28: the L2 prefetch and its phases were removed after r29
# measured no gain (NOTES e40).
# r28 (one H100, issue 23; NOTES e40): o_proj's weights prefetched into L2 on a side stream
# while the attention kernels run (l2_prefetch_max_batch): its GPU test (the same tokens
# with it, dense and FP8), C off and on in alternating engines, the decode step kernel by
# kernel with it on and off; then int4: GPTQ's GEMV in 64-row tiles, the prefetch with AWQ.
plan_r28() {
  facts
  ckpt_write &
  step tests-prefetch 200 "${PT[@]}" tests/gpu/test_engine_cuda.py -k "prefetch or graphs_match"
  wait
  bench prefetch 300 prefetch
  bench decode-kernels 150 decode-kernels
  bench int4 200 int4  # GPTQ in 64-row tiles now (r27's sweep)
  bench prefetch-int4 200 prefetch-int4
  bench decode-kernels-int4 150 decode-kernels-int4
}

# r29 (one H100, issue 23; NOTES e40): r28's prefetch phases again (r28's ran out of memory:
# the engine before was still referenced), beside the checkpoint's write the W4A16 kernel
# and engine tests natively (the symmetric GEMV's 64-row tiles).
plan_r29() {
  facts
  ckpt_write &
  step tests-int4 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py \
    tests/gpu/test_int4_cuda.py
  wait
  bench prefetch 300 prefetch
  bench prefetch-int4 200 prefetch-int4
}

# r30 (one H100, issue 23; NOTES e41): the symmetric GEMV through the zero-point variant (a
# shared row of 8s): the W4A16 kernel tests natively (the GEMV's and the 8B shapes'), the
# int4 engine tests, the sweep, GPTQ and AWQ int4 C, GPTQ's decode step kernel by kernel.
plan_r30() {
  facts
  ckpt_write &
  step tests-w4a16 150 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py \
    -k "8b or graph or gemv or symmetric or default"
  step tests-int4 150 "${PT[@]}" tests/gpu/test_int4_cuda.py
  wait
  step kernels-w4a16 120 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
  bench int4 150 int4
  bench decode-kernels-int4 100 decode-kernels-int4
}

# r32 (one H100, issue 23; NOTES e43): the packed W4A16 GEMV: its tests natively (and the
# GEMV's others), the sweep with its rows, int4 C as it stands. Ran in part by hand as r33
# (tests and sweep, at 2896cdc); the packed GEMV was removed after it (NOTES e43 measured).
plan_r32() {
  facts
  ckpt_write &
  step tests-w4a16 200 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py \
    -k "packed or 8b or gemv or graph"
  wait
  step kernels-w4a16 200 python3 bench/kernels.py --out-dir "$RES" --only w4a16 --w4a16-sweep
  bench int4 150 int4
}

# r34 ran at 01deb3a: PDL, its tests and its phases were removed after r35 (NOTES e44 measured).
# r34 (one H100, issue 23; NOTES e44): programmatic dependent launch: its GPU tests, C in
# bf16 and with GPTQ int4 weights off/on twice, the kernels' native tests it touches, the
# engine tests, the int4 decode step's kernels, A off/on.
plan_r34() {
  facts
  ckpt_write &
  step tests-pdl 200 "${PT[@]}" tests/gpu/test_pdl_cuda.py
  wait
  bench pdl 300 pdl
  step tests-kernels 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_elementwise.py \
    tests/kernels/test_rope_kv_cache.py tests/kernels/test_paged_decode.py \
    tests/kernels/test_w4a16.py -k "not w4a16 or 8b or graph or gemv or symmetric or default"
  step tests-engine 300 "${PT[@]}" tests/gpu/test_int4_cuda.py tests/gpu/test_engine_cuda.py
  bench decode-kernels-int4 100 decode-kernels-int4
  bench pdl-a 300 pdl-a
}

int4_round() {  # int4_round FILTER: W4A16 tests natively (-k FILTER) beside the
  # checkpoint's write, int4 C, the int4 engine tests, GPTQ's decode step kernel by kernel
  facts
  ckpt_write &
  step tests-w4a16 200 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py -k "$1"
  wait
  bench int4 150 int4
  step tests-int4 150 "${PT[@]}" tests/gpu/test_int4_cuda.py
  bench decode-kernels-int4 100 decode-kernels-int4
}

# r35-r37 ran by hand (NOTES e44 and e45): bench/pdl_chain.py (since removed), Nsight
# Compute on the GEMV (bench/gemv_profile.py; at 3fbc797 with a --rowwise flag, since
# removed), the W4A16 tests and sweep with the word-row and TMA-fed forms (both since
# removed).
# r38 ran at d06472e; the word-row GEMV was removed after it (NOTES e45 measured).
# r38 (one H100, issue 23; NOTES e45): gate_up's GEMV a word row at a time: the W4A16
# tests natively, the int4 engine tests, int4 C (GPTQ, AWQ, bf16), GPTQ's decode step.
plan_r38() {
  int4_round "8b or graph or gemv or symmetric or default"
}

# r39 (one H100, issue 23): the checks owed at HEAD: the elementwise kernel tests natively
# (r34 ran them with PDL on), bench/fp8_mm.py (owed since 6a21a39), the whole W4A16 test
# file natively (r29 ran out of time at 52%).
plan_r39() {
  facts
  step tests-elementwise 150 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_elementwise.py
  step fp8-mm 150 python3 bench/fp8_mm.py --out-dir "$RES"
  step tests-w4a16 300 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_w4a16.py
}

# r40 ran at 3429182; the fusion was removed after it (NOTES e46 measured).
# r40 (one H100, issue 23; NOTES e46): SiLU-and-mul applied by the int4 down_proj's GEMV:
# its kernel tests natively, the int4 engine tests, int4 C, GPTQ's decode step.
plan_r40() {
  int4_round "gated or gemv or graph or 8b"
}

# r43 (one H100, issues 23 and 18; NOTES e47): the in-process draft's drafts left on the
# GPU for the verify step: the speculative and draft GPU tests, the draft pair with its
# drafts on the device and on the host in alternation (spec-device), where a batch-1 step
# goes now (profile_spec's trace).
plan_r43() {
  facts
  ckpt_beside tests-spec 300 "${PT[@]}" tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py
  step spec-device 600 python3 bench/engine_bench.py --out-dir "$RES" --ckpt "$CKPT" \
    --phases spec-device
  step profile-spec 300 python3 bench/profile_spec.py --ckpt "$CKPT" --configs none,draft \
    --trace "$RES/trace" --trace-steps 12
}

# r46 (one H100, issues 23 and 18; NOTES e48): the packed copy's sections as one
# as_strided view each: the engine, speculative and draft GPU tests, C/A/B (ours), the
# draft pair on the device and on the host again (spec-device), the step's host parts.
plan_r46() {
  facts
  ckpt_beside tests-gpu 420 "${PT[@]}" tests/gpu/test_engine_cuda.py \
    tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py
  step ours 600 python3 bench/engine_bench.py --out-dir "$RES" --ckpt "$CKPT" --phases ours
  step spec-device 600 python3 bench/engine_bench.py --out-dir "$RES" --ckpt "$CKPT" \
    --phases spec-device
  step profile-spec 300 python3 bench/profile_spec.py --ckpt "$CKPT" --configs none,draft \
    --detail
}

# r49 (one H100, issues 18 and 23; NOTES e49): the sidecar's per-step work in compiled
# code (sidecar_native.c): its round trip by function on this host, compiled and Python
# paths; the sidecar tests on this host's Python (the C build against the Python path);
# the speculative and draft GPU tests owed since 1ed748c; the draft pair in process and
# in the sidecar (spec), drafts on the device and on the host (spec-device).
plan_r49() {
  facts
  step sidecar-breakdown 200 python3 bench/sidecar_breakdown.py --model-ms 0,7.8 --steps 300
  step profile-sidecar 120 python3 bench/profile_sidecar.py --model-ms 0,7.8,0,7.8
  step profile-sidecar-py 120 env KVSCALE_NATIVE=0 python3 bench/profile_sidecar.py \
    --model-ms 0,7.8,0,7.8
  step tests-host 200 "${PT[@]}" tests/test_draft_sidecar.py
  ckpt_beside tests-spec 360 "${PT[@]}" tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py
  bench spec 420 spec
  bench spec-device 420 spec-device
}

# r50 (2 GPUs, issue 24; NOTES e50): the TP GPU tests on HEAD (the worker changed since
# r20: the packed copy's views, drafts on the device for one rank) with the new
# speculative TP=2 tests, then C and A at TP=1 and TP=2.
plan_r50() {
  facts
  ckpt_beside tests-tp 480 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py \
    tests/gpu/test_one_shot_cuda.py
  bench tp 300 ceilings,tp1,tp2
}

# r53 and r54 (one H100, single device calls): bench/gemm_rows.py's split-K variants (the
# 8B shapes and TP=2's per-rank shapes), the second with fp32 products (NOTES e51).
# r55 and r56 ran at 2b7d865 and 18b2d7a (plan_r55, plan_r56 there): split-K products for
# o_proj and down_proj summed by the norm after them (the engine, piecewise and speculative
# GPU tests, the norm's kernel tests natively, C off/on alternated, C's decode step by
# kernel off and on, C/A/B); removed after them (NOTES e51 measured).

# r57 (one H100, one device call): bench/int4_tinygemm.py at one row (NOTES e52).
# r58 (one H100, issue 23; NOTES e52): one bf16 row of int4 layers through tinygemm: the
# int4 GPU tests, the kernel against the GEMV at 1-8 rows, int4 C with the GEMV
# (KVSCALE_TINYGEMM=0) and with tinygemm alternated twice, GPTQ's decode step by kernel.
plan_r58() {
  facts
  ckpt_beside tests-int4 300 "${PT[@]}" tests/gpu/test_int4_cuda.py
  step tinygemm-rows 150 python3 bench/int4_tinygemm.py --out-dir "$RES" --rows 1,2,4,8
  for round in 1 2; do
    step "int4-gemv-$round" 200 env KVSCALE_TINYGEMM=0 python3 bench/engine_bench.py \
      --out-dir "$RES/gemv-$round" --ckpt "$CKPT" --phases int4
    step "int4-tinygemm-$round" 200 python3 bench/engine_bench.py \
      --out-dir "$RES/tinygemm-$round" --ckpt "$CKPT" --phases int4
  done
  bench decode-kernels-int4 120 decode-kernels-int4
}

# r59 (one H100, issue 23; NOTES e52): the int4 GPU tests after tinygemm's rows went to 4
# and its test got a concrete method (r58's two failures).
plan_r59() {
  facts
  step tests-int4 300 "${PT[@]}" tests/gpu/test_int4_cuda.py
}

# r60 (one H100, one device call): bench/int4_tinygemm.py --inner-k-tiles 2,4,8 (NOTES e52).
# r61 (one H100, issue 23): the checks owed at HEAD: the int4 GPU tests (tinygemm's input
# made contiguous, no empty batch), the two GEMM benches after their shared run_meta.
plan_r61() {
  facts
  step tests-int4 300 "${PT[@]}" tests/gpu/test_int4_cuda.py
  step gemm-rows 120 python3 bench/gemm_rows.py --out-dir "$RES" --rows 1 \
    --variants linear,split2f
  step int4-tinygemm 120 python3 bench/int4_tinygemm.py --out-dir "$RES" --rows 1 \
    --zeros zeros
}

# r62 (one H100, issue 23): tinygemm's copies kept within a share of the GPU's memory: the
# int4 GPU tests (the new one: no copy past the share), int4 C (the 8B model keeps them).
plan_r62() {
  facts
  ckpt_beside tests-int4 300 "${PT[@]}" tests/gpu/test_int4_cuda.py
  bench int4 240 int4
}

# r63 (one H100, issue 23): after the review's mends: the int4 GPU tests (their shared layer
# helper, finish() reading params_dtype) and bench/int4_tinygemm.py on the kernels' packing.
plan_r63() {
  facts
  step tests-int4 300 "${PT[@]}" tests/gpu/test_int4_cuda.py
  step int4-tinygemm 120 python3 bench/int4_tinygemm.py --out-dir "$RES" --rows 1 \
    --zeros symmetric,zeros
}

# r64 and r65 (one H100; 2 x H200) ran at 2fd42d2 (plan_r64, plan_r65 there): the decode
# graphs' L2 prefetch (its GPU tests, C off/on alternated at TP=1 and TP=2, TP=1's step by
# kernel); removed after them: C slower with it at both sizes (NOTES e54 measured).

# r66 (one H100, issue 23; NOTES e56): RoPE + KV write inside the decode kernel
# (KVSCALE_FUSED_DECODE=1): the decode, rotary and fused kernel tests natively, the engine
# and speculative GPU tests with it on, C with it off (the default) and on alternated
# three times, C's step by kernel with it on, the piecewise GPU tests with it on.
# The first try (2026-11-28 00:40) ran out of this session's device time before `wait`
# packed anything: nothing came back.
plan_r66() {
  facts
  ckpt_beside tests-kernels 300 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" \
    tests/kernels/test_paged_decode_rope.py tests/kernels/test_paged_decode.py \
    tests/kernels/test_rope_kv_cache.py
  step tests-gpu 420 env KVSCALE_FUSED_DECODE=1 "${PT[@]}" tests/gpu/test_engine_cuda.py \
    tests/gpu/test_spec_cuda.py
  for round in 1 2 3; do
    step "c-off-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/off-$round" --ckpt "$CKPT" --phases c
    step "c-on-$round" 150 env KVSCALE_FUSED_DECODE=1 python3 bench/engine_bench.py \
      --out-dir "$RES/on-$round" --ckpt "$CKPT" --phases c
  done
  step decode-kernels 120 env KVSCALE_FUSED_DECODE=1 python3 bench/engine_bench.py \
    --out-dir "$RES" --ckpt "$CKPT" --phases decode-kernels
  step tests-piecewise 240 env KVSCALE_FUSED_DECODE=1 "${PT[@]}" tests/gpu/test_piecewise_cuda.py
}

# tp_switch VAR (2 GPUs): the TP GPU tests with the switch VAR=1, then C at TP=2 and TP=1
# with VAR=0 and VAR=1, alternated twice (an engine a process)
tp_switch() {
  facts
  ckpt_beside tests-tp 420 env "$1=1" "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py
  for round in 1 2; do
    for mode in 0 1; do
      step "c-tp2-$mode-$round" 200 env "$1=$mode" python3 bench/engine_bench.py \
        --out-dir "$RES/tp2-$mode-$round" --ckpt "$CKPT" --phases c-tp2
      step "c-tp1-$mode-$round" 150 env "$1=$mode" python3 bench/engine_bench.py \
        --out-dir "$RES/tp1-$mode-$round" --ckpt "$CKPT" --phases c
    done
  done
}

# 2 GPUs: the fused decode path (KVSCALE_FUSED_DECODE) under TP=2, and C off/on at TP=2 and
# TP=1 alternated; the fused kernel's native test after its fp32 cache comparison was fixed
plan_r67() {
  tp_switch KVSCALE_FUSED_DECODE
  step tests-kernels 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" \
    tests/kernels/test_paged_decode_rope.py
}

# c_in_loop_rounds N: C of the tree in ab-prev, of HEAD, and of HEAD with the in-loop RoPE
# mode (KVSCALE_ROPE_IN_LOOP=1), an engine a process, N times in alternation
c_in_loop_rounds() {
  local round mode
  for round in $(seq "$1"); do
    install_tree ab-prev prev
    step "c-prev-$round" 150 python3 bench/engine_bench.py --out-dir "$RES/prev-$round" \
      --ckpt "$CKPT" --phases c
    install_tree . head
    for mode in 0 1; do
      step "c-head-$mode-$round" 150 env KVSCALE_ROPE_IN_LOOP=$mode python3 \
        bench/engine_bench.py --out-dir "$RES/head-$mode-$round" --ckpt "$CKPT" --phases c
    done
  done
}

# r69 (e58, e59): the fused decode kernel's loads issued before its rotary table's, q
# rotated in its loop for small grids, and the decode graphs' inputs in one launch.
# Needs `mkdir ab-prev && git archive 57b8b30 | tar x -C ab-prev` (untracked: it
# travels) for the code before. The kernel and engine tests natively at HEAD (as it
# ships, then the engine's with the in-loop mode on: KVSCALE_ROPE_IN_LOOP=1); C
# alternated between the two trees and the mode, an engine a process; C's step by kernel
# with the mode; A's decode step (large grids: the reordered loads only).
plan_r69() {
  facts
  ckpt_beside tests-kernels 300 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" \
    tests/kernels/test_paged_decode_rope.py tests/kernels/test_paged_decode.py \
    tests/kernels/test_decode_inputs.py
  step tests-gpu 420 "${PT[@]}" tests/gpu/test_engine_cuda.py tests/gpu/test_spec_cuda.py \
    tests/gpu/test_draft_cuda.py tests/gpu/test_int4_cuda.py
  step tests-gpu-in-loop 240 env KVSCALE_ROPE_IN_LOOP=1 "${PT[@]}" tests/gpu/test_engine_cuda.py
  c_in_loop_rounds 3
  step decode-kernels 120 env KVSCALE_ROPE_IN_LOOP=1 python3 bench/engine_bench.py \
    --out-dir "$RES" --ckpt "$CKPT" --phases decode-kernels
  bench decode-kernels-a 300 decode-kernels-a
}

# r70 (2 GPUs; e58, e59 at TP=2): the TP GPU tests with the in-loop RoPE mode on (the decode
# graphs' input kernel on both ranks), then C at TP=2 and TP=1 with the mode off and on.
plan_r70() {
  tp_switch KVSCALE_ROPE_IN_LOOP
}

# r71 (one H100; r69's C alternation, cut short when its machine was released): C for the
# code before e58/e59, HEAD, and HEAD with the in-loop RoPE mode, alternated twice; then the
# decode step by kernel with the in-loop mode.
plan_r71() {
  facts
  ckpt_write
  c_in_loop_rounds 2
  step decode-kernels 120 env KVSCALE_ROPE_IN_LOOP=1 python3 bench/engine_bench.py \
    --out-dir "$RES" --ckpt "$CKPT" --phases decode-kernels
}

# r72 (written for nvidia-h100-x2, ran on nvidia-h200-x2 and was cut after its first call;
# r72b and r72c took the rest. On 2 H100s TP=1's numbers are issue 23's, TP=2 / TP=1 issue
# 24's, in one lease of ~20 minutes; e60, e61, e62). Needs `mkdir ab-prev && git archive
# 28029e3 | tar x -C ab-prev` (the code before e60; untracked, it travels). GPU 0 writes the
# checkpoint and runs the engine, speculative, draft and int4 GPU tests with the in-kernel
# split-KV merge on (KVSCALE_DECODE_MERGE=1) while GPU 1 runs the kernel tests natively
# (the merge's bit-equality with real concurrency, the norms, the online-softmax helper);
# then the TP and one-shot GPU tests with the merge and the flagged words
# (KVSCALE_ALLREDUCE_LL=1: the mixed protocols across int32's wrap included); the
# all-reduce bench with flags and with flagged words; C alternated twice (an engine a
# process): TP=1 before / HEAD / HEAD with the merge, TP=2 the same and HEAD with the merge
# and the flagged words; C's step by kernel at TP=1, HEAD without and with the merge; A
# before / HEAD alternated, as device time allows.
plan_r72() {
  facts
  (export CUDA_VISIBLE_DEVICES=0
   ckpt_write 300
   step tests-gpu 420 env KVSCALE_DECODE_MERGE=1 "${PT[@]}" tests/gpu/test_engine_cuda.py \
     tests/gpu/test_spec_cuda.py tests/gpu/test_draft_cuda.py tests/gpu/test_int4_cuda.py) &
  (export CUDA_VISIBLE_DEVICES=1
   step tests-kernels 360 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" \
     tests/kernels/test_paged_decode.py tests/kernels/test_elementwise.py \
     tests/kernels/test_paged_prefill.py) &
  wait
  step tests-tp 420 env KVSCALE_DECODE_MERGE=1 KVSCALE_ALLREDUCE_LL=1 "${PT[@]}" \
    tests/gpu/test_tensor_parallel_cuda.py tests/gpu/test_one_shot_cuda.py
  for ll in 0 1; do
    step "all-reduce-ll$ll" 120 env KVSCALE_ALLREDUCE_LL=$ll python3 bench/all_reduce.py \
      --out-dir "$RES/all-reduce-ll$ll"
  done
  local round mode
  for round in 1 2; do
    install_tree ab-prev prev
    step "c-tp1-prev-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/tp1-prev-$round" --ckpt "$CKPT" --phases c
    step "c-tp2-prev-$round" 200 python3 bench/engine_bench.py \
      --out-dir "$RES/tp2-prev-$round" --ckpt "$CKPT" --phases c-tp2
    install_tree . head
    for mode in 00 10 11; do  # merge, flagged words
      if [ "$mode" != 11 ]; then  # the flagged words change nothing at TP=1
        step "c-tp1-$mode-$round" 150 env KVSCALE_DECODE_MERGE="${mode:0:1}" python3 \
          bench/engine_bench.py --out-dir "$RES/tp1-$mode-$round" --ckpt "$CKPT" --phases c
      fi
      step "c-tp2-$mode-$round" 200 env KVSCALE_DECODE_MERGE="${mode:0:1}" \
        KVSCALE_ALLREDUCE_LL="${mode:1:1}" python3 bench/engine_bench.py \
        --out-dir "$RES/tp2-$mode-$round" --ckpt "$CKPT" --phases c-tp2
    done
  done
  for mode in 0 1; do
    step "decode-kernels-$mode" 120 env KVSCALE_DECODE_MERGE=$mode python3 \
      bench/engine_bench.py --out-dir "$RES/kernels-$mode" --ckpt "$CKPT" --phases decode-kernels
  done
  # last, as device time allows: A before / HEAD, alternated (e60's norms and e63's logits)
  for round in 1 2; do
    install_tree ab-prev prev
    step "a-prev-$round" 150 python3 bench/engine_bench.py --out-dir "$RES/a-prev-$round" \
      --ckpt "$CKPT" --phases a
    install_tree . head
    step "a-head-$round" 150 python3 bench/engine_bench.py --out-dir "$RES/a-head-$round" \
      --ckpt "$CKPT" --phases a
  done
}

# r72b (nvidia-h200-x2; r72's machine was released mid-plan, after its tests-tp had failed
# one test with the merge and the flagged words on; the merge itself was checked on one GPU
# in r72c): the TP and one-shot GPU tests as shipped (e60 on, both switches off); the
# one-shot tests with only the flagged words on; C alternated twice (TP=1 and TP=2, before
# e60 / HEAD, and HEAD with the flagged words where their tests passed).
plan_r72b() {
  facts
  ckpt_write 150 &  # beside the tests: they make their own small checkpoints
  step tests-tp 330 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py tests/gpu/test_one_shot_cuda.py
  step tests-ll 200 env KVSCALE_ALLREDUCE_LL=1 "${PT[@]}" tests/gpu/test_one_shot_cuda.py \
    tests/gpu/test_tensor_parallel_cuda.py -k one_shot
  wait
  local ll=0 round
  grep -q "exit 0" <(grep "\[tests-ll\]" "$RES/log.txt") && ll=1
  for round in 1 2; do
    install_tree ab-prev prev
    step "c-tp1-prev-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/tp1-prev-$round" --ckpt "$CKPT" --phases c
    step "c-tp2-prev-$round" 200 python3 bench/engine_bench.py \
      --out-dir "$RES/tp2-prev-$round" --ckpt "$CKPT" --phases c-tp2
    install_tree . head
    step "c-tp1-head-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/tp1-head-$round" --ckpt "$CKPT" --phases c
    step "c-tp2-head-$round" 200 python3 bench/engine_bench.py \
      --out-dir "$RES/tp2-head-$round" --ckpt "$CKPT" --phases c-tp2
    if [ $ll = 1 ]; then
      step "c-tp2-ll-$round" 200 env KVSCALE_ALLREDUCE_LL=1 python3 bench/engine_bench.py \
        --out-dir "$RES/tp2-ll-$round" --ckpt "$CKPT" --phases c-tp2
    fi
  done
}

# r72c (nvidia-h200, one GPU: the 2-GPU kind was not lent when r72b was to start): the
# merge check beside the checkpoint's writing (bench/merge_check.py went with the merge mode
# after r73: NOTES "e61 and e62 measured"); C before e60 / HEAD alternated twice; C's
# step by kernel (e63); A before / HEAD.
plan_r72c() {
  facts
  ckpt_write 150 &
  step merge-check 150 python3 bench/merge_check.py --out "$RES/merge_check.json" --launches 100
  wait
  local round
  for round in 1 2; do
    install_tree ab-prev prev
    step "c-prev-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/c-prev-$round" --ckpt "$CKPT" --phases c
    install_tree . head
    step "c-head-$round" 150 python3 bench/engine_bench.py \
      --out-dir "$RES/c-head-$round" --ckpt "$CKPT" --phases c
  done
  step decode-kernels 120 python3 bench/engine_bench.py --out-dir "$RES/kernels" \
    --ckpt "$CKPT" --phases decode-kernels
  install_tree ab-prev prev
  step a-prev 150 python3 bench/engine_bench.py --out-dir "$RES/a-prev" --ckpt "$CKPT" --phases a
  install_tree . head
  step a-head 150 python3 bench/engine_bench.py --out-dir "$RES/a-head" --ckpt "$CKPT" --phases a
}

# r73 (nvidia-h200-x2, ~17 minutes; what r72-r72c left owed, NOTES "e60-e63 measured"):
# the one-shot tests with the flagged words (fp32 mended since r72b); C alternated twice,
# an engine a process: TP=1 HEAD / the merge, TP=2 HEAD / the merge / the flagged words;
# then A HEAD / the code before e60 alternated three times (r72c's one run each differed
# outside the engine's steps). Needs `mkdir ab-prev && git archive 28029e3 | tar x -C
# ab-prev` (untracked, it travels).
plan_r73() {
  facts
  ckpt_write 150 &
  step tests-ll 200 env KVSCALE_ALLREDUCE_LL=1 "${PT[@]}" tests/gpu/test_one_shot_cuda.py \
    tests/gpu/test_tensor_parallel_cuda.py -k one_shot
  wait
  local round
  for round in 1 2; do
    run_phase "c-tp1-head-$round" 150 c
    run_phase "c-tp1-merge-$round" 150 c KVSCALE_DECODE_MERGE=1
    run_phase "c-tp2-head-$round" 200 c-tp2
    run_phase "c-tp2-merge-$round" 200 c-tp2 KVSCALE_DECODE_MERGE=1
    run_phase "c-tp2-ll-$round" 200 c-tp2 KVSCALE_ALLREDUCE_LL=1
  done
  for round in 1 2 3; do
    install_tree ab-prev prev
    run_phase "a-prev-$round" 150 a
    install_tree . head
    run_phase "a-head-$round" 150 a
  done
}

# r74 (nvidia-h200, ~12 minutes; NOTES e65): cuBLAS's path for the bf16 GEMMs under PyTorch's
# switches (default; cuBLASLt preferred; no cuBLAS workspace; both): each 8B GEMM at 1-256
# rows (bench/gemm_rows.py, its kernels by name), then C alternated twice and A once under
# each, an engine a process; the paged decode kernel tests natively beside the checkpoint's
# writing (the in-kernel merge removed).
BLAS_SWITCHES=(
  "default:"
  "lt:TORCH_BLAS_PREFER_CUBLASLT=1"
  "nows:CUBLAS_WORKSPACE_CONFIG=:0:0"
  "lt-nows:TORCH_BLAS_PREFER_CUBLASLT=1 CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0"
)
plan_r74() {
  facts
  ckpt_write 150 &
  step tests-decode 240 env KVSCALE_KERNEL_TESTS=1 "${PT[@]}" tests/kernels/test_paged_decode.py
  wait
  local sw name vars round
  for sw in "${BLAS_SWITCHES[@]}"; do
    name=${sw%%:*} vars=${sw#*:}
    # shellcheck disable=SC2086  # vars: VAR=VALUE words
    step "gemm-$name" 150 env $vars python3 bench/gemm_rows.py --out-dir "$RES/gemm-$name" \
      --rows 1,4,64,256 --variants linear
  done
  for round in 1 2; do
    for sw in "${BLAS_SWITCHES[@]}"; do
      name=${sw%%:*} vars=${sw#*:}
      # shellcheck disable=SC2086
      run_phase "c-$name-$round" 150 c $vars
    done
  done
  for sw in "${BLAS_SWITCHES[@]}"; do
    name=${sw%%:*} vars=${sw#*:}
    # shellcheck disable=SC2086
    run_phase "a-$name" 150 a $vars
  done
}

# r75 (nvidia-h200, ~5 minutes; NOTES "e65 measured"): cuBLASLt preferred by the worker
# (now the default): the engine and speculative GPU tests as shipped beside the checkpoint's
# writing; A with TORCH_BLAS_PREFER_CUBLASLT=0 (cuBLAS, as before) / HEAD; C at HEAD.
plan_r75() {
  facts
  ckpt_write 150 &
  step tests-gpu 240 "${PT[@]}" tests/gpu/test_engine_cuda.py tests/gpu/test_spec_cuda.py
  wait
  run_phase a-cublas 150 a TORCH_BLAS_PREFER_CUBLASLT=0
  run_phase a-head 150 a
  run_phase c-head 150 c
}

# r76 (nvidia-h200-x2, ~13 minutes; what r73-r75 left owed, NOTES "e65 measured"): GPU 0
# writes the checkpoint, then runs A twice as the machine's first A's (the warm-up that now
# prefills every prompt: the two should agree) and C's step by kernel under cuBLASLt (HEAD)
# and cuBLAS, while GPU 1 runs the int4, draft, piecewise and structured GPU tests with
# cuBLASLt preferred; then the TP and one-shot GPU tests as shipped (flagged words and
# cuBLASLt on); C alternated twice at TP=2 and once at TP=1, HEAD / cuBLAS.
plan_r76() {
  facts
  (export CUDA_VISIBLE_DEVICES=0
   ckpt_write 150
   run_phase a-first-1 150 a
   run_phase a-first-2 150 a
   run_phase kernels-head 120 decode-kernels
   run_phase kernels-cublas 120 decode-kernels TORCH_BLAS_PREFER_CUBLASLT=0) &
  (export CUDA_VISIBLE_DEVICES=1
   step tests-gpu 420 "${PT[@]}" tests/gpu/test_int4_cuda.py tests/gpu/test_draft_cuda.py \
     tests/gpu/test_piecewise_cuda.py tests/gpu/test_structured_cuda.py) &
  wait
  step tests-tp 330 "${PT[@]}" tests/gpu/test_tensor_parallel_cuda.py tests/gpu/test_one_shot_cuda.py
  local round
  for round in 1 2; do
    run_phase "c-tp2-head-$round" 200 c-tp2
    run_phase "c-tp2-cublas-$round" 200 c-tp2 TORCH_BLAS_PREFER_CUBLASLT=0
  done
  run_phase c-tp1-head 150 c
  run_phase c-tp1-cublas 150 c TORCH_BLAS_PREFER_CUBLASLT=0
}

# r77 (one H100, nvidia-h100-x1 where lent, ~11 minutes; issue 23's figures at HEAD, none
# measured on an H100 since r71): A three times first (the warm-up that now prefills every
# prompt), C HEAD (cuBLASLt) / cuBLAS alternated twice, C's step by kernel, D at c=256.
plan_r77() {
  facts
  ckpt_write 150
  local round
  for round in 1 2 3; do
    run_phase "a-head-$round" 150 a
  done
  for round in 1 2; do
    run_phase "c-head-$round" 150 c
    run_phase "c-cublas-$round" 150 c TORCH_BLAS_PREFER_CUBLASLT=0
  done
  run_phase kernels-head 120 decode-kernels
  bench serve 300 serve --concurrency 256
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
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" --exclude=compile-cache \
      --exclude='*.safetensors' -C "$RES" .
    ;;
  plan_*)
    "$1"
    ;;
esac
