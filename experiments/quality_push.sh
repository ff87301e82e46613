#!/usr/bin/env bash
# #22's levers on SmolLM2-135M-Instruct, one GPU, each stage through the project's entry points:
#   data  the target answers the shared chat prompts (N of them; the six-head experiment's 100
#         set-aside prompts and the long-input set's records kept out) and, with GSM8K=path, the
#         GSM8K questions, up to NEW new tokens per turn, every turn, greedy; the store written from
#         the generation's own states (regenerate.capture; precompute as the fallback), with
#         EAGLE-3's aux states (AUX=true); SAMPLES more answers per prompt at SAMPLE_T beside the
#         greedy ones ($R/sampled_<s>.jsonl); STOP_NEW= greedy answers up to that many new tokens,
#         each stopped where it repeats an earlier STOP_N-gram of itself ($R/stop_repeat.jsonl:
#         regenerate.stop_repeat, answers not cut where the target does not loop); LONG_MIX= long-input training prompts per task
#         (experiments.long_inputs mix) answered into $R/long_mix_answers.jsonl; ANSWERS= an
#         earlier machine's regenerated.jsonl.gz instead of answering again (a head trained on the
#         sampled or mix answers names their files in data.train_files and trains online: the store
#         holds the greedy answers only);
#   heads one line of HEADS each: "name steps overrides...", trained side by side on the one GPU
#         (a 135M target's head leaves most of an H200 idle), all with 32k-token micro-batches,
#         warm-up 30, lr LR (1.5e-3: chosen on the set-aside prompts in the six-head experiment)
#         unless the line sets train.lr; each head's teacher-forced CE on the 100 set-aside
#         prompts' answers is logged six times (does it still fall?), and at its last step it is
#         validated on them through the loop (τ at k = 4, greedy), the figure by which an lr is
#         chosen, never MT-bench: selection.json lists them; the default lines are the first
#         run's A / B / C;
#         DS_HEADS lists the heads trained under DeepSpeed ZeRO-2 instead of one process;
#   validation  of VAL_HEADS, each as soon as it is trained (beside the heads still training, so
#         its reports' seconds and tokens/s are measured sharing the GPU): MT-bench and
#         vicuna-bench, both turns, and the long-input set
#         (data/long_inputs.jsonl, LONG=true), VAL_NEW new tokens, batch 80, k = 1 … 5 (a dflash
#         head: up to its block's masks), TEMPS, per category, SSD hit rates (SSD: F = 1, 4, 8, 16; not
#         for dflash, which has no chained step to predict with); with TREES=head also EAGLE-2
#         trees of 4/16/32/64 nodes (depth 5) and Saguaro sampling (c = 0.5, 0.2) for that head.
#         PUBLISHED="name=dir ..." validates heads trained elsewhere the same way (a published one),
#         while the heads train (a 135M target leaves the GPU room for both; their reports' seconds
#         and tokens/s, and the heads' training speed, are then measured sharing the GPU).
#   STORE=false: no store: every HEADS line trains with train.states=online on the answers (a line
#         may still override both); with ANSWERS= the answers are only unpacked, not forwarded again.
# After experiments/gpu_machine.sh's set-up (the target converted, prompts and wheels in place).
# Every stage resumes. Runs and write-ups: docs/results/push_run, push2_run, push3_run.
#   (setsid nohup bash experiments/quality_push.sh > /root/push.log 2>&1 &)   # /root/push.done at the end
#
# Machine paths, each from the environment (the defaults are the lent machine's):
#   DATA_DIR  /root/dc                        the prompt files
#   CHAT      $DATA_DIR/chat_prompts.jsonl    the shared chat prompts
#   GSM8K     (empty: none)                   GSM8K questions to answer too, e.g. $DATA_DIR/gsm8k_train.jsonl
#   SITE      /root/site                      the installed wheels, put on PYTHONPATH
#   T         /root/smol                      the target (a HF directory)
#   R         /root/push                      the run directory; $R.done is touched at the end
# The experiment's knobs follow below, each with its default.
set -euo pipefail
: "${DATA_DIR:=/root/dc}"
: "${CHAT:=$DATA_DIR/chat_prompts.jsonl}"
: "${SITE:=/root/site}"
: "${T:=/root/smol}"
: "${R:=/root/push}"
trap 'touch "$R.done"' EXIT
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
N=${N:-14000}                       # chat prompts answered (null: all)
GSM8K=${GSM8K:-}                    # also answer these GSM8K questions (empty: none)
AUX=${AUX:-true}                    # store EAGLE-3's aux states (needed by eagle3 heads only)
TEMPS=${TEMPS:-[0.0,1.0]}
TREES=${TREES-B}                    # the head also validated with trees and Saguaro (empty: none)
HEADS=${HEADS:-"A 600 model.variant=rmsnorm-restored train.unroll_steps=3
B 1000 model.variant=rmsnorm-restored train.unroll_steps=4
C 1000 model.variant=eagle3 train.unroll_steps=4"}
NEW=${NEW:-1024}                    # new tokens per turn (regeneration)
STOP_REPEAT=${STOP_REPEAT:-0}       # regenerate.stop_repeat: stop answers at a repeated N-gram (0: off)
STOP_NEW=${STOP_NEW:-0}             # also greedy answers up to this many new tokens, stopped at a repeated
STOP_N=${STOP_N:-32}                # STOP_N-gram (regenerate.stop_repeat): $R/stop_repeat.jsonl (0: none)
SAMPLES=${SAMPLES:-0}               # also this many sampled answers per prompt: $R/sampled_<s>.jsonl, seed s
SAMPLE_T=${SAMPLE_T:-0.8}           # at this temperature (HEADS lines name the files they train on)
LONG_MIX=${LONG_MIX:-0}             # long-input training prompts per task (experiments.long_inputs mix),
                                    # answered into $R/long_mix_answers.jsonl (HEADS lines name it)
ANSWERS=${ANSWERS:-}                # a regenerated.jsonl.gz from an earlier machine: resumed, not redone
BATCH=${BATCH:-512}                 # regeneration batch
TOKENS=${TOKENS:-32768}             # per micro-batch
LR=${LR:-1.5e-3}                    # where a HEADS line does not set train.lr
VAL_NEW=${VAL_NEW:-256}
VAL_PROMPTS=${VAL_PROMPTS:-null}    # null: all 80
VAL_HEADS=${VAL_HEADS-all}          # the heads validated on MT-bench and vicuna-bench ("all", or names)
LONG=${LONG:-true}                  # also validate them on the long-input set
PUBLISHED=${PUBLISHED:-}            # "name=head_dir ...": heads from elsewhere, validated too
SSD=${SSD-[1,4,8,16]}               # SSD fan-outs validated with chained heads (empty: no SSD pass)
DS_HEADS=${DS_HEADS:-}              # heads trained under accelerate launch + DeepSpeed ZeRO-2 (one GPU)
SEL_PROMPTS=${SEL_PROMPTS:-100}     # set-aside prompts validated at the end of training
STORE=${STORE:-true}                # write the store (false: the heads train online)
GREEDY=${GREEDY:-true}              # answer the prompts greedily ($R/regenerated.jsonl); false (STORE=false
                                    # only): no greedy set, every HEADS line names its data.train_files
mkdir -p "$R/logs"
common=(model=smollm2_135m "model.target=$T" "run_dir=$R")
log() { echo "[$(date +%T)] $*"; }

# The six-head experiment's set-aside prompts (seed 0) stay out of the training data.
python3 -m experiments.quality_smollm2 split-prompts "$CHAT" "$R"
prompts=$R/prompts/chat_train.jsonl
[ -n "$GSM8K" ] && prompts="$prompts,$GSM8K"

data=("data.train_files=[$R/regenerated.jsonl]" data.max_seq_len=2048 "precompute.aux=$AUX")
store=$R/store
# An earlier machine's answers (its $R/regenerated.jsonl.gz): regenerate finds every id answered and
# only forwards them again for the store (about a minute instead of five).
if [ -n "$ANSWERS" ] && [ ! -f "$R/regenerated.jsonl" ]; then
  gzip -dc "$ANSWERS" > "$R/regenerated.jsonl.tmp" && mv "$R/regenerated.jsonl.tmp" "$R/regenerated.jsonl"
  [ "$STORE" = true ] || touch "$R/answers.done"  # a whole earlier answer set: nothing to regenerate
fi
regen=("regenerate.prompts=[$prompts]" "regenerate.limit=$N"
       "regenerate.max_new_tokens=$NEW" regenerate.max_prompt_tokens=1024 "regenerate.batch_size=$BATCH"
       "regenerate.stop_repeat=$STOP_REPEAT")
[ "$GREEDY" = true ] || [ "$STORE" != true ] || { log "GREEDY=false needs STORE=false"; exit 1; }
if [ "$STORE" != true ] && [ "$GREEDY" = true ] && [ ! -f "$R/answers.done" ]; then  # answers only, no store
  log regenerate  # resumes: the ids already answered are skipped
  python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "${data[@]}" > "$R/logs/regenerate.log" 2>&1
  touch "$R/answers.done"
elif [ "$STORE" = true ] && [ ! -f "$store/manifest.json" ]; then
  log regenerate
  start=$(date +%s)
  if python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "${data[@]}" regenerate.capture=true \
      > "$R/logs/regenerate.log" 2>&1; then
    echo "{\"regenerate_capture_s\": $(( $(date +%s) - start ))}" > "$R/data_times.json"
  else  # the answers written so far stay; the rest without capture, then precompute
    log "capture failed (see logs/regenerate.log): regenerate + precompute"
    python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "${data[@]}" \
      > "$R/logs/regenerate_plain.log" 2>&1
    store=$R/store_precomputed
    python3 -m mtp_train.precompute "${common[@]}" "${data[@]}" "precompute.store_dir=$store" \
      precompute.tokens_per_batch=65536 > "$R/logs/precompute.log" 2>&1
  fi
fi
[ -f "$R/store_precomputed/manifest.json" ] && store=$R/store_precomputed
# a copy small enough to carry to the next machine (ANSWERS=)
if [ "$GREEDY" = true ] && [ ! -f "$R/regenerated.jsonl.gz" ]; then  # whole or absent: a kill mid-write leaves only the .tmp
  gzip -c "$R/regenerated.jsonl" > "$R/regenerated.jsonl.gz.tmp" && mv "$R/regenerated.jsonl.gz.tmp" "$R/regenerated.jsonl.gz"
fi
if [ "$LONG_MIX" -gt 0 ] && [ ! -f "$R/long_mix.done" ]; then  # the long-input data mix, answered
  log "long-input mix ($LONG_MIX per task)"
  python3 -m experiments.long_inputs mix "$R/prompts/chat_train.jsonl" "$R/prompts/long_mix.jsonl" "$LONG_MIX"
  python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "regenerate.prompts=[$R/prompts/long_mix.jsonl]" \
    regenerate.limit=null "regenerate.output=$R/long_mix_answers.jsonl" > "$R/logs/long_mix.log" 2>&1
  touch "$R/long_mix.done"
fi
for s in $(seq 1 "$SAMPLES"); do  # several sampled answers per prompt beside the greedy one
  [ -f "$R/sampled_$s.done" ] && continue
  log "sampled answers $s (T = $SAMPLE_T)"
  python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "regenerate.temperature=$SAMPLE_T" \
    "regenerate.seed=$s" "regenerate.output=$R/sampled_$s.jsonl" > "$R/logs/sampled_$s.log" 2>&1
  touch "$R/sampled_$s.done"
done

if [ "$STOP_NEW" -gt 0 ] && [ ! -f "$R/stop_repeat.done" ]; then  # answers not cut at NEW where they do not loop
  log "greedy answers up to $STOP_NEW new tokens, stopped at a repeated $STOP_N-gram"
  python3 -m mtp_train.regenerate "${common[@]}" "${regen[@]}" "regenerate.max_new_tokens=$STOP_NEW" \
    "regenerate.stop_repeat=$STOP_N" "regenerate.output=$R/stop_repeat.jsonl" > "$R/logs/stop_repeat.log" 2>&1
  touch "$R/stop_repeat.done"
fi

train() {  # name, steps, overrides...
  local name=$1 steps=$2 lr=() states=()
  shift 2
  [ -f "$R/heads/$name/train_summary.json" ] && return
  [[ " $* " == *" train.lr="* ]] || lr=("train.lr=$LR")
  [ "$GREEDY" = true ] || [[ " $* " == *" data.train_files="* ]] ||
    { log "$name: GREEDY=false makes no answer set of its own: its line must set data.train_files"; return 1; }
  [ "$STORE" = true ] || states=(train.states=online "${data[@]}")  # before the line's own: it may override
  local launch=(python3 -m)
  # one DeepSpeed run at a time: its single process still takes the rendezvous port
  [[ " $DS_HEADS " == *" $name "* ]] && launch=(accelerate launch --config_file launch/accelerate/zero2_1gpu.yaml -m)
  "${launch[@]}" mtp_train.train "${common[@]}" "train.store_dir=$store" "train.out_dir=$R/heads/$name" \
    "train.steps=$steps" "train.tokens_per_micro_batch=$TOKENS" train.warmup_steps=30 "${lr[@]}" "${states[@]}" \
    "train.save_every=$(( steps / 2 ))" logging.log_every=10 "train.validate_every=$(( steps / 6 ))" \
    "train.spec_validate_at=[$steps]" \
    "validate.eval_files=[$R/prompts/selection.jsonl]" "validate.num_prompts=$SEL_PROMPTS" validate.batch_size=100 \
    "validate.max_new_tokens=$VAL_NEW" "validate.chain_lengths=[4]" validate.teacher_forced_samples=64 \
    "$@" > "$R/logs/train_$name.log" 2>&1
}
validate() {  # head name, head dir, report name, prompts file, overrides...
  local head=$1 dir=$2 name=$3 prompts=$4
  shift 4
  local report=$R/results/${head}_$name.json
  [ -f "$report" ] && return
  python3 -m mtp_train.validate "${common[@]}" "validate.head=$dir" \
    "validate.eval_files=[$prompts]" "validate.report=$report" validate.batch_size=80 \
    "validate.max_new_tokens=$VAL_NEW" "validate.num_prompts=$VAL_PROMPTS" \
    "validate.temperatures=$TEMPS" "$@" > "$R/logs/validate_${head}_$name.log" 2>&1
}
drafts() {  # a head's overrides -> its variant and the chains (or blocks) it is validated with
  local variant block
  variant=$(tr ' ' '\n' <<< "$*" | grep '^model.variant=' || true)
  if [ "$variant" = model.variant=dflash ]; then  # k up to the block's masks, at most 5; no SSD
    block=$(tr ' ' '\n' <<< "$*" | grep '^model.block_size=' | cut -d= -f2 || true)
    echo "$variant validate.chain_lengths=[$(seq -s, 1 $(( ${block:-8} - 1 < 5 ? ${block:-8} - 1 : 5 )))]"
  else
    echo "$variant validate.chain_lengths=[1,2,3,4,5]${SSD:+ validate.ssd_fan_outs=$SSD}"
  fi
}
benches() {  # head name, head dir, overrides...: each benchmark, side by side
  local head=$1 dir=$2 settings
  shift 2
  settings=$(drafts "$@")
  # shellcheck disable=SC2086  # the settings are words
  validate "$head" "$dir" mt_bench data/mt_bench.jsonl $settings &
  # shellcheck disable=SC2086
  validate "$head" "$dir" vicuna_bench data/vicuna_bench.jsonl $settings &
  # shellcheck disable=SC2086
  [ "$LONG" != true ] || validate "$head" "$dir" long_inputs data/long_inputs.jsonl $settings &
}
# heads from elsewhere: validated while the heads train (their kind and block from the head's own
# config, what drafts() reads)
for pair in $PUBLISHED; do
  dir=${pair#*=}
  # shellcheck disable=SC2046  # the settings are words
  OMP_NUM_THREADS=2 benches "${pair%%=*}" "$dir" $(python3 -c 'import sys; from inference_ref.head_files import read_native_config
c = read_native_config(sys.argv[1]); print("model.variant=" + c["variant"], "model.block_size=%d" % c.get("block_size", 8))' "$dir")
done
trained_then_validated() {  # name, steps, overrides: in a subshell of its own (run with &)
  local name=$1
  export OMP_NUM_THREADS=4  # the heads share the cores
  train "$@" || { log "training $name failed: see $R/logs/train_$name.log"; return 1; }
  shift 2
  [[ "$VAL_HEADS" == all || " $VAL_HEADS " == *" $name "* ]] || return 0
  log "validate $name"  # as soon as it is trained: the GPU does not wait for the slowest head
  export OMP_NUM_THREADS=2  # up to three benchmarks side by side
  benches "$name" "$R/heads/$name/head" "$@"
  wait
}
log train
while read -r name steps overrides; do
  # shellcheck disable=SC2086  # the overrides are words
  trained_then_validated "$name" "$steps" $overrides &
done <<< "$HEADS"
wait  # every head trained and validated (a failed one named, the others go on), the published ones too
python3 -m experiments.quality_smollm2 selection "$R"   # each head's set-aside τ: $R/selection.json
[ -z "$TREES" ] || validate "$TREES" "$R/heads/$TREES/head" mt_bench_trees data/mt_bench.jsonl model.variant=rmsnorm-restored \
  "validate.chain_lengths=[1,2,3,4,5]" "validate.ssd_fan_outs=[1,4,8,16]" \
  "validate.tree_budgets=[4,16,32,64]" validate.tree_depth=5 "validate.saguaro_factors=[0.5,0.2]"
log done
