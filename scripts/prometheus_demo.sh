#!/usr/bin/env bash
# Scrape an iopd edge with a real, throw-away Prometheus and run every PromQL
# query of docs/openai-usage-grafana.md and every panel query of
# docs/grafana-dashboard.json through the Prometheus HTTP API.  A query that
# does not parse (or fails to evaluate) makes the script exit 1.
#
# Usage:
#   scripts/prometheus_demo.sh            # scrape the edge admin listener 127.0.0.1:7071;
#                                         # if nothing listens there, start `iopd demo`
#                                         # in the background and send a few requests
#   scripts/prometheus_demo.sh --sample   # no edge: scrape a tiny server that exposes
#                                         # GatewayMetrics filled with sample traffic
#
# Needs: prometheus + promtool (Debian: apt-get install prometheus), curl, python3.
# Everything listens on loopback only, runs in a temp dir that is removed at the
# end, and is bounded in time (RUN_SECONDS, default 120).  Only processes this
# script started are stopped.
#
# Environment: PROM_PORT (default 9099), SAMPLE_PORT (default 17071),
# OPENAI_URL (default http://127.0.0.1:8080/v1), IOPD_API_KEY (bearer, optional),
# IOPD (the iopd command), PYTHON (a python with iopd importable).
set -euo pipefail

MODE=edge
[[ "${1:-}" == "--sample" ]] && MODE=sample
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GUIDE="$REPO/docs/openai-usage-grafana.md"
DASHBOARD="$REPO/docs/grafana-dashboard.json"
PROM_PORT="${PROM_PORT:-9099}"
SAMPLE_PORT="${SAMPLE_PORT:-17071}"
OPENAI_URL="${OPENAI_URL:-http://127.0.0.1:8080/v1}"
RUN_SECONDS="${RUN_SECONDS:-120}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ -z "${IOPD:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/iopd" ]]; then IOPD="$REPO/.venv/bin/iopd"; else IOPD=iopd; fi
fi

for tool in prometheus promtool curl; do
  if ! command -v "$tool" >/dev/null; then
    echo "missing $tool: install Prometheus first (Debian: sudo apt-get install -y prometheus)" >&2
    exit 2
  fi
done

WORK="$(mktemp -d -t iopd-prom.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
# Hard bound on the whole run, whatever hangs.
( sleep "$RUN_SECONDS"; echo "prometheus_demo: time limit ${RUN_SECONDS}s reached" >&2; kill -TERM $$ ) &
WATCHDOG=$!
PIDS+=("$WATCHDOG")

wait_for() {  # wait_for SECONDS CMD...: retry CMD every 0.5 s
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) < deadline )) || return 1
    sleep 0.5
  done
}

# ------------------------------------------------------------------ the target
if [[ "$MODE" == sample ]]; then
  TARGET="127.0.0.1:$SAMPLE_PORT"
  cat >"$WORK/sample_edge.py" <<'PY'
"""Serve GatewayMetrics filled with sample traffic, like an edge's /metrics."""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from iopd.edge.metering.metrics import (GatewayMetrics, GatewayStatus, PrincipalLabels,
                               ProviderGaugeRow, RequestLabels)
from iopd.edge.metering.usage import run_event_usage, tunnel_usage
from wire.messages import Usage

m = GatewayMetrics("edge-1")
alice = PrincipalLabels.from_config("user-1", "alice", "app-1")
bob = PrincipalLabels.from_config("user-2", "bob", "app-2")
m.allow_ids(model_groups=["echo", "qwen3.6:35b"], principals=[alice, bob])
m.set_status_source(lambda: GatewayStatus(
    queue_depth=1, max_queue=256, connected_nodes=1,
    providers=[ProviderGaugeRow("node-a", "echo-1", 1, 4, health="healthy"),
               ProviderGaugeRow("node-a", "vllm-a", 2, 8, long_in_flight=1, long_capacity=2)]))

def traffic() -> None:
    chat = RequestLabels.build(alice, model_group="echo", endpoint="chat_completions",
                               response_mode="normalized")
    m.record_request(chat, status="ok", duration=0.05,
                     usage=run_event_usage(Usage(input_tokens=12, output_tokens=7)),
                     reasoning_chars=40)
    tun = RequestLabels.build(bob, model_group="qwen3.6:35b", endpoint="responses",
                              response_mode="passthrough")
    m.record_request(tun, status="ok", duration=2.5, usage=tunnel_usage(
        Usage(input_tokens=300, output_tokens=120, reasoning_tokens=80),
        Usage(cached_input_tokens=128)), reasoning_chars=320)
    failed_auth = RequestLabels.build(None, model_group="unknown", endpoint="chat_completions",
                                      response_mode="normalized")
    m.record_request(failed_auth, status="auth_error", duration=0.001)
    m.observe_dispatch_wait("echo", 0.002, "admitted")
    m.observe_dispatch_wait("qwen3.6:35b", 0.8, "admitted")
    m.count_wire_frames("in", 20)
    m.count_wire_frames("out", 5)

m.count_refresh("applied")
m.count_wire_error("heartbeat_timeout")

class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        traffic()  # counters grow between scrapes, so rate()/increase() have data
        body, ctype = m.exposition()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
PY
  (cd "$REPO" && exec "$PYTHON" "$WORK/sample_edge.py" "$SAMPLE_PORT") &
  PIDS+=("$!")
  wait_for 20 curl -fsS "http://$TARGET/metrics" || { echo "sample server did not start" >&2; exit 1; }
  echo "sample exposition served on http://$TARGET/metrics"
