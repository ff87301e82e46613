#!/usr/bin/env bash
# One polling call for speed_run.sh on the lent machine: wait up to $1 seconds (or until the run has
# finished), print its log, then pack what exists (logs and the finished benchmarks' JSON) into
# $OUT/speed.tgz: one file, since a call brings back at most 8.
#   bash /root/repo/benchmarks/speed_poll.sh 540 [/root/speed]
log=${2:-/root/speed}
end=$(( $(date +%s) + $1 ))
while [ "$(date +%s)" -lt "$end" ] && [ ! -f "$log.finished" ]; do sleep 10; done
date; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
cat "$log.log" 2>/dev/null
ls "$log/results" 2>/dev/null
# the finished verify-cost runs and projection checks, oldest first, as docs/benchmarks.md's rows
# (benchmarks/step_table.py)
steps=$(ls -tr "$log"/results/verify_cost_*.json "$log"/results/projection_check_*.json 2>/dev/null)
[ -n "$steps" ] && (cd "$(dirname "$0")/.." && python3 -m benchmarks.step_table $steps)
tar czf "$OUT/speed.tgz" -C "$(dirname "$log")" "$(basename "$log")" && echo "packed $OUT/speed.tgz"
