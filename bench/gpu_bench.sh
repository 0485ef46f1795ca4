#!/usr/bin/env bash
# On the GPU machine: `bench/gpu_bench.sh start PHASES [ARGS]` runs engine_bench.py's
# phases in a session of their own (they outlive the device call), results and log in
# $RES (default /tmp/bench-results); `bench/gpu_bench.sh wait SECONDS` follows the log
# until the run ends or SECONDS pass, then packs results and logs into $OUT/results.tgz.
# Two GPUs (tensor parallelism, issue #24):
#   bench/gpu_bench.sh start ceilings,tp1,tp2,serve,serve-tp2,allreduce --concurrency 64,256 --report
# NVLink multicast stays off in every process (the engine also forces these in its ranks).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RES=${RES:-/tmp/bench-results}
mkdir -p "$RES"
case "$1" in
  start)
    shift
    phases=$1
    shift
    rm -f "$RES/finished"
    setsid bash -c "python3 bench/engine_bench.py --out-dir '$RES' --phases '$phases' $* \
      > '$RES/log.txt' 2>&1; echo \$? > '$RES/finished'" < /dev/null > /dev/null 2>&1 &
    ;;
  wait)
    deadline=$((SECONDS + $2))
    while [ ! -f "$RES/finished" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    tail -n 40 "$RES/log.txt"
    [ -f "$RES/finished" ] && echo "finished with exit code $(cat "$RES/finished")"
    # one archive: the device tool returns at most 8 files
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$RES" .
    ;;
  *)
    echo "usage: $0 start PHASES [ARGS] | wait SECONDS" >&2
    exit 2
    ;;
esac
