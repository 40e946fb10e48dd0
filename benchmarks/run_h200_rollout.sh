python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH
# One H200, one call (issue 20, what NOTES section 18 left): GRPO 1.1B against TRL's GRPOTrainer in two
# rounds of alternating order with the engine's defaults (fused views, SDPA decode attention); the memory
# each side holds between steps, by origin (a diagnostic run: --memory-at-rest records allocations and
# slows the steps); every row to the end at 8B beside the static engine of 2c7536f. Run from the
# repository root with the wheels in .whl/ (../shared/tools/gpu-wheels.sh), after
# `git show 2c7536f:posttrain/rollout.py > baseline_rollout.py` (untracked: it travels with the tree):
#   PART=1 bash benchmarks/run_h200_rollout.sh   (the two GRPO rounds, ~5.5 minutes)
#   PART=2 bash benchmarks/run_h200_rollout.sh   (memory at rest, 8B every row to the end, ~5.5 minutes)
#   PART=3 bash benchmarks/run_h200_rollout.sh   (shared prompt slots, with and without flex_attention, beside
#                                                 the default engine, 1.1B: 512 sequences through 512 slots,
#                                                 128 to the end and its step, the prefill, log-prob gaps; ~8 min)
#   PART=4 bash benchmarks/run_h200_rollout.sh   (flex_attention beside SDPA in the variants bench; GRPO with
#                                                 shared prompt slots, and with flex too; ~8 min)
# Four calls (a call may run 10 minutes; NOTES sections 18-19 say what each measures). Results go to ${OUT:-benchmarks/results}/<date>-1xH200-rollout-next/
# as each part finishes; every part is bounded by `timeout`.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RES=${OUT:-benchmarks/results}/$(date -u +%F)-1xH200-rollout-next
mkdir -p "$RES"
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$RES" . ; fi; }
G="--workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 --response-len 256 --num-generations 8"
if [ "${PART:-1}" = 1 ]; then
timeout 180 python benchmarks/grpo_bench.py $G --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 88 \
  --out "$RES/grpo_round1" > "$RES/grpo_round1.log" 2>&1; echo "grpo round 1 rc=$?" >> "$RES/rc.txt"; pack
timeout 180 python benchmarks/grpo_bench.py $G --mixes trl-zero2,zero2-zero3 --warmup 1 --steps 3 --timeout 88 \
  --out "$RES/grpo_round2" > "$RES/grpo_round2.log" 2>&1; echo "grpo round 2 rc=$?" >> "$RES/rc.txt"; pack
elif [ "${PART:-1}" = 2 ]; then
timeout 180 python benchmarks/grpo_bench.py $G --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 1 --timeout 88 \
  --memory-at-rest --out "$RES/grpo_memory" > "$RES/grpo_memory.log" 2>&1; echo "memory rc=$?" >> "$RES/rc.txt"; pack
timeout 170 python benchmarks/rollout_bench.py --shapes 8b --cases full --chunk 64 --baseline baseline_rollout.py \
  --baseline-cases full --shared-prompt off --repeats 2 --budget-s 140 --out "$RES/rollout_8b_full.json" \
  > "$RES/rollout_8b.log" 2>&1
echo "8b full rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 3 ]; then
timeout 480 python benchmarks/rollout_bench.py --shapes 1b --cases varlen,full,prefix,logprobs --kv-slots 512 \
  --shared-prompt off,on,flex --repeats 2 --budget-s 400 --out "$RES/rollout_1b_shared.json" \
  > "$RES/rollout_shared.log" 2>&1
echo "1b shared rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 4 ]; then
timeout 200 python benchmarks/rollout_bench.py --shapes 1b --cases variants --variants fused1_split1_sdpa,fused1_split1_flex \
  --budget-s 170 --out "$RES/variants_flex_1b.json" > "$RES/variants_flex.log" 2>&1; echo "flex variants rc=$?" >> "$RES/rc.txt"
pack
POSTTRAIN_ROLLOUT_SHARED_PROMPT=1 timeout 150 python benchmarks/grpo_bench.py $G --mixes zero2-zero3 --warmup 1 \
  --steps 3 --timeout 100 --out "$RES/grpo_shared" > "$RES/grpo_shared.log" 2>&1; echo "grpo shared rc=$?" >> "$RES/rc.txt"
pack
POSTTRAIN_ROLLOUT_SHARED_PROMPT=1 POSTTRAIN_ROLLOUT_FLEX=1 timeout 150 python benchmarks/grpo_bench.py $G \
  --mixes zero2-zero3 --warmup 1 --steps 3 --timeout 100 --out "$RES/grpo_shared_flex" > "$RES/grpo_shared_flex.log" 2>&1
echo "grpo shared flex rc=$?" >> "$RES/rc.txt"; pack
fi
