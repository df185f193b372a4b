#!/usr/bin/env bash
# The long soak of the README on one machine: a local Ray head, `pdserve serve` on the tiny
# model joined to it, then `pdserve soak` (1,000 requests, 30% cancels, a worker kill every
# 20 s). Usage: bench/soak_local.sh [OUT_DIR]   (needs `make setup`; ~4 min on 2 cores)
#        bench/soak_local.sh OUT_DIR pressure  the 1,000-request `pdserve soak --pressure`
#        (it runs its own service with 24 x 16-token KV blocks per worker; ~7 min)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/pdserve-soak}
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p "$OUT"
MODEL=$OUT/tiny-llama
[ -d "$MODEL" ] || pdserve make-model --preset tiny --arch llama --out "$MODEL" >/dev/null
if [ "${2:-}" = pressure ]; then
  exec pdserve soak --pressure --requests 1000 --rate 3 --deadline 60 --model "$MODEL" \
    --seed 1 --json "$OUT/pressure-1000.json"
fi
ray stop --force >/dev/null 2>&1 || true
ray start --head --num-cpus 4 --include-dashboard false --disable-usage-stats >"$OUT/ray.log" 2>&1
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null; ray stop --force >/dev/null 2>&1' EXIT
pdserve serve --path "$MODEL" --address auto --cpus-per-worker 1 --connector tcp \
  --num-blocks 320 --max-prefill-chunk 64 --max-num-batched-tokens 256 \
  --request-timeout-s 170 --kv-wait-timeout-s 40 --restart-grace-s 60 --max-restarts 8 \
  --port 50071 --metrics-port 9171 >"$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 180); do grep -q "serving pdserve" "$OUT/serve.log" && break; sleep 1; done
pdserve soak --addr 127.0.0.1:50071 --requests 1000 --rate 6 --cancel-rate 0.3 \
  --kill-every 20 --max-restarts 8 --ray-address auto --model "$MODEL" \
  --metrics-url http://127.0.0.1:9171/metrics --deadline 170 --quiesce-timeout 120 \
  --seed 1 --json "$OUT/soak-1000.json"
