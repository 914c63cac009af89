#!/usr/bin/env bash
# The end of `make demo`: export the newest router training run as a bundle, serve it, ask it one question with curl.
set -euo pipefail
venv=${VENV:-.venv}
run=$(ls -td runs/router-train-* | head -1)
bundle=runs/router-bundle-$(date +%Y%m%d-%H%M%S)
echo "+ masgraph export $run --out $bundle"
"$venv/bin/masgraph" export "$run" --out "$bundle"
port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "+ masgraph serve $bundle --port $port"
"$venv/bin/masgraph" serve "$bundle" --port "$port" --no-store --log-level warning &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || { echo "error: the server exited" >&2; exit 1; }
  sleep 0.5
done
echo "+ curl http://127.0.0.1:$port/v1/chat/completions  (What is 12 * 7 + 3?)"
curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H "Content-Type: application/json" \
  -d '{"model": "router", "messages": [{"role": "user", "content": "What is 12 * 7 + 3?"}]}' \
  | "$venv/bin/python" -m json.tool
