#!/usr/bin/env bash
# Sets up the environment, starts the whole stack on loopback with the default
# model (scorer, proposers and gateway as separate processes), runs a sample
# generation with n-gram speculation, prints its stats and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PORT="${SPECDEC_PORT:-50050}"
LOG="$(mktemp -t specdec-serve.XXXXXX.log)"
specdec serve --port "$PORT" >"$LOG" 2>&1 &
SERVE_PID=$!
trap 'kill -TERM $SERVE_PID 2>/dev/null; wait $SERVE_PID 2>/dev/null || true' EXIT
echo "[demo] starting the stack (log: $LOG) ..."
until grep -q "gateway ready" "$LOG"; do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then cat "$LOG"; exit 1; fi
  sleep 1
done
grep "gateway ready" "$LOG"
PROMPT='Rewrite the following sentence in the same words: "The quick brown fox jumps over the lazy dog near the quiet river bank."'
echo "[demo] plain decoding:"
specdec generate --addr "127.0.0.1:$PORT" --chat --method none --max-tokens 64 "$PROMPT"
echo "[demo] n-gram speculation (k=5), same tokens, fewer rounds:"
specdec generate --addr "127.0.0.1:$PORT" --chat --method ngram -k 5 --max-tokens 64 "$PROMPT"
