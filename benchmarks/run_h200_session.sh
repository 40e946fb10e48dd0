#!/usr/bin/env bash
# Device calls of the 2026-11-30 evening session (2x H200), one stage per call:
#   STAGE=a bash benchmarks/run_h200_session.sh   # rollout engine bench (1 GPU) + PPO 1B, both backends, every mix
#   STAGE=b bash benchmarks/run_h200_session.sh   # DPO 1B every mix, DPO 8B, PPO 8B (value 1B), GRPO 1B against TRL's GRPOTrainer
# Start the command with the line printed by ../shared/tools/gpu-wheels.sh. Results go to $OUT/<stage>.tgz.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
pack() { tar czf "$OUT/${STAGE}.tgz" -C $R . ; }
trap pack EXIT
H="python benchmarks/harness.py --timeout 170"
case "$STAGE" in
a)
  CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/rollout_bench.py --shapes 1b,8b --quick --compile layer,layer+fuse \
      --out $R/rollout_bench.json 2>&1 | grep -v -i warn | tail -40
  $H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --generation-backend hf \
      --mixes zero2-zero3 --budget 90 --out $R/ppo1b 2>&1 | tail -3
  $H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --generation-backend posttrain \
      --mixes zero2-zero3,zero2-replicated,trl-zero2,trl-zero3,zero3,zero2-zero3-offload --budget 260 --out $R/ppo1b 2>&1 | tail -12
  ;;
b)
  $H --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --mixes zero2-zero3,zero2-replicated,trl-zero2,trl-zero3,zero3,zero2-zero3-offload \
      --budget 185 --out $R/dpo 2>&1 | grep "^\[bench\]"
  $H --workload dpo --shape 8b --micro-batch 4 --seq-len 512 --mixes zero2-zero3,zero2-replicated,trl-zero3 \
      --budget 150 --min-run 40 --out $R/dpo 2>&1 | grep "^\[bench\]"
  $H --workload ppo --shape 8b --role-shape value=1b --micro-batch 11 --seq-len 512 --response-len 64 \
      --mixes zero2-zero3,zero2-replicated --budget 110 --min-run 40 --out $R/ppo8b 2>&1 | grep "^\[bench\]"
  timeout 110 python benchmarks/grpo_bench.py --workload grpo --shape 1b --nproc 2 --micro-batch 16 --seq-len 384 \
      --response-len 256 --num-generations 8 --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 100 \
      --out $R/grpo1b 2>&1 | tail -4
  ;;
esac
