#!/usr/bin/env bash
# On the GPU machine: py-spy samples of kvscale serve's API process, its engine process
# and the benchmark client while `kvscale bench serve` loads the server.
#   bench/spy_serve.sh CKPT CONCURRENCY SECONDS OUTDIR
# Writes OUTDIR/spy_{api,engine,client}.txt (py-spy's raw format: "stack count" lines).
set -u
ckpt=$1 c=$2 secs=$3 out=$4
port=8123
mkdir -p "$out"
python3 -m kvscale.cli serve --model "$ckpt" --served-model-name bench --dtype bfloat16 \
  --max-model-len 2048 --host 127.0.0.1 --port $port --disable-access-log \
  --log-level warning > "$out/spy_server.log" 2>&1 &
api=$!
for _ in $(seq 300); do
  curl -sf localhost:$port/ready >/dev/null && break
  kill -0 $api 2>/dev/null || { echo "server died"; exit 1; }
  sleep 1
done
engine=$(pgrep -P $api -f spawn_main | head -1)
python3 -m kvscale.cli bench serve --base-url http://127.0.0.1:$port --model bench \
  --dataset sharegpt-like --tokenizer "$ckpt" --num-prompts $((4 * c)) --max-concurrency "$c" \
  --seed 0 --result-file "$out/spy_bench.json" --disable-tqdm > "$out/spy_bench.log" 2>&1 &
bench=$!
sleep 4
for who in api engine bench; do
  py-spy record -p "${!who}" -d "$secs" -r 200 -f raw -o "$out/spy_$who.txt" --nonblocking \
    > /dev/null 2>&1 &
done
wait $bench
kill $api
wait
grep -E "Median (TPOT|ITL|TTFT)|Output token throughput" "$out/spy_bench.log"
