#!/usr/bin/env bash
# Issue 20, one H200: the decode step's untested variants (with each step's kernel times), then
# with the fastest variant at GRPO's shape: every row to the end beside the static engine of
# 2c7536f, the step against its floor, prefix sharing's prefill, the log-prob gaps, and GRPO 1.1B
# against TRL's GRPOTrainer. BASE: the old engine (git show 2c7536f:posttrain/rollout.py).
set -u
R=${R:-/tmp/r}; BASE=${BASE:-baseline_rollout.py}
mkdir -p $R
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$R" . ; fi; }
timeout 230 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases variants --budget-s 190 \
  --variants fused1_split1_fp321,fused1_split1_sdpa,fused1_split1_fp320,fused0_split1_sdpa \
  --out $R/variants_1b.json > $R/variants_log.txt 2>&1
echo "variants rc=$?" >> $R/rc.txt; pack
# The fastest variant without a fallback at GRPO's 16 x (256 + 256), as environment variables.
BEST=$(python - $R/variants_1b.json <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["variants"] if r.get("workload") == "grpo" and r.get("status") == "ok"]
b = min(rows, key=lambda r: r["decode_ms_per_step"]) if rows else {"fused": 1, "split": 1, "fp32_scores": 1, "sdpa": 0}
print(f"POSTTRAIN_ROLLOUT_FUSE={b['fused']} POSTTRAIN_ROLLOUT_SPLIT={b['split']} "
      f"POSTTRAIN_ROLLOUT_SCORES_FP32={b['fp32_scores']} POSTTRAIN_ROLLOUT_SDPA={b['sdpa']}")
PY
)
echo "best: $BEST" >> $R/rc.txt
export $BEST
FUSE=$POSTTRAIN_ROLLOUT_FUSE; C=layer; [ "$FUSE" = 1 ] && C=layer+fuse
timeout 170 python benchmarks/rollout/rollout_bench.py --shapes 1b --cases full,step,prefix,logprobs --compile $C \
  --baseline $BASE --baseline-cases full,logprobs --repeats 3 --budget-s 140 --out $R/rollout_1b.json \
  > $R/rollout_1b_log.txt 2>&1
echo "rollout 1b rc=$?" >> $R/rc.txt; pack
timeout 180 python benchmarks/races/grpo_bench.py --workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 \
  --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 85 \
  --out $R/grpo_1b > $R/grpo_log.txt 2>&1
echo "grpo rc=$?" >> $R/rc.txt; pack
