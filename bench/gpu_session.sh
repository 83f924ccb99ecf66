#!/usr/bin/env bash
# bench/gpu_session.sh: a lent GPU machine's whole session in one command: the rollout engines, the update, the
# memory planner, and the NQ recipe, each in a time budget, then one summary and OUT/session.json for
# bench/RESULTS.md. The machines lent to this project: one H100 or H200, 16 cores, torch 2.11 and transformers 5.17,
# no vLLM, no network, at most ~9 minutes a command, 64 MiB carried a call (the working tree included).
#
# 1. Here, on the CPU, once: `.venv/bin/python bench/gpu_payload.py build` (minutes). It builds what the machine
#    lacks (wheels, SmolLM2's GGUF, the MiniLM encoder in fp16, the NQ/TriviaQA questions and corpus, the
#    real_model_learns split and its MiniLM index; bench/gpu_payload.py says what and why) into
#    .cache/gpu_payload/parts/payload.tar.gz.NN (parts of even size, each under 64 MiB less the working tree) and
#    .cache/gpu_payload/manifest.json, and prints the calls: one part a call, the manifest every time. When the tree
#    has grown since, `bench/gpu_payload.py resplit` cuts the same payload again.
# 2. There, one call per part, one after another (the parts wait in /tmp only while the machine stays warm,
#    30 s after a call):
#      calls 1 .. N-1: carry [".cache/gpu_payload/manifest.json", ".cache/gpu_payload/parts/payload.tar.gz.K"],
#                      command `python3 bench/gpu_payload.py receive`
#      call N:         carry [".cache/gpu_payload/manifest.json", ".cache/gpu_payload/parts/payload.tar.gz.N-1"],
#                      command `bash bench/gpu_session.sh`, timeout_s 600
#    The session's setup step reassembles the payload: `bench/gpu_payload.py unpack` joins and checks the parts,
#    extracts them into .cache/gpu_payload/unpacked/, installs the wheels into /tmp/agent_rl_site (first on
#    PYTHONPATH from then on), restores MiniLM to fp32, points the index at it, and converts SmolLM2 into
#    .cache/smollm2-135m.
#
# Usage: bench/gpu_session.sh [STEP ...]   (steps: engines update planner nq; default all four, in that order;
#        steps named run in the order named, e.g. `bench/gpu_session.sh nq engines` gives the recipe the time first)
# Steps, each given at most its budget (seconds) and at most what is left of SESSION_S (default 540) less
# RESERVE_S (15, for the summary); a step with under MIN_STEP_S (20) left is skipped with a line:
#   setup    90  CUDA or not, the device's name; the payload, when carried, unpacked (on a CUDA machine only)
#   engines 120  bench/gpu_session.py engines: bench/engines.py's hf (graph decode), hf-dynamic and paged engines, in
#                that order, each on both models before the next, at 128 and 512 rows, 256 new
#                tokens, on SmolLM2-135M and on the smollm2-1.7b shape (random weights), beside the memory-bandwidth
#                bound (weights and KV read once a decode step at the datasheet's 3.35 TB/s (H100 SXM) or 4.8 TB/s
#                (H200)). Needs `--device` in bench/engines.py on CUDA; skipped with a line where it has none.
#   update   75  bench/update_throughput.py at caps 2,560 to 65,536 tokens: SmolLM2 with the NQ config's LoRA, then
#                the 1.7B shape with full weights and gradient checkpointing; s per micro-batch, tokens/s, model
#                FLOPs and MFU (what is counted: bench/update_throughput.py's docstring)
#   planner  90  bench/plan_vs_measured_gpu.py on the 1.7B and Qwen2.5-3B shapes (random weights; the planner was
#                fitted on SmolLM2-135M only), LoRA and full weights, configs/nq_hotpotqa_grpo.yaml's budgets. CUDA only
#   nq     rest  bench/real_model_learns.py: SmolLM2 + LoRA, 20 GRPO steps of 16 groups, greedy evaluation of 500
#                NQ and 300 TriviaQA held-out questions before and after with the paired interval, on the engine
#                the engines step found fastest (hf where it measured none), micro-batch cap NQ_CAP (32768), the
#                payload's index served by a retriever on the CPU. CUDA only. By the last H200 run (bench/RESULTS.md)
#                it needs more than steps 1-3 leave: `bench/gpu_session.sh nq`, a call of its own, completes it.
#                A payload built with `--index there` has its index built here first, on the GPU.
# On a CPU the planner and nq steps are skipped with a line; GPU_SESSION_SMOKE=1 makes every step tiny (2 rows of
# 8 tokens, one cap of 512 tokens, the `smoke` shape, 2 GRPO steps): tests/test_gpu_session.py runs it on the CPU.
#
# Environment: OUT (runs/gpu_session; runs/gpu_session_smoke with GPU_SESSION_SMOKE=1), MODEL (.cache/smollm2-135m),
# PY (.venv/bin/python, else python3), SESSION_S, RESERVE_S, MIN_STEP_S, BUDGET_SETUP, BUDGET_ENGINES, BUDGET_UPDATE,
# BUDGET_PLANNER, BUDGET_NQ (the rest), BASELINE_TREE (update: an A/B/A against an older tree's
# agent_rl, bench and configs, at caps 2,560 and 32,768), NQ_ENGINE (instead of the engines step's choice), NQ_CAP, GPU_PAYLOAD_SITE (/tmp/agent_rl_site),
# GPU_SESSION_SMOKE, GPU_SESSION_UNPACK (1: unpack a carried payload on a machine without CUDA too).
# Writes OUT/session.log (all of it), OUT/steps.tsv, OUT/engines.json, OUT/update_*.json, OUT/planner.json,
# OUT/nq/ (the recipe's results.json, results.md, logs), OUT/session.json (the steps of this run, in one file).
# shellcheck disable=SC2317  # the step functions are called through `step`, which shellcheck cannot follow
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

