#!/usr/bin/env bash
# Third call: GRPO 1.1B against TRL's GRPOTrainer side by side with the engine's defaults (fused
# views) and each side's resting memory; then the harness's SFT and reward rows against TRL's
# SFTTrainer and RewardTrainer (issue 23), one GPU.
set -u
R=${R:-/tmp/r}
mkdir -p $R
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$R" . ; fi; }
timeout 250 python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 \
  --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 120 \
  --out $R/grpo_1b > $R/grpo_log.txt 2>&1
echo "grpo rc=$?" >> $R/rc.txt; pack
for w in sft reward; do
  timeout 150 python benchmarks/harness/harness.py --workload $w --shape 1b --nproc 1 --micro-batch 4 --seq-len 512 \
    --response-len 64 --warmup 1 --steps 4 --mixes zero2-zero3,trl-zero2 --timeout 70 --out $R/harness_$w \
    > $R/harness_${w}_log.txt 2>&1
  echo "harness $w rc=$?" >> $R/rc.txt; pack
done
