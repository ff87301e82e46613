# Started while the three heads trained (quality_push.sh validates only after all of them, and the
# dflash head trained at 55 % of the others' speed): quality_push.sh's driver stopped (its training
# processes go on), each head validated as soon as it finishes, with quality_push.sh's settings.
#   (setsid nohup bash docs/results/compare1500b_run/validate_as_done.sh > /root/after.log 2>&1 &)
R=/root/push
cd /root/repo || exit 1
export PYTHONPATH=/root/site:/root/repo HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
ps -eo pid=,args= | awk '$2 == "bash" && ($3 == "experiments/quality_push.sh" || $3 == "experiments/push_machine.sh") {print $1}' \
  | while read -r pid; do kill "$pid"; echo "stopped driver $pid"; done
declare -A settings=(
  [DFb]="model.variant=dflash model.block_size=5 validate.chain_lengths=[1,2,3,4]"
  [E3b]="model.variant=eagle3 validate.chain_lengths=[1,2,3,4,5]"
  [Rb]="model.variant=rmsnorm-restored validate.chain_lengths=[1,2,3,4,5]"
)
started=()
while [ ${#started[@]} -lt ${#settings[@]} ]; do
  for head in "${!settings[@]}"; do
    [[ " ${started[*]} " == *" $head "* ]] && continue
    [ -f "$R/heads/$head/train_summary.json" ] || continue
    started+=("$head")
    echo "[$(date +%T)] validate $head"
    for bench in mt_bench vicuna_bench long_inputs; do
      # shellcheck disable=SC2086  # the settings are words
      python3 -m mtp_train.validate model=smollm2_135m model.target=/root/smol run_dir=$R \
        "validate.head=$R/heads/$head/head" "validate.eval_files=[data/$bench.jsonl]" \
        "validate.report=$R/results/${head}_$bench.json" validate.batch_size=80 validate.max_new_tokens=256 \
        validate.num_prompts=null "validate.temperatures=[0.0,1.0]" ${settings[$head]} \
        > "$R/logs/validate_${head}_$bench.log" 2>&1 &
    done
  done
  sleep 10
done
wait
python3 -m experiments.quality_smollm2 selection "$R"
echo "[$(date +%T)] done"
touch $R.finished