SMOKE=${GPU_SESSION_SMOKE:-0}
if [ "$SMOKE" = 1 ]; then OUT=${OUT:-runs/gpu_session_smoke}; else OUT=${OUT:-runs/gpu_session}; fi
MODEL=${MODEL:-.cache/smollm2-135m}
SESSION_S=${SESSION_S:-540}
RESERVE_S=${RESERVE_S:-15}
MIN_STEP_S=${MIN_STEP_S:-20}
NQ_CAP=${NQ_CAP:-32768}
SITE=${GPU_PAYLOAD_SITE:-/tmp/agent_rl_site}
PAYLOAD=.cache/gpu_payload/unpacked
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
export GPU_PAYLOAD_SITE=$SITE
# agent_rl importable by every script and the processes they start, where it is not installed (a lent machine)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(engines update planner nq)
for s in "${STEPS[@]}"; do
  case $s in
    engines | update | planner | nq) ;;
    *) echo "usage: bench/gpu_session.sh [engines|update|planner|nq ...] (unknown step: $s)" >&2; exit 2 ;;
  esac
done

START=$(date +%s)
DEADLINE=$((START + SESSION_S))
CUDA=0
DEVICE=cpu
STEP_END=$DEADLINE
STATUS=ok
NOTE=
SERVER=

now() { date +%s; }

record() { # NAME STATUS SECONDS BUDGET NOTE
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$OUT/steps.tsv"
  echo "== $1: $2 in $3 s of $4 s${5:+: $5}"
}

within() { # CMD ...: run it in what is left of the step (exit 124 when cut there)
  local left=$((STEP_END - $(now)))
  ((left > 0)) || return 124
  timeout --kill-after=5 "$left" "$@"
}

within_at_most() { # SECONDS CMD ...: as within, given at most SECONDS
  local cap=$1 left=$((STEP_END - $(now)))
  shift
  ((left < cap)) || left=$cap
  ((left > 0)) || return 124
  timeout --kill-after=5 "$left" "$@"
}

skip() { # NOTE: a step function's way to say it does not run here
  STATUS=skipped
  NOTE=$1
}

