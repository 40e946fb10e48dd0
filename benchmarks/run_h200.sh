#!/usr/bin/env bash
# The 8B runs on 2xH200 (the second device call), writing to ${OUT}/r. The 1B runs were:
#   harness.py --workload dpo --shape 1b --micro-batch 4 --seq-len 512 --mixes all
#   harness.py --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --mixes all
# PPO at 8B: policy, reference and reward 8B, value 1B (two trained 8B models do not fit two GPUs
# under ZeRO-2). Micro batch 14 was the first planner's guess at the out-of-memory case; as run (the
# second device call) every PPO 8B mix here died on a device-side assert, the 1B value model then having
# a smaller vocabulary than the policy's token ids (fixed since). Those rows are not committed; the PPO
# 8B case was measured by run_h200_ppo8b.sh. Kept as the exact command of the DPO 8B and PPO 1B rows.
set -u
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
LOG=${OUT:-/tmp/out}/log.txt
E=$((SECONDS + ${BUDGET:-465}))
H="python3 benchmarks/harness.py --timeout 170 --out $R"
b() { local left=$((E - SECONDS)); echo $(( $1 < left ? $1 : left )); }
PPO8="--workload ppo --shape 8b --role-shape value=1b --seq-len 512 --response-len 64"
status() { python3 -c "import json,sys;print(' '.join(r['mix']+':'+r['status'] for r in json.load(open('$R/results.json'))['rows'] if r['case']==sys.argv[1]))" "$1"; }

$H $PPO8 --micro-batch 14 --mixes zero2-replicated,zero2-zero3 --budget "$(b 160)" 2>&1 | tee -a "$LOG" | grep '^\[bench\]'
s=$(status ppo-8b+value=1b-mb14-s512-r64)
mb=
case "$s" in *zero2-zero3:oom*) mb=11 ;; *zero2-replicated:ok*) mb=17 ;; esac
[ -n "$mb" ] && $H $PPO8 --micro-batch $mb --mixes zero2-replicated,zero2-zero3 --budget "$(b 150)" 2>&1 | tee -a "$LOG" | grep '^\[bench\]'
mb=${mb:-14}
$H --workload dpo --shape 8b --micro-batch 4 --seq-len 512 \
  --mixes zero2-zero3,zero2-replicated,zero3,trl-zero2,trl-zero3,zero2-zero3-offload --budget "$(b 200)" 2>&1 | tee -a "$LOG" | grep '^\[bench\]'
$H --workload ppo --shape 1b --micro-batch 8 --seq-len 512 --response-len 64 --mixes trl-zero3 --budget "$(b 75)" 2>&1 | tee -a "$LOG" | grep '^\[bench\]'
$H $PPO8 --micro-batch $mb --mixes zero2-zero3-offload,trl-zero2,zero3,trl-zero3 --budget "$(b 400)" 2>&1 | tee -a "$LOG" | grep '^\[bench\]'
tar czf "${OUT:-/tmp/out}/runs.tgz" -C "$R" runs && rm -rf "$R/runs"
ls "$R"
