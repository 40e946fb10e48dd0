python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PYTHONPATH
# One H200, one call (issues 21 and 22): GRPO with LoRA at 8B, SFT and reward 1.1B, each race's sides in
# fresh processes against TRL's own trainers (benchmarks/race.py). Run from the repository root with the
# wheels in .whl/ (../shared/tools/gpu-wheels.sh):   bash benchmarks/run_h200_races.sh
# Results go to ${OUT:-benchmarks/results}/<date>-1xH200-races/ as each row finishes (<race>.jsonl,
# results.md, commands.txt, logs/). Budget: about 8 minutes of GPU time; each race is also bounded by
# `timeout`, so the call ends inside 10 minutes even if a row runs long (rows already written stay).
# Estimates per row (fresh process: ~15 s of imports and start-up, plus loading, plus the steps) below.
# TINY=1 runs the same calls at --shape tiny with 1 warm-up + 1 timed step (a CPU check of this script:
# DS_ACCELERATOR=cpu TINY=1 OUT=/tmp/races PATH=<venv>/bin:$PATH bash benchmarks/run_h200_races.sh).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RES=${OUT:-benchmarks/results}/$(date -u +%F)-1xH200-races
mkdir -p "$RES"
git rev-parse HEAD > "$RES/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$RES/gpu.txt" 2>&1 || true
if [ "${TINY:-0}" = 1 ]; then G8=tiny; G1=tiny; W="--warmup 1 --steps 1"; WG="$W"; else G8=8b; G1=1b; W="--warmup 2 --steps 5"; WG="--warmup 2 --steps 3"; fi
t() { if [ "${TINY:-0}" = 1 ]; then echo $(( $1 * 5 )); else echo "$1"; fi; }  # a busy CPU is slower
run() { echo "+ $*" | tee -a "$RES/log.txt"; "$@" 2>&1 | grep -v -i "warn" | tail -n 25 | tee -a "$RES/log.txt"; }

# GRPO 8B, 16 completions x 256 tokens per step (2 prompts x 8), LoRA r 16 alpha 32 all-linear, 2 warm-up + 3
# timed steps; about 300 s in all:
#   building the random 8B model and saving it (16 GB), once, inside the first row: ~60 s
#   posttrain-lora: load 16 GB ~15 s, the engine's compile at 8B ~30-50 s, 5 steps x ~2-3 s: ~90 s
#   trl-lora: load ~15 s, 5 steps x 15.8 s (measured before: 15.8 s/step, 20.4 GiB): ~100 s
#   posttrain-full: policy + reference loaded (32 GB), then out of memory when DeepSpeed allocates fp32
#   master weights and Adam states (~16 B/param = 128 GB): ~40 s, an `oom` row
run timeout -k 10 $(t 330) python3 benchmarks/grpo_lora_race.py --shape $G8 $WG --rounds 1 \
    --sides posttrain-lora,trl-lora,posttrain-full --timeout $(t 200) --out "$RES"

# SFT 1.1B, sequences of 2048 tokens, 8 rows per step, bf16 states both sides, sdpa, 2 warm-up + 5 timed;
# each row ~30 s (the first also builds the 1.1B model, ~10 s; steps ~0.5-1.5 s: under sdpa a padding-free
# row of 8 x 2048 tokens attends over all 16k positions with a block mask): ~160 s in all
#   trl-packed, posttrain-packed: bfd packing (TRL's default strategy) on both
#   posttrain-padded, posttrain-padding-free, trl-padding-free: mixed lengths (about 120-1900 tokens), 8 per step
# posttrain's padding-free and packed rows run its own default attention (varlen on CUDA: NOTES section 17)
run timeout -k 10 $(t 175) python3 benchmarks/sft_race.py --shape $G1 $W --rounds 1 --attn-posttrain default \
    --sides trl-packed,posttrain-packed,posttrain-padded,posttrain-padding-free,trl-padding-free --timeout $(t 90) --out "$RES"

# Reward model 1.1B, 8 pairs x 1024 tokens per side per step, bf16 states both sides, 2 warm-up + 5 timed;
# each row ~30 s: ~60 s in all
run timeout -k 10 $(t 75) python3 benchmarks/reward_race.py --shape $G1 $W --rounds 1 \
    --sides trl,posttrain --timeout $(t 65) --out "$RES"

cat "$RES/results.md"
