#!/usr/bin/env bash
# Issue 7's measurements on 2xH200 (device kind nvidia-h200-x2), writing under ${OUT}.
#   STAGE=probe1b : frozen_probe.py at 1B with a profile, then DPO 1B through the harness, the mixes
#                   in two rounds of alternating order, 20 measured steps each.
#   STAGE=p2p     : after the copy-engine transport: the probe at 1B again (both transports), DPO 1B
#                   in three rounds of alternating order, PPO 1B (time/score).
#   STAGE=more    : after the rotary-buffer fix: the probe at 1B and 3B; DPO 3B in two rounds.
#   STAGE=final   : DPO 1B and PPO 1B, two rounds each, into benchmarks/results/2026-11-30-2xH200-frozen.
#   STAGE=views, views2, views3 : after the parameter-views change (see the cases below).
set -u
O=${OUT:-/tmp/out}
P="torchrun --standalone --nproc_per_node 2 benchmarks/frozen_probe.py --out $O/p"
H="python benchmarks/harness.py --timeout 120"
DPO1="--workload dpo --shape 1b --micro-batch 4 --seq-len 512 --steps 20"
FINAL=benchmarks/results/2026-11-30-2xH200-frozen
case "${STAGE:-probe1b}" in
probe1b)
  $P --shape 1b --profile > "$O/probe-1b.log" 2>&1; tail -45 "$O/probe-1b.log"
  $H $DPO1 --mixes zero2-zero3,zero2-replicated,zero2-zero3-stock --out "$O/r1" 2>&1 | grep '^\[bench\]'
  $H $DPO1 --mixes zero2-replicated,zero2-zero3 --out "$O/r2" 2>&1 | grep '^\[bench\]'
  ;;
p2p)
  $P --shape 1b --profile > "$O/probe-1b.log" 2>&1; tail -60 "$O/probe-1b.log"
  $H --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --steps 12 --rounds 3 \
     --mixes zero2-zero3,zero2-replicated --out "$O/r1" 2>&1 | grep '^\[bench\]'
  $H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --steps 6 \
     --mixes zero2-zero3,zero2-replicated --out "$O/r4" 2>&1 | grep '^\[bench\]'
  ;;
more)
  $P --shape 1b --repeat 12 > "$O/probe-1b.log" 2>&1; tail -70 "$O/probe-1b.log"
  $P --shape 3b --repeat 12 > "$O/probe-3b.log" 2>&1; tail -70 "$O/probe-3b.log"
  $H --workload dpo --shape 3b --micro-batch 4 --seq-len 512 --steps 8 --rounds 2 \
     --mixes zero2-zero3,zero2-replicated --out "$O/r3" 2>&1 | grep '^\[bench\]'
  ;;
final)
  # Rows accumulate in the committed results directory (copied back from $O/final.tgz).
  $H --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --steps 12 --rounds 2 --budget 150 --min-run 25 \
     --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  $H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --steps 5 --rounds 2 --budget 230 \
     --min-run 40 --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  rm -rf "$FINAL/runs"; tar czf "$O/final.tgz" "$FINAL"
  ;;
views)
  # After parameters became permanent views of freed flat vectors (13 operator calls per unit on
  # the CPU instead of 39): the probe at 1B, then DPO 1B in three rounds into the committed results.
  $P --shape 1b --repeat 12 > "$O/probe-1b.log" 2>&1; tail -40 "$O/probe-1b.log"
  $H --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --steps 12 --rounds 3 --budget 420 --min-run 30 \
     --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  rm -rf "$FINAL/runs"; tar czf "$O/final.tgz" "$FINAL"
  ;;
views2)
  # After local parameters became views of the rank's own slice (a gather copies only the other
  # ranks' bytes): the probe at 1B, then DPO 1B in four rounds into the committed results.
  $P --shape 1b --repeat 12 > "$O/probe-1b.log" 2>&1; tail -40 "$O/probe-1b.log" | grep -A12 '"forward_ms"'
  $H --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --steps 10 --rounds 4 --budget 330 --min-run 35 \
     --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  rm -rf "$FINAL/runs"; tar czf "$O/final.tgz" "$FINAL"
  ;;
views3)
  # PPO 1B and DPO 3B, two rounds each, into the committed results.
  $H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --steps 5 --rounds 2 --budget 250 \
     --min-run 40 --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  $H --workload dpo --shape 3b --micro-batch 4 --seq-len 512 --steps 8 --rounds 2 --budget 290 --min-run 50 \
     --mixes zero2-zero3,zero2-replicated --out "$FINAL" 2>&1 | grep '^\[bench\]'
  rm -rf "$FINAL/runs"; tar czf "$O/final.tgz" "$FINAL"
  ;;
esac
# Everything but the trace in one archive (the device returns at most 8 files).
cd "$O" && tar czf results.tgz --exclude='trace-*' --exclude=results.tgz . && find . -mindepth 1 -maxdepth 1 -type d ! -name p -exec rm -rf {} + ; ls -la "$O" "$O/p"
