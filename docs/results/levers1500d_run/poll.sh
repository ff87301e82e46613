# One polling call on the lent machine: wait up to $1 seconds (or until both runs are finished),
# then copy what exists into $OUT (the machine goes back 30 s after a call: nothing may be left only
# there; at most 8 files come back, so each is an archive).
RS="/root/push /root/push_sr"
finished() { for R in $RS; do [ -f "$R.finished" ] || return 1; done; }
end=$(( $(date +%s) + $1 ))
while [ "$(date +%s)" -lt "$end" ] && ! finished; do sleep 15; done
date; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
for R in $RS; do
  echo "==== $R"; cat "$R.log" 2>/dev/null; ls "$R" "$R/results" 2>/dev/null | tr '\n' ' '; echo
  for f in "$R"/logs/train_*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^step|^head" "$f" | tail -2; }; done
  tar czf "$OUT/${R##*/}.tgz" -C "$R" $(cd "$R" && ls -d results logs selection.json 2>/dev/null) 2>/dev/null
  for h in "$R"/heads/*; do  # a finished head's files (not its checkpoints)
    [ -f "$h/train_summary.json" ] || continue
    tar czf "$OUT/head_${h##*/}.tgz" -C "$h" head $(cd "$h" && ls ./*.json ./*.jsonl)
  done
done
true
