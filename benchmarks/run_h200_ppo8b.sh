#!/usr/bin/env bash
# The third device call on 2xH200: PPO at 8B (policy, reference, reward 8B; value 1B with the
# policy's vocabulary) at the micro batch where the planner puts the replicated placements over an
# H200's memory and posttrain's default under it (11 prompts x 512 tokens per GPU).
set -u
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
python3 benchmarks/harness.py --timeout 120 --out "$R" --workload ppo --shape 8b --role-shape value=1b \
  --seq-len 512 --response-len 64 --micro-batch 11 --mixes zero2-zero3,zero2-replicated,trl-zero2 \
  --budget "${BUDGET:-150}" 2>&1 | tee "${OUT:-/tmp/out}/log.txt" | grep '^\[bench\]'
tar czf "${OUT:-/tmp/out}/runs.tgz" -C "$R" runs && rm -rf "$R/runs"
