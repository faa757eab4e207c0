#!/usr/bin/env bash
# What tracing costs the mesh: the hotel `/ping` (jwt, rbac, ratelimit, breaker in
# front of the frontend service) under wrk -t1 -c32, the mesh started in each mode and
# the modes alternated round by round (this 2-core machine drifts within minutes):
#   off     no OTLP endpoint: the mesh carries no trace context of its own,
#   ratio0  OTEL_TRACES_SAMPLER_ARG=0: contexts carried, no span written,
#   ratio1  every request sampled: three spans a request written and posted,
#   refused ratio 1 with nothing listening at the endpoint: spans written, every post
#           refused at connect (what writing costs without sending),
# to a collector stand-in on the same cores (nginx answering 200 to every post, after
# reading its body: the least a collector does).
# Prints a row a mode and round (req/s, p50, p99, CPU per request of the ingress and
# nodes and of the service, the collector's), then each mode's mean req/s against off.
#   bench/tracing.sh                 3 rounds of 10 s (ROUNDS, DURATION, WARMUP)
#   MODES="ratio0 ratio1" bench/tracing.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-3}"
ROUNDS="${ROUNDS:-3}"
read -r -a modes <<<"${MODES:-off ratio0 ratio1}"
SECRET="$(bench/demo-key.sh)"
export PATH="$PATH:/usr/sbin"
missing=""
for tool in wrk nginx; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    echo "==> installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts

. bench/common.sh
. bench/mesh-lib.sh
TOKEN="$(python3 bench/token.py "$SECRET")"
collector=127.0.0.1:18318
# Nothing listens there (the mode `refused`).
closed=127.0.0.1:18319
start_nginx <<EOF
    client_max_body_size 64m;
    client_body_buffer_size 16m;
    server {
        listen $collector;
        location /v1/traces { return 200; }
    }
EOF
collector_pids() { cat "$work/nginx.pid"; pgrep -P "$(cat "$work/nginx.pid")"; }

# The mesh in one mode: its environment is every process's (`dpumesh up` passes it on).
start_mode() { # mode
    unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_TRACES_SAMPLER_ARG
    case "$1" in
        off) ;;
        ratio0) export OTEL_EXPORTER_OTLP_ENDPOINT="http://$collector" OTEL_TRACES_SAMPLER_ARG=0 ;;
        ratio1) export OTEL_EXPORTER_OTLP_ENDPOINT="http://$collector" OTEL_TRACES_SAMPLER_ARG=1 ;;
        refused) export OTEL_EXPORTER_OTLP_ENDPOINT="http://$closed" OTEL_TRACES_SAMPLER_ARG=1 ;;
        *) echo "unknown mode $1 (off, ratio0, ratio1, refused)"; exit 2 ;;
    esac
    start_mesh shm
    unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_TRACES_SAMPLER_ARG
}

url=http://127.0.0.1:18090/ping
declare -A sum
echo "mode|round|req/s|p50|p99|ingress+nodes us/req|non-2xx|service us/req|collector us/req"
for round in $(seq 1 "$ROUNDS"); do
    for mode in "${modes[@]}"; do
        start_mode "$mode"
        check "$url"
        wrk -t1 -c32 -d"${WARMUP}s" -H "authorization: Bearer $TOKEN" "$url" >/dev/null
        # The collector's CPU is a third figure: run() measures two sets of pids.
        c1=$(cpu $(collector_pids))
        row=$(WARMUP=0 run "$mode" "$url" mesh_pids service_pids)
        c2=$(cpu $(collector_pids))
        n=$(awk -F'|' '{ print $2 * '"$DURATION"' }' <<<"$row")
        coll=$(echo "scale=2; ($c2 - $c1) * 1000000 / $n" | bc)
        IFS='|' read -r name rps p50 p99 us non2xx svc _ <<<"$row"
        echo "$mode|$round|$rps|$p50|$p99|$us|$non2xx|$svc|$coll"
        sum[$mode]=$(echo "${sum[$mode]:-0} + $rps" | bc)
        stop_mesh
    done
done
base="${sum[off]:-}"
for mode in "${modes[@]}"; do
    mean=$(echo "scale=0; ${sum[$mode]} / $ROUNDS" | bc)
    if [ -n "$base" ]; then
        echo "$mode: mean $mean req/s, $(echo "scale=3; ${sum[$mode]} / $base" | bc)x off"
    else
        echo "$mode: mean $mean req/s"
    fi
done
