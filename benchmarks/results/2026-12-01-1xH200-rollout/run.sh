#!/usr/bin/env bash
# One H200, issue 20: the rollout engine against the static engine of 2c7536f and generate, then GRPO
# against TRL's GRPOTrainer. Run from the repo root with the GPU wheels installed (see commands.txt);
# writes into $OUT (default: this folder). The baseline is the old single-file engine:
#   git show 2c7536f:posttrain/rollout.py > baseline_rollout.py
set -u
OUT=${OUT:-benchmarks/results/2026-12-01-1xH200-rollout}
BASE=${BASE:-baseline_rollout.py}
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" . ; fi; }  # PACK: a tarball of $OUT after each stage
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1
python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" \
  > $OUT/versions.txt 2>&1
# 1.1B: variable lengths (64 prompts x 8, 256 + up to 512, a 1% stop set), every row to the end (128 rows),
# the step alone, prefix sharing, log-prob numerics, the GRPO-prepared policy.
timeout 245 python benchmarks/rollout/rollout_bench.py --shapes 1b --baseline $BASE --hf --kv-slots 128,512 \
  --budget-s 205 --out $OUT/rollout_1b.json > $OUT/log_1b.txt 2>&1
echo "1b rc=$?" >> $OUT/versions.txt; pack
# 8B: 16 prompts x 8 (128 sequences), chunks of 64 for the baseline, every row to the end (64 rows).
timeout 120 python benchmarks/rollout/rollout_bench.py --shapes 8b --prompts 16 --cases varlen,full,step \
  --baseline $BASE --kv-slots 128 --repeats 2 --budget-s 90 --out $OUT/rollout_8b.json > $OUT/log_8b.txt 2>&1
echo "8b rc=$?" >> $OUT/versions.txt; pack
# GRPO 1.1B, one GPU, 16 completions x 256 tokens per step, posttrain against TRL's GRPOTrainer.
timeout 170 python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 \
  --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 85 \
  --out $OUT/grpo > $OUT/log_grpo.txt 2>&1
echo "grpo rc=$?" >> $OUT/versions.txt; pack
