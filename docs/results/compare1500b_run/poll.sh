# One polling call on the lent machine: wait up to $1 seconds (or until the run is done), then copy
# what exists into $OUT (a lent machine goes back 30 s after a call: nothing may be left only there;
# at most 8 files come back, so each is an archive).
R=/root/push
end=$(( $(date +%s) + $1 ))
while [ "$(date +%s)" -lt "$end" ] && [ ! -f $R.finished ]; do sleep 15; done
date; cat /root/push.log /root/after.log 2>/dev/null; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
for f in $R/logs/train_*.log; do echo "== $f"; grep -E "^step|τ|selection|CE" "$f" | tail -2; done
ls $R/results 2>/dev/null
cp /root/bench_online.log /root/repo/benchmarks/results/online_smollm2_135m_*.json "$OUT/" 2>/dev/null
tar czf "$OUT/push.tgz" -C $R results logs $(cd $R && ls selection.json 2>/dev/null) 2>/dev/null
for h in $R/heads/*; do  # a finished head's files (not its checkpoints)
  [ -f "$h/train_summary.json" ] || continue
  tar czf "$OUT/head_${h##*/}.tgz" -C "$h" head $(cd "$h" && ls ./*.json ./*.jsonl)
done
true