else
  TARGET="127.0.0.1:7071"
  if ! curl -fsS "http://$TARGET/metrics" >/dev/null 2>&1; then
    echo "no edge on $TARGET: starting '$IOPD demo' in the background"
    "$IOPD" demo >"$WORK/demo.log" 2>&1 &
    PIDS+=("$!")
    wait_for 30 curl -fsS "http://$TARGET/metrics" || {
      echo "iopd demo did not come up; its output:" >&2; cat "$WORK/demo.log" >&2; exit 1; }
  fi
  echo "edge admin listener up on http://$TARGET/metrics"
fi

send_requests() {  # a few OpenAI calls so the counters have something in them
  [[ "$MODE" == edge ]] || return 0
  local auth=()
  [[ -n "${IOPD_API_KEY:-}" ]] && auth=(-H "Authorization: Bearer $IOPD_API_KEY")
  local url="$OPENAI_URL/chat/completions"
  curl -sS -m 10 -o /dev/null "${auth[@]}" -H 'Content-Type: application/json' "$url" \
    -d '{"model": "echo", "messages": [{"role": "user", "content": "hello from the prometheus demo"}]}' || true
  curl -sS -m 10 -o /dev/null "${auth[@]}" -H 'Content-Type: application/json' "$url" \
    -d '{"model": "echo", "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "stream me a few words"}]}' || true
  curl -sS -m 10 -o /dev/null "${auth[@]}" -H 'Content-Type: application/json' "$url" \
    -d '{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}' || true
}
send_requests

# ------------------------------------------------------------------ queries and rules
# Extract the ```promql blocks and the price-table rules from the guide, and the
# panel queries from the dashboard (Grafana variables replaced by concrete values).
"$PYTHON" - "$GUIDE" "$DASHBOARD" "$WORK" <<'PY'
import json, re, sys
guide, dashboard, work = sys.argv[1:4]
text = open(guide, encoding="utf-8").read()
queries = [" ".join(q.split()) for q in re.findall(r"```promql\n(.*?)\n```", text, re.S)]
rules = [b for b in re.findall(r"```yaml\n(.*?)\n```", text, re.S) if "iop-prices.rules.yml" in b]
if len(rules) != 1:
    sys.exit("guide: expected exactly one iop-prices.rules.yml block")
# Evaluate the price rules every second in the demo (the guide says 1m).
open(f"{work}/iop-prices.rules.yml", "w").write(rules[0].replace("interval: 1m", "interval: 1s") + "\n")
subst = {"$__rate_interval": "1m", "$__interval": "1d", "$__range": "1d",
         '"$edge"': '".*"', '"$principal"': '".*"', '"$model_group"': '".*"'}
panel_queries = []
for panel in json.load(open(dashboard, encoding="utf-8"))["panels"]:
    for target in panel.get("targets", []):
        q = target["expr"]
        for k, v in subst.items():
            q = q.replace(k, v)
        if "$" in q:
            sys.exit(f"dashboard: unsubstituted variable in {q!r}")
        panel_queries.append(f"[panel] {panel['title']}\t{q}")
with open(f"{work}/queries.txt", "w", encoding="utf-8") as f:
    for q in queries:
        f.write(f"[guide]\t{q}\n")
    for q in panel_queries:
        f.write(q + "\n")
print(f"{len(queries)} guide queries, {len(panel_queries)} dashboard queries")
PY

promtool check rules "$WORK/iop-prices.rules.yml"

cat >"$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $WORK/iop-prices.rules.yml
scrape_configs:
  - job_name: iopd-edge
    static_configs:
      - targets: ["$TARGET"]
EOF
promtool check config "$WORK/prometheus.yml" >/dev/null

prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/data" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
PIDS+=("$!")
PROM="http://127.0.0.1:$PROM_PORT"
wait_for 30 curl -fsS "$PROM/-/ready" || { echo "prometheus did not start:" >&2; cat "$WORK/prometheus.log" >&2; exit 1; }

scraped() {  # at least 3 samples of iop_openai_requests_total, so rate()/increase() work
  curl -fsS "$PROM/api/v1/query" --data-urlencode 'query=count_over_time(iop_openai_requests_total[1m])' \
    | "$PYTHON" -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; sys.exit(0 if r and max(float(x["value"][1]) for x in r) >= 3 else 1)'
}
echo "waiting for Prometheus to scrape $TARGET ..."
send_requests
wait_for 40 scraped || { echo "no scrape of $TARGET with iop_openai_requests_total" >&2; exit 1; }
send_requests
sleep 2

# ------------------------------------------------------------------ run every query
FAILED=0
while IFS=$'\t' read -r origin query; do
  out="$(curl -sS "$PROM/api/v1/query" --data-urlencode "query=$query")" || out='{"status":"error","error":"http"}'
  line="$(printf '%s' "$out" | "$PYTHON" -c '
import json, sys
r = json.load(sys.stdin)
if r.get("status") != "success":
    print("FAIL", r.get("errorType", ""), r.get("error", "")); sys.exit(0)
d = r["data"]
n = len(d["result"]) if d["resultType"] in ("vector", "matrix") else 1
print("ok  ", f"{n} series" if n else "empty")')"
  [[ "$line" == FAIL* ]] && FAILED=$((FAILED + 1))
  printf '%-24s %-40.40s %s\n' "$line" "$origin" "$query"
done <"$WORK/queries.txt"

echo
if (( FAILED )); then
  echo "prometheus_demo: $FAILED queries failed" >&2
  exit 1
fi
echo "prometheus_demo: every query parsed and evaluated"
