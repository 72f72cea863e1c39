#!/usr/bin/env bash
# The shipped model's whole pipeline, end to end and resumable: the text recipe (corpus -> BPE ->
# pretraining -> SFT with MXFP4 QAT), the vision stage from its last checkpoint, the long-prompt
# stage from the vision stage's (long harness-prompt rows among the text rows), the export, and
# the held-out eval through a live server (the way users meet the model; MODEL_CARD.md's table).
#
#   scripts/train_shipped_model.sh [OUT]        # default OUT: runs/shipped; run from a work dir
#
# Every stage skips what is already done, so rerunning after an interruption continues where it
# stopped. Environment: OPENK3 (the CLI, default `openk3`), THREADS (default 1), PORT (default
# 8765), EVAL_N (items per suite, default 100), EVAL_SUITES (default: every suite), TEXT_ARGS,
# VISION_ARGS and LONG_ARGS (more `openk3 train` arguments for each stage, e.g. `--set total_steps=3`
# for a smoke run; a `--set extra=...` in VISION_ARGS / LONG_ARGS merges with the script's text_ckpt,
# e.g. `--set extra={"lm_lr_scale":0.2}`).
# The text recipe reads data/corpus and data/tokenizer relative to the current directory
# (`openk3 build-corpus --install --out data/corpus` builds the corpus first on a fresh machine).
set -euo pipefail
OUT=${1:-runs/shipped}
OPENK3=${OPENK3:-openk3}
THREADS=${THREADS:-1}
PORT=${PORT:-8765}
EVAL_N=${EVAL_N:-100}
EVAL_SUITES=${EVAL_SUITES:-}
TEXT_ARGS=${TEXT_ARGS:-}
VISION_ARGS=${VISION_ARGS:-}
LONG_ARGS=${LONG_ARGS:-}
mkdir -p "$OUT"

last_checkpoint() {  # the highest step-N directory under $1/checkpoints
    ls -d "$1"/checkpoints/step-* 2>/dev/null | sort | tail -n 1
}

echo "[ship] 1/5 text recipe into $OUT/text"
# A stage that finished leaves DONE, so a rerun skips it (resuming it would check its settings again).
if [ ! -f "$OUT/text/DONE" ]; then
    # shellcheck disable=SC2086  # TEXT_ARGS / VISION_ARGS are argument lists
    $OPENK3 train --recipe default-model --out "$OUT/text" --resume --threads "$THREADS" \
        --no-progress $TEXT_ARGS
    touch "$OUT/text/DONE"
fi
text_ckpt=$(last_checkpoint "$OUT/text")

# A stage that continues from a checkpoint: RECIPE into $OUT/NAME from CKPT, then ARGS.
continue_stage() {  # NAME RECIPE CKPT ARGS
    if [ ! -f "$OUT/$1/DONE" ]; then
        # shellcheck disable=SC2086  # ARGS is an argument list
        $OPENK3 train --recipe "$2" --out "$OUT/$1" --resume --threads "$THREADS" \
            --no-progress --set extra="{\"text_ckpt\": \"$3\"}" $4
        touch "$OUT/$1/DONE"
    fi
}

echo "[ship] 2/5 vision stage from $text_ckpt into $OUT/vision"
continue_stage vision default-model-vision "$text_ckpt" "$VISION_ARGS"
vision_ckpt=$(last_checkpoint "$OUT/vision")

echo "[ship] 3/5 long-prompt stage from $vision_ckpt into $OUT/long"
continue_stage long default-model-long "$vision_ckpt" "$LONG_ARGS"
long_ckpt=$(last_checkpoint "$OUT/long")

echo "[ship] 4/5 export $long_ckpt -> $OUT/export"
if [ ! -f "$OUT/export/model.safetensors" ]; then
    $OPENK3 export "$long_ckpt" "$OUT/export" --tokenizer data/tokenizer
fi

echo "[ship] 5/5 eval through a server on 127.0.0.1:$PORT -> $OUT/eval.json"
if [ ! -f "$OUT/eval.json" ]; then
    # --greedy: the eval table is greedy (an evaluation switch; the platform itself samples)
    $OPENK3 serve "$OUT/export" --host 127.0.0.1 --port "$PORT" --greedy > "$OUT/serve.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
        sleep 1
    done
    # shellcheck disable=SC2086  # EVAL_SUITES is a list of suite names
    $OPENK3 eval "http://127.0.0.1:$PORT" --n "$EVAL_N" ${EVAL_SUITES:+--suites $EVAL_SUITES} \
        --no-progress --out "$OUT/eval.json.tmp"
    mv "$OUT/eval.json.tmp" "$OUT/eval.json"
    kill "$server"
    wait "$server" || true
fi
echo "[ship] done: $OUT/export (copy it to openk3/shipped/openk3-tiny with its MODEL_CARD.md), $OUT/eval.json"
