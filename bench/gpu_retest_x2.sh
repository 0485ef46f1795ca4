#!/usr/bin/env bash
# One short device call on nvidia-h100-x2: the GPU tests that failed in the first run of
# bench/gpu_tests_x2.sh, after their fixes. Single-GPU groups run two at a time (one per
# GPU), each pytest with its own time limit so one slow group cannot hide the others'
# results; then the tensor-parallel tests take both GPUs. Logs land in $OUT.
set -u
OUT=${OUT:-/tmp/gpu-retest}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVSCALE_KERNEL_TESTS=1
# --timeout (pytest-timeout, installed there): a hung test fails with its stack instead of
# hiding every traceback behind the group's time limit.
PYTEST=(python3 -m pytest -v -p no:cacheprovider -rs --tb=short --timeout=60)
group() {  # group GPU LIMIT NAME TESTS...: one pytest on one GPU, logged to $OUT/NAME.log
  local gpu=$1 limit=$2 name=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "${PYTEST[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?" >> "$OUT/$name.log"
}
G=tests/gpu
(group 0 50 fp8-kernels tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_gemm.py
 group 0 50 structured $G/test_structured_cuda.py
 group 0 70 fp8-int4-engine "$G/test_engine_cuda.py::test_fp8_engine_with_cuda_graphs_matches_eager" \
   "$G/test_engine_cuda.py::test_fp8_kv_cache_with_cuda_graphs_matches_eager" \
   "$G/test_int4_cuda.py::test_int4_cuda_graphs_and_compile_match_eager_fp32" \
   "$G/test_int4_cuda.py::test_int4_bf16_cuda_graphs_match_eager_and_compile_tracks_it") &
(group 1 170 piecewise $G/test_piecewise_cuda.py) &
wait
group 0,1 "${TP_LIMIT:-140}" tp $G/test_tensor_parallel_cuda.py -k "not fp32_greedy and not bf16_tracks"
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "PASSED|FAILED|ERROR|^exit|passed|failed" "$f" | tail -n 20; done
