#!/usr/bin/env bash
# The serving sweep on one H200 (issue: batching off against on), one device call:
#   bash benchmarks/serving_h200.sh $OUT
# Builds the real-size random-weight Qwen-Image checkpoint (qwen_image_e2e.py's build, 75 s), then
# for --max-batch-size 1 (off) and 4 (on) starts one server and runs benchmarks/serving.py at
# concurrency 1, 4 and 8 on the mix workload's sizes, and at 1328x1328 (concurrency 1 and 8). The step counts are the
# workloads' divided by 5 (a whole sweep must fit one 10-minute call; the time per step is what batching changes),
# there is no negative prompt (one forward per step), and the queue runs in arrival order (fcfs, the default when the
# table was measured). Results merge into
# $1/serving.json and $1/benchmarks.md (copy them to benchmarks/results/ and docs/ here).
set -euo pipefail
out=${1:?usage: serving_h200.sh OUT_DIR}
python3 benchmarks/qwen_image_e2e.py --phase build --out /tmp/e2e-build.json --docs /tmp/e2e-build.md
mix='[{"width":512,"height":512,"num_inference_steps":4,"weight":15},
{"width":768,"height":768,"num_inference_steps":4,"weight":25},
{"width":1024,"height":1024,"num_inference_steps":5,"weight":45},
{"width":1536,"height":1536,"num_inference_steps":7,"weight":15}]'
big='[{"width":1328,"height":1328,"num_inference_steps":10,"weight":1}]'
cp benchmarks/results/serving.json "$out/serving.json" 2>/dev/null || true
cp docs/benchmarks.md "$out/benchmarks.md"
for batch in 1 4; do
  port=$((8100 + batch))
  python3 -m vllm_omni.entrypoints.cli.main serve /tmp/qwen-image-e2e --port "$port" --max-batch-size "$batch" \
    --scheduling-policy fcfs >"$out/server-b$batch.log" 2>&1 &
  server=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$server" 2>/dev/null || { tail -50 "$out/server-b$batch.log"; exit 1; }
    sleep 2
  done
  mode=$([ "$batch" = 1 ] && echo "batching off" || echo "batching on (max 4)")
  for c in 1 4 8; do
    for w in mix $([ "$c" = 4 ] || echo 1328); do  # 1328 at c=1 and 8 only: the call's 10 minutes
      load=$([ "$w" = mix ] && echo "$mix" || echo "$big")
      python3 benchmarks/serving.py --base-url "http://127.0.0.1:$port" --workload "$load" --concurrency "$c" \
        --num-requests $((c * 2 > 4 ? c * 2 : 4)) --warmup "$c" --label "$mode, c=$c, $w (steps/5)" \
        --results "$out/serving.json" --docs "$out/benchmarks.md"
    done
  done
  kill "$server"; wait "$server" || true
done
