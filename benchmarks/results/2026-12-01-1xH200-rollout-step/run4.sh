#!/usr/bin/env bash
# Fourth call: SDPA decode attention (POSTTRAIN_ROLLOUT_SDPA=1), the variant closest to the training
# forward in the variants bench: the log-prob gaps at 1.1B and 8B beside the static engine and
# generate, every row to the end and the step at 1.1B, and GRPO 1.1B's step (posttrain's row only;
# TRL's GRPOTrainer ran beside the default engine in run3).
set -u
R=${R:-/tmp/r}; BASE=${BASE:-baseline_rollout.py}
mkdir -p $R
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$R" . ; fi; }
export POSTTRAIN_ROLLOUT_SDPA=1
timeout 130 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases full,step,logprobs --compile layer+fuse \
  --baseline $BASE --baseline-cases full,logprobs --repeats 3 --budget-s 110 --out $R/rollout_1b_sdpa.json \
  > $R/rollout_1b_sdpa_log.txt 2>&1
echo "1b sdpa rc=$?" >> $R/rc.txt; pack
timeout 120 python benchmarks/rollout/rollout_bench.py --shapes 8b --prompts 16 --cases logprobs --compile layer+fuse \
  --baseline $BASE --baseline-cases logprobs --repeats 2 --budget-s 100 --out $R/rollout_8b_sdpa.json \
  > $R/rollout_8b_sdpa_log.txt 2>&1
echo "8b sdpa rc=$?" >> $R/rc.txt; pack
timeout 110 python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 \
  --response-len 256 --num-generations 8 --mixes zero2-zero3 --warmup 1 --steps 3 --timeout 100 \
  --out $R/grpo_1b_sdpa > $R/grpo_sdpa_log.txt 2>&1
echo "grpo sdpa rc=$?" >> $R/rc.txt; pack
