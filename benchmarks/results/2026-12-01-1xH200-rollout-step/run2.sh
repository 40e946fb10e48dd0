#!/usr/bin/env bash
# Issue 20, second call: (1) inductor's split reductions off (TORCHINDUCTOR_SPLIT_REDUCTIONS=0, read
# at import, so its own process) against on, the decode step's variants; (2) GRPO 1.1B against TRL's
# GRPOTrainer with the engine's defaults at e099134 (fused q|k|v and gate|up as views of DeepSpeed's
# flat buffer, no copy); (3) 8B variable lengths and log-prob gaps with graphs, beside the static engine.
set -u
R=${R:-/tmp/r}; BASE=${BASE:-baseline_rollout.py}
mkdir -p $R
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$R" . ; fi; }
timeout 75 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases variants --budget-s 60 \
  --variants fused1_split1_fp321 --out $R/variants_split_on.json > $R/variants_split_on_log.txt 2>&1
echo "variants split on rc=$?" >> $R/rc.txt; pack
TORCHINDUCTOR_SPLIT_REDUCTIONS=0 timeout 110 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases variants \
  --budget-s 80 --variants fused1_split1_fp321,fused1_split1_sdpa --out $R/variants_split_off.json \
  > $R/variants_split_off_log.txt 2>&1
echo "variants split off rc=$?" >> $R/rc.txt; pack
timeout 170 python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 \
  --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 80 \
  --out $R/grpo_1b > $R/grpo_log.txt 2>&1
echo "grpo rc=$?" >> $R/rc.txt; pack
timeout 200 python benchmarks/rollout/rollout_bench.py --shapes 8b --prompts 16 --cases varlen,logprobs --compile layer+fuse \
  --baseline $BASE --baseline-cases varlen,logprobs --kv-slots 128 --repeats 2 --budget-s 170 \
  --out $R/rollout_8b.json > $R/rollout_8b_log.txt 2>&1
echo "8b rc=$?" >> $R/rc.txt; pack