have_model() { [ -f "$MODEL/config.json" ] && compgen -G "$MODEL/*.safetensors" >/dev/null; }

step() { # NAME BUDGET FUNCTION
  local name=$1 budget=$2 fn=$3 left t0 rc=0
  left=$((DEADLINE - RESERVE_S - $(now)))
  ((budget <= left)) || budget=$left
  if ((budget < MIN_STEP_S)); then
    record "$name" skipped 0 "$budget" "out of time: $((DEADLINE - $(now))) s of the session's $SESSION_S s left"
    return
  fi
  echo "== $name (budget $budget s)"
  STATUS=ok NOTE='' STEP_END=$(($(now) + budget))
  t0=$(now)
  "$fn" || rc=$?
  case $rc in
    0) record "$name" "$STATUS" $(($(now) - t0)) "$budget" "$NOTE" ;;
    124 | 137) record "$name" cut $(($(now) - t0)) "$budget" "stopped at its budget${NOTE:+; $NOTE}" ;;
    *) record "$name" failed $(($(now) - t0)) "$budget" "exit $rc${NOTE:+; $NOTE}" ;;
  esac
}

setup() {
  local name=cpu driver=''
  if command -v nvidia-smi >/dev/null 2>&1 &&
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    CUDA=1 DEVICE=cuda:0
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | head -1)
    driver=$(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader -i 0 | head -1)
  fi
  if [ ! -f .cache/gpu_payload/manifest.json ]; then
    NOTE="no payload carried (.cache/gpu_payload/manifest.json)"
  elif [ "$CUDA" = 1 ] || [ "${GPU_SESSION_UNPACK:-0}" = 1 ]; then
    within "$PY" bench/gpu_payload.py unpack || return $?
  else
    NOTE="the payload is for the GPU machine: not unpacked here (GPU_SESSION_UNPACK=1 would)"
  fi
  if [ -d "$SITE" ] && { [ "$CUDA" = 1 ] || [ "${GPU_SESSION_UNPACK:-0}" = 1 ]; }; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -c 'import json, sys; json.dump(dict(zip(sys.argv[2::2], sys.argv[3::2])), open(sys.argv[1], "w"), indent=1)' \
    "$OUT/session_env.json" date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" host "$(uname -n)" device "$name" \
    driver_memory "$driver" smoke "$SMOKE" session_s "$SESSION_S" cpus "$(nproc)" steps "${STEPS[*]}"
  NOTE="${NOTE:+$NOTE; }$name$([ "$CUDA" = 1 ] || echo ', no CUDA'); model $MODEL$(have_model || echo ' (missing)')"
}

engines() {
  have_model || { skip "no model in $MODEL (the payload converts SmolLM2 there; or set MODEL=DIR)"; return 0; }
  local shape=smollm2-1.7b new=256 rows=(128 512) names=(hf hf-dynamic paged)
  if [ "$SMOKE" = 1 ]; then
    rows=(2) new=8
    if [ "$CUDA" = 1 ]; then shape=smoke; else shape='' names=(hf); fi
  fi
  rm -f "$OUT/engines.json"
  local rc=0
  within "$PY" bench/gpu_session.py engines --model "$MODEL" ${shape:+--shape "$shape"} --rows "${rows[@]}" \
    --new-tokens "$new" --engines "${names[@]}" --device "$DEVICE" --seconds $((STEP_END - $(now) - 10)) \
    --out "$OUT/engines.json" || rc=$?
  if ((rc == 3)); then skip "bench/engines.py has no --device flag: its workers would run on the CPU"; return 0; fi
  return "$rc"
}

