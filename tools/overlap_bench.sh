#!/usr/bin/env bash
# The emulated-device control-plane benchmark, overlap off and on in one run (issue 39):
# 1P1D on an emulated H200 (llama-3-8b), short prompts, 128 output tokens, at each
# concurrency in $STREAMS; then `pdserve simulate` with the same flags (the cost model's
# bound). The serve/bench/simulate commands are those of
# docs/results/2026-12-03-emulated-control-plane.md, plus --overlap / --no-overlap.
#
#     tools/overlap_bench.sh [OUTDIR]       # STREAMS="64 256" PORT=50393 by default
#     KVF=0.25 tools/overlap_bench.sh DIR   # + --emulate-kv-fraction 0.25 (serve, bench)
#
# Each bench also prints the CPU per output token of every process of the service's tree
# by group (tools/service_tree.py: front door + router, decode, prefill, Ray daemons) and
# of the bench client itself: "CPU per output token (us): ...".
set -euo pipefail
OUT=${1:-/tmp/overlap_bench}
STREAMS=${STREAMS:-"64 256"}
PORT=${PORT:-50393}
PD=${PD:-.venv/bin/pdserve}
PY=${PY:-.venv/bin/python}
snap() { "$PY" -c "import json, sys; from tools.service_tree import tree_cpu
json.dump(tree_cpu(int(sys.argv[1])), open(sys.argv[2], 'w'))" "$1" "$2"; }
per_token() {  # before.json after.json bench.json client-cpu-seconds
    "$PY" -c "import json, sys; from tools.service_tree import cpu_delta
b, a = ({int(k): tuple(v) for k, v in json.load(open(f)).items()} for f in sys.argv[1:3])
n = json.load(open(sys.argv[3]))['metrics']['total_output_tokens']
g = cpu_delta(b, a); g['bench client'] = float(sys.argv[4])
print('CPU per output token (us): ' + ' | '.join(f'{k} {v / n * 1e6:.0f}' for k, v in g.items())
      + f' | all {sum(g.values()) / n * 1e6:.0f} ({n} tokens)')" "$@"; }
EMU=(--emulate h200 --model-shape llama-3-8b)
KV=()
if [ -n "${KVF:-}" ]; then KV=(--emulate-kv-fraction "$KVF"); fi
WL=(--mix chat --prompt-len 128 --output-len 128)
mkdir -p "$OUT"
for mode in no-overlap overlap; do
    "$PD" serve "${EMU[@]}" --dtype bfloat16 --device cpu --port "$PORT" \
        --kv-cache-memory-gb 4 --max-num-seqs 256 "${KV[@]}" "--$mode" >"$OUT/serve-$mode.log" 2>&1 &
    srv=$!
    for _ in $(seq 120); do  # up once a one-prompt bench goes through
        if "$PD" bench --addr "127.0.0.1:$PORT" --num-prompts 1 --max-concurrency 1 \
                "${WL[@]}" --no-progress >/dev/null 2>&1; then break; fi
        sleep 2
    done
    for c in $STREAMS; do
        echo "== --$mode, $c streams"
        snap "$srv" "$OUT/cpu-$mode-$c.before.json"
        /usr/bin/time -f "%U %S" -o "$OUT/client-$mode-$c.time" \
            "$PD" bench --addr "127.0.0.1:$PORT" --num-prompts $((2 * c)) --max-concurrency "$c" \
            "${WL[@]}" "${EMU[@]}" "${KV[@]}" --no-progress --json "$OUT/$mode-$c.json" \
            | tee "$OUT/bench-$mode-$c.txt"
        snap "$srv" "$OUT/cpu-$mode-$c.after.json"
        per_token "$OUT/cpu-$mode-$c.before.json" "$OUT/cpu-$mode-$c.after.json" \
            "$OUT/$mode-$c.json" "$(awk '{print $1 + $2}' "$OUT/client-$mode-$c.time")" \
            | tee -a "$OUT/bench-$mode-$c.txt"
    done
    kill "$srv"; wait "$srv" || true
done
for c in $STREAMS; do
    echo "== simulate, $c streams"
    "$PD" simulate "${EMU[@]}" --interconnect infiniband --max-num-seqs 256 \
        --num-prompts $((2 * c)) --max-concurrency "$c" "${WL[@]}" | tee "$OUT/sim-$c.txt"
done
