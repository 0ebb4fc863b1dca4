#!/usr/bin/env bash
# Start the cluster (ROLE_TYPE=PDFUSION by default) on START_PORT and say how to call it.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${START_PORT:-8088}"
export START_PORT="$PORT"
# Only this machine can reach it (HOST=0.0.0.0 opens the API). The launcher generates the cluster token
# its backend and frontend share unless CLUSTER_TOKEN or CLUSTER_TOKEN_FILE is set.
export HOST="${HOST:-127.0.0.1}"
# Beside the chat model, the embedded all-MiniLM-L6-v2 for /v1/embeddings (EMBEDDING_MODEL_PATH= turns it off).
EMBEDDING="${EMBEDDING_MODEL_PATH-embedded}"
.venv/bin/python -m kvyard serve --host "$HOST" --port "$PORT" ${EMBEDDING:+--embedding-model "$EMBEDDING"} &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null' INT TERM EXIT
for _ in $(seq 1 180); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    MODEL=$(curl -s "http://127.0.0.1:$PORT/v1/models" | sed -n 's/^{"object":"list","data":\[{"id":"\([^"]*\)".*/\1/p')
    cat <<MSG

kvyard is serving $MODEL on http://127.0.0.1:$PORT (pid $PID; Ctrl-C stops it)

  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'

  # streaming (SSE):
  curl -N http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "Tell me a joke"}], "stream": true}'

  # any OpenAI client: base_url="http://127.0.0.1:$PORT/v1", api_key="unused"
MSG
    if [ -n "$EMBEDDING" ]; then
      cat <<MSG
  # embeddings (all routes: docs/embeddings.md):
  curl http://127.0.0.1:$PORT/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{"input": ["The cat sat on the mat.", "A dog barked."]}'
MSG
    fi
    wait $PID
    exit $?
  fi
  if ! kill -0 $PID 2>/dev/null; then
    wait $PID; exit $?
  fi
  sleep 1
done
echo "kvyard did not become healthy in 180 s" >&2
exit 1
