source bench/gpu_setup.sh >/dev/null
mkdir -p $OUT/r37
timeout 150 env KVSCALE_KERNEL_TESTS=1 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/kernels/test_w4a16.py -k "forms_8b or gemv_one_row" > $OUT/r37/tests.log 2>&1; echo tests rc=$?; grep -E "passed|failed|Error" $OUT/r37/tests.log | tail -5
timeout 300 python3 bench/kernels.py --out-dir $OUT/r37 --only w4a16 --w4a16-sweep > $OUT/r37/sweep.log 2>&1; echo sweep rc=$?
python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/r37/w4a16_sweep.json"))["rows"]
by = {}
for r in rows:
    if "us" not in r:
        print("ERR", r.get("layer"), r.get("config"), r.get("error", "")[:150]); continue
    c = r["config"]
    kind = "TMA" if c.get("TMA") else ("RW" if c.get("ROWWISE") else "tile")
    if r.get("heuristic"): kind = "H"
    by.setdefault((r["layer"], kind), []).append((r["us"], c.get("BLOCK_N"), c.get("num_warps"), c.get("SPLIT_K"), r["tiles"], c.get("num_stages"), r["rel_error"]))
for (layer, kind), v in by.items():
    v.sort()
    print(layer, kind, " | ".join("%.1f us BN%s w%s split%s t%s st%s err%.0e" % x for x in v[:4]))
PY
