#!/usr/bin/env bash
# Second run (after run.sh found the stop-token lookup, torch.isin, breaking CUDA graph capture):
# the engine only where run.sh already has the baseline (1.1B and 8B variable lengths), and the
# cases run.sh's budget skipped (every row to the end, the step, prefix sharing, log-prob gaps).
set -u
OUT=${OUT:-benchmarks/results/2026-12-01-1xH200-rollout}
BASE=${BASE:-baseline_rollout.py}
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" . ; fi; }
timeout 125 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases varlen,full,step,prefix,logprobs --baseline $BASE \
  --baseline-cases full,logprobs --kv-slots 128,512 --repeats 2 --budget-s 100 --out $OUT/rollout2_1b.json \
  > $OUT/log2_1b.txt 2>&1
echo "1b rc=$?" >> $OUT/versions2.txt; pack
timeout 60 python benchmarks/rollout/rollout_bench.py --shapes 8b --prompts 16 --cases varlen --kv-slots 128 --repeats 2 \
  --budget-s 40 --out $OUT/rollout2_8b.json > $OUT/log2_8b.txt 2>&1
echo "8b rc=$?" >> $OUT/versions2.txt; pack
