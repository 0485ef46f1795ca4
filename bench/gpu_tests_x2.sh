#!/usr/bin/env bash
# One device call on nvidia-h100-x2 (two GPUs): every GPU test of this round in under
# 10 minutes. GPU 0 runs the kernels natively while GPU 1 runs the single-GPU engine tests;
# then the tensor-parallel tests take both. Logs land in $OUT (the device tool's folder).
#   source bench/gpu_setup.sh first (carried .whl); NVLink multicast stays off.
set -u
OUT=${OUT:-/tmp/gpu-tests}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=10)
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
(CUDA_VISIBLE_DEVICES=0 KVSCALE_KERNEL_TESTS=1 timeout "${KERNEL_LIMIT:-400}" \
  "${PYTEST[@]}" tests/kernels > "$OUT/tests-kernels.log" 2>&1; echo "exit $?" >> "$OUT/tests-kernels.log") &
(CUDA_VISIBLE_DEVICES=1 KVSCALE_KERNEL_TESTS=1 timeout "${GPU_LIMIT:-400}" \
  "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_tensor_parallel_cuda.py \
  > "$OUT/tests-gpu.log" 2>&1; echo "exit $?" >> "$OUT/tests-gpu.log") &
wait
timeout "${TP_LIMIT:-150}" "${PYTEST[@]}" tests/gpu/test_tensor_parallel_cuda.py \
  > "$OUT/tests-tp.log" 2>&1; echo "exit $?" >> "$OUT/tests-tp.log"
for f in "$OUT"/tests-*.log; do echo "--- $f"; tail -n 25 "$f"; done