update() {
  have_model || { skip "no model in $MODEL"; return 0; }
  local shape=smollm2-1.7b repeats=3 caps=(2560 8192 16384 32768 65536) over=(rollout.engine=hf) rc=0
  if [ "$CUDA" = 1 ]; then over+=(train.bf16=true model.dtype=bfloat16); fi
  if [ "$SMOKE" = 1 ]; then shape=smoke repeats=1 caps=(512); fi
  local args=(--model "$MODEL" --device "$DEVICE" --repeats "$repeats" --caps "${caps[@]}")
  rm -f "$OUT"/update_*.json
  # SmolLM2's LoRA update is quick: at most 40% of the step, the rest for the 1.7B shape (smoke: no share)
  local share=$(((STEP_END - $(now)) * 2 / 5))
  if [ "$SMOKE" = 1 ]; then share=$((STEP_END - $(now))); fi
  within_at_most "$share" "$PY" bench/update_throughput.py "${args[@]}" \
    --json "$OUT/update_lora.json" "${over[@]}" || rc=$?
  if [ -n "${BASELINE_TREE:-}" ] && [ -f "$BASELINE_TREE/bench/update_throughput.py" ]; then
    # the same LoRA micro-batch on an older tree (a `git archive` of agent_rl, bench and configs), then on this one
    # again: an A/B/A on one device, for a change to the update's code
    local abcaps=(2560 32768) py=$PY
    if [ "$SMOKE" = 1 ]; then abcaps=("${caps[@]}"); fi
    local ab=(--model "$(realpath -s "$MODEL")" --device "$DEVICE" --repeats "$repeats" --caps "${abcaps[@]}")
    [[ $py != */* ]] || py=$(realpath -s "$py")
    within_at_most "$share" env -C "$BASELINE_TREE" "$py" bench/update_throughput.py "${ab[@]}" \
      --json "$(realpath -s "$OUT")/update_lora_baseline.json" "${over[@]}" || rc=$?
    within_at_most "$share" "$PY" bench/update_throughput.py "${ab[@]}" \
      --json "$OUT/update_lora_again.json" "${over[@]}" || rc=$?
  fi
  within "$PY" bench/update_throughput.py "${args[@]}" --shape "$shape" --full-weights \
    --json "$OUT/update_${shape}_full_checkpointed.json" "${over[@]}" model.gradient_checkpointing=true || rc=$?
  return "$rc"
}

planner() {
  [ "$CUDA" = 1 ] || { skip "needs CUDA (torch.cuda's allocator statistics)"; return 0; }
  have_model || { skip "no model in $MODEL (the 1.7B shape takes its config)"; return 0; }
  local shapes=(smollm2-1.7b qwen2.5-3b)
  if [ "$SMOKE" = 1 ]; then shapes=(smoke); fi
  rm -f "$OUT/planner.json"
  within "$PY" bench/plan_vs_measured_gpu.py --model "$MODEL" --shape "${shapes[@]}" \
    --config configs/nq_hotpotqa_grpo.yaml --out "$OUT/planner.json"
}

stop_server() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; SERVER=; fi
}

nq() {
  if [ "$CUDA" != 1 ]; then
    skip "needs CUDA (on a CPU the recipe is bench/real_model_learns.py itself, over an hour)"
    return 0
  fi
  have_model || { skip "no model in $MODEL"; return 0; }
  local data=$PAYLOAD/wiki18_nq_triviaqa index=$PAYLOAD/nq/index engine rc=0 url
  [ -f "$data/nq_1000.jsonl" ] || data=../shared/data/wiki18_nq_triviaqa
  [ -f "$data/nq_1000.jsonl" ] || { skip "no questions: carry the payload"; return 0; }
  engine=${NQ_ENGINE:-$("$PY" bench/gpu_session.py fastest-engine "$OUT/engines.json" --default hf)}
  local args=(--data "$data" --out "$OUT/nq")
  rm -f "$OUT/nq/results.json" "$OUT/nq/results.md"
  local decode=auto
  if [[ $engine == hf-* ]]; then decode=${engine#hf-} engine=hf; fi # bench/engines.py's names for hf's decode paths
  local over=(train.device=cuda:0 rollout.device=cuda:0 "rollout.engine=$engine" "rollout.hf_decode=$decode"
    train.bf16=true model.dtype=bfloat16
    run.preflight=false rollout.prompts_per_step=16 run.max_steps=20 guard.replay_every=5
    "train.max_tokens_per_microbatch=$NQ_CAP")
  if [ "$SMOKE" = 1 ]; then
    args+=(--nq-test 16 --triviaqa-test 8 --train-size 64)
    over+=(run.max_steps=2 sft.steps=2 rollout.prompts_per_step=2)
  elif [ -f "$PAYLOAD/nq/data/split.json" ] && [ ! -f "$OUT/nq/data/split.json" ]; then
    mkdir -p "$OUT/nq/data" && cp "$PAYLOAD"/nq/data/* "$OUT/nq/data/"
  fi
  if [ ! -f "$index/manifest.json" ] && [ -f "$PAYLOAD/minilm/config.json" ] && [ -f "$data/corpus.jsonl" ]; then
    index=$OUT/nq/index # a payload built with --index there: the same encoder, on the GPU
    [ -f "$index/manifest.json" ] || within "$PY" -m retriever_server.build --corpus "$data/corpus.jsonl" \
      --out "$index" --kind flat --encoder "$PAYLOAD/minilm" --device cuda --encoder-runtime torch || return $?
  fi
  if [ -f "$index/manifest.json" ]; then
    mkdir -p "$OUT/nq"
    rm -f "$OUT/nq/retriever_ready.json"
    "$PY" -m retriever_server.app --index "$index" --port 0 --ready-file "$OUT/nq/retriever_ready.json" \
      --encoder-runtime torch --topk 1 >"$OUT/nq/retriever.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 240); do # up to a minute: MiniLM and the index load on the CPU
      if [ -f "$OUT/nq/retriever_ready.json" ] || ! kill -0 "$SERVER" 2>/dev/null; then break; fi
      sleep 0.25
    done
    url=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["url"])' "$OUT/nq/retriever_ready.json") ||
      { NOTE="the retriever did not start: $(tail -3 "$OUT/nq/retriever.log")"; stop_server; return 1; }
    args+=(--index "$index")
    over+=("retriever.url=$url")
  fi
  NOTE="engine $engine"
  within "$PY" bench/real_model_learns.py "${args[@]}" "${over[@]}" || rc=$?
  local tag=$engine-$decode
  if ((rc != 0 && rc != 124 && rc != 137)) && [ "$tag" != hf-dynamic ] && [ -z "${NQ_ENGINE:-}" ]; then
    # the chosen engine failed (not cut): the rest of the time on hf's dynamic decode, which has run on GPUs; data,
    # index and the warm start are reused
    NOTE="engine $tag failed (exit $rc; its logs in $OUT/nq/logs_$tag), then hf-dynamic"
    rm -rf "$OUT/nq/logs_$tag" && cp -r "$OUT/nq/logs" "$OUT/nq/logs_$tag"
    rc=0
    local again=("${over[@]/rollout.engine=$engine/rollout.engine=hf}")
    within "$PY" bench/real_model_learns.py "${args[@]}" "${again[@]/rollout.hf_decode=$decode/rollout.hf_decode=dynamic}" ||
      rc=$?
  fi
  stop_server
  return "$rc"
}

session() {
  trap stop_server EXIT
  mkdir -p "$OUT"
  : >"$OUT/steps.tsv"
  rm -f "$OUT/session.json"
  echo "== gpu_session: steps ${STEPS[*]}, $SESSION_S s, OUT=$OUT, PY=$PY, smoke=$SMOKE"
  step setup "${BUDGET_SETUP:-90}" setup
  local s
  for s in "${STEPS[@]}"; do
    case $s in
      engines) step engines "${BUDGET_ENGINES:-120}" engines ;;
      update) step update "${BUDGET_UPDATE:-75}" update ;;
      planner) step planner "${BUDGET_PLANNER:-90}" planner ;;
      nq) step nq "${BUDGET_NQ:-$SESSION_S}" nq ;;
    esac
  done
  echo "== wall $(($(now) - START)) s of $SESSION_S"
  "$PY" bench/gpu_session.py summary "$OUT"
}

mkdir -p "$OUT"
session 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
