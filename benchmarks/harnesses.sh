#!/usr/bin/env bash
# Real agent harnesses, unchanged, against a fresh `openk3 serve` on loopback: Claude Code
# (`claude -p`), Codex CLI (`codex exec`, Responses API) and Kimi CLI (`kimi --print`), each
# installed from its registry into a temp dir. Prints per harness: its version, requests the server
# saw, how many were not 2xx, the harness's exit code, whether it completed, its wall time (install
# excluded) and the 1-minute load average when it ended (the machine may be shared). Not run in CI (it
# downloads the harnesses and takes minutes per harness on CPU).
#
#   benchmarks/harnesses.sh [MODEL] [PROMPT]
#   benchmarks/harnesses.sh openk3-tiny "$(cat benchmarks/harness_long_prompt.md)"   # a longer agent task
#
# MODEL: a checkpoint directory or `openk3-tiny` (default). Env: HARNESSES (default
# "claude codex kimi"), HARNESS_TIMEOUT (seconds per harness, default 900), PYTHON (the openk3
# interpreter, default .venv/bin/python), PYTHON313 (for Kimi CLI, which needs Python >= 3.13),
# SERVED_NAME (the model id served, default openk3-tiny), CLAUDE_MODEL (empty: Claude Code's own
# default model id is sent, as a new user would), KIMI_CLI_VERSION (default 1.50.0: 1.52.0, the
# last release of the package, is archived and only prints a notice).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-openk3-tiny}"
PROMPT="${2:-say hi}"
HARNESSES="${HARNESSES:-claude codex kimi}"
TIMEOUT="${HARNESS_TIMEOUT:-900}"
PY="${PYTHON:-.venv/bin/python}"
PY313="${PYTHON313:-$(ls -d ~/.pyenv/versions/3.13*/bin/python 2>/dev/null | head -1)}"
NAME="${SERVED_NAME:-openk3-tiny}"
KEY="sk-harness-local"
TMP="$(mktemp -d -t openk3-harnesses-XXXXXX)"
echo "work dir: $TMP"

LOG="$TMP/server.log"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m openk3.cli serve "$MODEL" --served-model-name "$NAME" \
    --port 0 --api-key "$KEY" > "$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT
for _ in $(seq 1 600); do
    BASE="$(sed -n 's|.* at \(http://[^ ]*\)/v1 .*|\1|p' "$LOG" | head -1)"
    [ -n "$BASE" ] && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 0.2
done
[ -n "$BASE" ] || { echo "server did not start"; cat "$LOG"; exit 1; }
echo "server: $BASE ($MODEL as $NAME)"

install_npm() {  # $1: package; the binary lands in $TMP/npm/node_modules/.bin
    npm install --no-audit --no-fund --prefix "$TMP/npm" "$1" > "$TMP/npm-$2.log" 2>&1
}

npm_version() {  # $1: package installed under $TMP/npm
    node -p "require('$TMP/npm/node_modules/$1/package.json').version" 2>/dev/null || echo "?"
}

access_lines() {  # the server's access-log lines: "HH:MM:SS METHOD PATH STATUS ..."
    grep -E '^[0-9]{2}:[0-9]{2}:[0-9]{2} (GET|POST|HEAD|PUT|DELETE|OPTIONS) ' "$LOG" || true
}

ROWS=()
run_harness() {  # $1 name, $2 version; the rest: the command
    local name="$1" version="$2"; shift 2
    local before after requests non2xx rc start wall load
    before="$(access_lines | wc -l)"
    start="$(date +%s.%N)"
    (cd "$TMP/work" && timeout "$TIMEOUT" "$@") > "$TMP/$name.out" 2>&1
    rc=$?
    wall="$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
    load="$(cut -d' ' -f1 /proc/loadavg)"
    sleep 1
    after="$(access_lines | tail -n +"$((before + 1))")"
    requests="$(printf '%s' "$after" | grep -c . || true)"
    non2xx="$(printf '%s\n' "$after" | awk 'NF >= 4 && $4 !~ /^2/' | grep -c . || true)"
    local done="no"; [ "$rc" -eq 0 ] && done="yes"
    ROWS+=("$(printf '| %s | %s | %s | %s | %s | %s | %s | %s |' "$name" "$version" "$requests" "$non2xx" "$rc" "$done" "$wall" "$load")")
    echo "--- $name (exit $rc): last lines of its output"; tail -5 "$TMP/$name.out"
    echo "--- $name: server requests"; printf '%s\n' "$after" | tail -10
}

mkdir -p "$TMP/work" "$TMP/home"
for h in $HARNESSES; do
    case "$h" in
    claude)
        install_npm @anthropic-ai/claude-code claude || { ROWS+=("| claude | - | - | - | install failed | no | - | - |"); continue; }
        run_harness claude "$(npm_version @anthropic-ai/claude-code)" env HOME="$TMP/home" ANTHROPIC_BASE_URL="$BASE/anthropic" ANTHROPIC_API_KEY="$KEY" \
            ${CLAUDE_MODEL:+ANTHROPIC_MODEL="$CLAUDE_MODEL"} "$TMP/npm/node_modules/.bin/claude" -p "$PROMPT"
        ;;
    codex)
        install_npm @openai/codex codex || { ROWS+=("| codex | - | - | - | install failed | no | - | - |"); continue; }
        mkdir -p "$TMP/codex"
        cat > "$TMP/codex/config.toml" <<EOF
model = "$NAME"
model_provider = "openk3"

[model_providers.openk3]
name = "openk3"
base_url = "$BASE/v1"
env_key = "OPENK3_API_KEY"
wire_api = "responses"
EOF
        run_harness codex "$(npm_version @openai/codex)" env CODEX_HOME="$TMP/codex" OPENK3_API_KEY="$KEY" \
            "$TMP/npm/node_modules/.bin/codex" exec --skip-git-repo-check "$PROMPT"
        ;;
    kimi)
        if [ -z "$PY313" ]; then ROWS+=("| kimi | - | - | - | no Python 3.13 | no | - | - |"); continue; fi
        "$PY313" -m venv "$TMP/kimi" && "$TMP/kimi/bin/pip" install -q "kimi-cli==${KIMI_CLI_VERSION:-1.50.0}" > "$TMP/pip-kimi.log" 2>&1 \
            || { ROWS+=("| kimi | - | - | - | install failed | no | - | - |"); continue; }
        CONTEXT="$(curl -s -H "Authorization: Bearer $KEY" "$BASE/v1/models" \
            | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["context_length"])')"
        cat > "$TMP/kimi-config.toml" <<EOF
default_model = "openk3"

[providers.openk3]
type = "kimi"
base_url = "$BASE/v1"
api_key = "$KEY"

[models.openk3]
provider = "openk3"
model = "$NAME"
max_context_size = $CONTEXT
EOF
        run_harness kimi "$("$TMP/kimi/bin/pip" show kimi-cli 2>/dev/null | sed -n 's/^Version: //p')" env HOME="$TMP/home" "$TMP/kimi/bin/kimi" --config-file "$TMP/kimi-config.toml" \
            --print -p "$PROMPT"
        ;;
    *) echo "unknown harness $h"; exit 2 ;;
    esac
done

echo
echo "| harness | version | requests | non-2xx | exit | completed | wall s | load |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
