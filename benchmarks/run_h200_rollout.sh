python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH
# One H200 (issue 20, what NOTES section 21 left). Run from the repository root with the wheels in
# .whl/ (../shared/tools/gpu-wheels.sh):
#   PART=1 bash benchmarks/run_h200_rollout.sh   (GRPO 1.1B's memory, posttrain and TRL, traced through the
#                                                 last measured step: where the later steps' peak comes
#                                                 from; then a GRPO round, TRL first; ~6 minutes)
#   PART=2 bash benchmarks/run_h200_rollout.sh   (flex_attention with static rows beside SDPA in the variants
#                                                 bench: GRPO's step and the long step; ~4 minutes)
#   PART=4 bash benchmarks/run_h200_rollout.sh   (DPO and distillation 1.1B under DeepSpeed with fp32 master
#                                                 weights beside TRL: NOTES section 22 predicts the step's
#                                                 peak 2.05 GiB under section 12's 24.65; ~6 minutes)
#   PART=3 bash benchmarks/run_h200_rollout.sh   (shared prompt slots, their parts on SDPA's kernels, beside the
#                                                 default at 1.1B: 512 sequences through 512 slots, log-prob
#                                                 gaps, every row to the end and its step; ~8 minutes)
#   PART=5 bash benchmarks/run_h200_rollout.sh   (posttrain's Triton decode kernels: alone beside SDPA's kernels
#                                                 in the decode probe, in the step beside SDPA in the variants
#                                                 bench, then 512 sequences through 512 slots by default, with
#                                                 the kernels, and with them over shared prompt slots; NOTES
#                                                 section 23's predictions; ~11 minutes)
#   PART=6 bash benchmarks/run_h200_rollout.sh   (what NOTES section 24 left: the log-prob gaps of the default (Triton
#                                                 kernels, rotation inside) beside SDPA's and generate's at 1.1B and 8B,
#                                                 and 8B variable lengths with the kernels beside SDPA; ~8 minutes)
#   PART=7 bash benchmarks/run_h200_rollout.sh   (what NOTES section 25 left: one pass over the keys at every row
#                                                 count, the kernels without contraction: GRPO against TRL, the
#                                                 step and the log-prob gap over GRPO's rows beside SDPA and the
#                                                 key splits, the 1.1B and 8B gaps; ~8 minutes)
#   PART=8 bash benchmarks/run_h200_rollout.sh   (NOTES section 26: the Triton sampler, pointwise kernels and cuBLASLt
#                                                 in the step beside section 25's default, the 1.1B log-prob gap,
#                                                 GRPO against TRL, the 8B gap; ~9 minutes)
#   PART=9 bash benchmarks/run_h200_rollout.sh   (NOTES section 27: GRPO against TRL with the policy's layers compiled
#                                                 for training, TRL's row first, 2 warm-up + 6 timed steps; the 1.1B
#                                                 step at the final kernels; ~6 minutes)
# Results go to ${OUT:-benchmarks/results}/<date>-1xH200-rollout-next/ as each part finishes; every part is
# bounded by `timeout`; PACK=file.tgz tars the results after each.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RES=${OUT:-benchmarks/results}/$(date -u +%F)-1xH200-rollout-next
mkdir -p "$RES"
pack() { if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$RES" . ; fi; }
G="--workload grpo --shape 1b --nproc 1 --micro-batch 16 --seq-len 384 --response-len 256 --num-generations 8"
if [ "${PART:-1}" = 1 ]; then
timeout 190 python benchmarks/grpo_bench.py $G --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 1 --timeout 90 \
  --memory-at-rest --out "$RES/grpo_memory" > "$RES/grpo_memory.log" 2>&1; echo "memory rc=$?" >> "$RES/rc.txt"; pack
timeout 180 python benchmarks/grpo_bench.py $G --mixes trl-zero2,zero2-zero3 --warmup 1 --steps 3 --timeout 85 \
  --out "$RES/grpo_round" > "$RES/grpo_round.log" 2>&1; echo "grpo round rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 2 ]; then
timeout 260 python benchmarks/rollout_bench.py --shapes 1b --cases variants --variants fused1_split1_sdpa,fused1_split1_flex \
  --budget-s 230 --out "$RES/variants_flex_1b.json" > "$RES/variants_flex.log" 2>&1; echo "flex variants rc=$?" >> "$RES/rc.txt"
pack
fi
if [ "${PART:-1}" = 3 ]; then
timeout 500 python benchmarks/rollout_bench.py --shapes 1b --cases varlen,logprobs,full --kv-slots 512 --shared-prompt off,on \
  --repeats 2 --budget-s 450 --out "$RES/rollout_1b_shared.json" > "$RES/rollout_shared.log" 2>&1
echo "1b shared rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 4 ]; then
timeout 280 python benchmarks/dpo_race.py --out "$RES/dpo_race.jsonl" --sides trl,posttrain-ds-fp32 --rounds 1 \
  > "$RES/dpo_race.log" 2>&1; echo "dpo race rc=$?" >> "$RES/rc.txt"; pack
timeout 280 python benchmarks/distill_race.py --out "$RES/distill_race.jsonl" --sides trl,posttrain-ds-fp32 --rounds 1 \
  > "$RES/distill_race.log" 2>&1; echo "distill race rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 5 ]; then
timeout 90 python benchmarks/decode_attention_probe.py --shapes 128x768,16x512 --splits "" \
  --triton autox64,autox64:r,1x64,2x64,4x64,8x64,autox32,autox128,autox64:w2,autox64:w8,autox64:st3,autox128:w8 --out "$RES/decode_probe_triton.json" \
  > "$RES/decode_probe_triton.log" 2>&1; echo "triton probe rc=$?" >> "$RES/rc.txt"; pack
timeout 200 python benchmarks/rollout_bench.py --shapes 1b --cases variants --variants fused1_split1_sdpa,fused1_split1_triton \
  --budget-s 170 --out "$RES/variants_triton_1b.json" > "$RES/variants_triton.log" 2>&1; echo "triton variants rc=$?" >> "$RES/rc.txt"
pack
timeout 270 python benchmarks/rollout_bench.py --shapes 1b --cases varlen,step --kv-slots 512 \
  --shared-prompt off,triton,shared-triton --repeats 2 --budget-s 200 --out "$RES/rollout_1b_triton.json" \
  > "$RES/rollout_triton.log" 2>&1; echo "1b triton rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 6 ]; then
timeout 200 python benchmarks/rollout_bench.py --shapes 1b --cases logprobs,full --shared-prompt off,sdpa --repeats 2 \
  --budget-s 170 --out "$RES/rollout_1b_gap.json" > "$RES/rollout_1b_gap.log" 2>&1; echo "1b gap rc=$?" >> "$RES/rc.txt"; pack
timeout 280 python benchmarks/rollout_bench.py --shapes 8b --chunk 128 --prompts 16 --cases varlen,logprobs --kv-slots 128 \
  --shared-prompt off,sdpa --repeats 2 --budget-s 250 --out "$RES/rollout_8b_gap.json" > "$RES/rollout_8b_gap.log" 2>&1
echo "8b rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 7 ]; then
timeout 200 python benchmarks/grpo_bench.py $G --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 95 \
  --out "$RES/grpo_round" > "$RES/grpo_round.log" 2>&1; echo "grpo round rc=$?" >> "$RES/rc.txt"; pack
timeout 200 python benchmarks/rollout_bench.py --shapes 1b --cases variants --variants fused1_split1_sdpa,fused1_split1_triton,fused1_split1_triton:s8 \
  --budget-s 170 --out "$RES/variants_1b.json" > "$RES/variants_1b.log" 2>&1; echo "variants rc=$?" >> "$RES/rc.txt"; pack
timeout 110 python benchmarks/rollout_bench.py --shapes 1b --cases logprobs --shared-prompt off,sdpa --budget-s 100 \
  --out "$RES/gap_1b.json" > "$RES/gap_1b.log" 2>&1; echo "1b gap rc=$?" >> "$RES/rc.txt"; pack
timeout 130 python benchmarks/rollout_bench.py --shapes 8b --chunk 128 --prompts 16 --cases logprobs --shared-prompt off \
  --budget-s 120 --out "$RES/gap_8b.json" > "$RES/gap_8b.log" 2>&1; echo "8b gap rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 8 ]; then
timeout 200 python benchmarks/rollout_bench.py --shapes 1b --cases variants --budget-s 170 --out "$RES/variants_1b.json" \
  --variants fused1_split1_triton:nosampler:nopointwise:cublas,fused1_split1_triton:nopointwise,fused1_split1_triton \
  > "$RES/variants_1b.log" 2>&1; echo "variants rc=$?" >> "$RES/rc.txt"; pack
timeout 110 python benchmarks/rollout_bench.py --shapes 1b --cases logprobs --shared-prompt off,sdpa --budget-s 100 \
  --out "$RES/gap_1b.json" > "$RES/gap_1b.log" 2>&1; echo "1b gap rc=$?" >> "$RES/rc.txt"; pack
timeout 200 python benchmarks/grpo_bench.py $G --mixes zero2-zero3,trl-zero2 --warmup 1 --steps 3 --timeout 95 \
  --out "$RES/grpo_round" > "$RES/grpo_round.log" 2>&1; echo "grpo round rc=$?" >> "$RES/rc.txt"; pack
timeout 130 python benchmarks/rollout_bench.py --shapes 8b --chunk 128 --prompts 16 --cases logprobs --shared-prompt off \
  --budget-s 120 --out "$RES/gap_8b.json" > "$RES/gap_8b.log" 2>&1; echo "8b gap rc=$?" >> "$RES/rc.txt"; pack
fi
if [ "${PART:-1}" = 9 ]; then
timeout 330 python benchmarks/grpo_bench.py $G --mixes trl-zero2,zero2-zero3 --warmup 2 --steps 6 --timeout 160 \
  --out "$RES/grpo_round" > "$RES/grpo_round.log" 2>&1; echo "grpo round rc=$?" >> "$RES/rc.txt"; pack
timeout 150 python benchmarks/rollout_bench.py --shapes 1b --cases variants --budget-s 120 --out "$RES/variants_1b.json" \
  --variants fused1_split1_triton > "$RES/variants_1b.log" 2>&1; echo "variants rc=$?" >> "$RES/rc.txt"; pack
fi
