#!/usr/bin/env bash
# How the cost grows: the mesh measured as one dimension of its work grows, against
# HAProxy (and nginx proxy) doing the same work, in one run. For every step it writes
# a row per figure to target/scale/DIMENSION.csv (dimension,step,target,metric,value)
# and draws target/scale/DIMENSION.png (bench/scale/plot.py, matplotlib).
#
#   bench/scale.sh [--quick] [DIMENSION ...]      (default: every dimension)
#
# Dimensions:
#   connections  keep-alive connections held idle at the ingress (bench/scale/hold.py opens
#                them, each after one request), 100 -> 10 000, with 32 busy ones
#                beside them (wrk -t1 -c32): req/s and p99 of the busy ones, the
#                ingress's RSS per idle connection, its CPU while only the idle ones
#                are open, and how many the server still held after the load. The
#                same against HAProxy (nbthread 2) in front of nginx. The ingress and
#                HAProxy are started anew for each step, so a step's RSS is its own.
#   bodies       POSTed request bodies, 0 B -> 8 MiB (wrk -t1 -c8, one body a
#                request): MB/s and the host's CPU per MB, for the mesh (the service
#                pod reading the body, `/upload?crc=0`: what the host pays with the
#                proxy on the DPU), nginx proxy (its worker, buffering bodies as
#                shipped) and HAProxy (both in front of an nginx origin that drops
#                the body); the mesh's ingress + nodes' CPU per MB apart.
# HAProxy and nginx here proxy without a policy; the mesh runs the hotel's chain
# (jwt, rbac, ratelimit, breaker) with the bench's token.
#
# --quick: two steps a dimension, 2 s each, on the debug build the test suite
# already made (the suite runs it so the script cannot rot; its figures mean
# nothing). Without it: the release build, every step, DURATION (10 s) each.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
dims=()
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        connections | bodies) dims+=("$arg") ;;
        *)
            echo "usage: $0 [--quick] [connections] [bodies]" >&2
            exit 2
            ;;
    esac
done
[ ${#dims[@]} -gt 0 ] || dims=(connections bodies)

if [ "$quick" = 1 ]; then
    DURATION="${DURATION:-2}"; WARMUP="${WARMUP:-1}"; IDLE="${IDLE:-1}"; PROFILE=debug
    conn_steps=(100 500)
    body_steps=(1024 65536)
else
    DURATION="${DURATION:-10}"; WARMUP="${WARMUP:-2}"; IDLE="${IDLE:-5}"; PROFILE=release
    conn_steps=(100 1000 3000 10000)
    body_steps=(0 1024 65536 1048576 8388608)
fi
OUT="${OUT:-target/scale}"
export BIN="./target/$PROFILE"
SECRET="$(bench/demo-key.sh)"

export PATH="$PATH:/usr/sbin"
missing=""
for tool in wrk nginx haproxy; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    echo "==> installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
python3 -c "import matplotlib" 2>/dev/null || ./scripts/install-python.sh >/dev/null

echo "==> building dpumesh and the hotel sample ($PROFILE)"
if [ "$PROFILE" = release ]; then
    cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts
else
    cargo build -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts
fi

. bench/common.sh
. bench/mesh-lib.sh
TOKEN="$(python3 bench/token.py "$SECRET")"
# 10 000 connections held, their server's ends, wrk's and the holder's own.
ulimit -n "$(ulimit -Hn)"
fds=$(ulimit -n)
# HAProxy refuses to start unless it can have two FDs a connection it may accept.
haproxy_maxconn=$(((fds - 100) / 2))
HAPROXY_HOLD=$((haproxy_maxconn - 64))
mkdir -p "$OUT" "$work/nginx-body"
# nginx's workers (nobody) write request bodies there.
chmod 755 "$work"
chmod 777 "$work/nginx-body"

# The peers: an nginx origin (drops what it is sent, answers "pong"), nginx proxying
# to it, and HAProxy proxying to it; each one process, restartable on its own.
nginx_conf() { # name http-block: one nginx process of its own (pid, log, config)
    cat > "$work/$1.conf" <<NGINX
worker_processes 1;
worker_rlimit_nofile 30000;
pid $work/$1.pid;
error_log $work/$1-error.log;
events { worker_connections 30000; }
http {
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_max_body_size 16m;
    client_body_temp_path $work/nginx-body;
$2
}
NGINX
}
nginx_conf origin '    server { listen 127.0.0.1:18280; location / { return 200 "pong\n"; } }'
nginx_conf proxy '    upstream origin { server 127.0.0.1:18280; keepalive 64; }
    server {
        listen 127.0.0.1:18281;
        location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }'
cat > "$work/haproxy.cfg" <<CFG
global
    nbthread 2
    # Two FDs a connection within the run's limit (ulimit -Hn, 20 000 here): it
    # holds at most HAPROXY_HOLD idle ones beside the busy.
    maxconn $haproxy_maxconn
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-keep-alive 300s
frontend fe
    bind 127.0.0.1:18282
    default_backend origin
backend origin
    http-reuse always
    server origin 127.0.0.1:18280 maxconn 512
CFG
nginx -c "$work/origin.conf"
nginx -c "$work/proxy.conf"
# Stopped with the run however it ends (common.sh's cleanup kills `pids`).
pids+=("$(cat "$work/origin.pid")" "$(cat "$work/proxy.pid")")
haproxy_pid=""
start_haproxy() {
    haproxy -f "$work/haproxy.cfg" -db > "$work/haproxy.log" 2>&1 &
    haproxy_pid=$!
    pids+=("$haproxy_pid")
    check http://127.0.0.1:18282/ping
}
stop_haproxy() {
    kill "$haproxy_pid" 2>/dev/null || true
    wait "$haproxy_pid" 2>/dev/null || true
}
nginx_proxy_pids() { pgrep -P "$(cat "$work/proxy.pid")"; }
haproxy_pids() { echo "$haproxy_pid"; }
ingress_pids() { pgrep -P "$up_pid" -f "dpumesh ingress"; }
rss_kib() { # summed VmRSS of the pids, KiB
    local t=0 p
    for p in "$@"; do t=$((t + $(awk '/^VmRSS/ { print $2 }' "/proc/$p/status" 2>/dev/null || echo 0))); done
    echo "$t"
}
to_ms() { # wrk's latency (1.5ms, 850.00us, 1.2s) in ms
    awk -v v="$1" 'BEGIN {
        if (v ~ /us$/) { sub(/us$/, "", v); print v / 1000 }
        else if (v ~ /ms$/) { sub(/ms$/, "", v); print v + 0 }
        else if (v ~ /s$/) { sub(/s$/, "", v); print v * 1000 }
        else print "" }'
}
csv=""
emit() { # step target metric value
    echo "$dim,$1,$2,$3,$4" >> "$csv"
    printf '  %-10s %-14s %-40s %s\n' "$1" "$2" "$3" "$4"
}

# One wrk run: prints req/s|p99 ms|requests|non-2xx|CPU s of who|CPU s of also.
measure() { # url connections who [also] [lua script]
    local url=$1 conns=$2 who=$3 also=${4:-none} script=${5:-}
    local args=(-t1 -c"$conns" -H "authorization: Bearer $TOKEN")
    [ -n "$script" ] && args+=(-s "$script")
    wrk "${args[@]}" -d"${WARMUP}s" "$url" >/dev/null
    local b1 b2 a1 a2 out
    b1=$(cpu $($who)); b2=$(cpu $($also))
    out=$(wrk "${args[@]}" -d"${DURATION}s" --latency "$url")
    a1=$(cpu $($who)); a2=$(cpu $($also))
    echo "$(awk '/Requests\/sec/ { print $2 }' <<<"$out")|$(to_ms "$(awk '$1 == "99%" { print $2 }' <<<"$out")")|$(awk '/requests in/ { print $1 }' <<<"$out")|$(awk '/Non-2xx/ { print $5 }' <<<"$out")|$(echo "$a1 - $b1" | bc)|$(echo "$a2 - $b2" | bc)"
}

# Idle connections: one step against one target.
hold_step() { # n target port who
    local n=$1 target=$2 port=$3 who=$4 rss0 rss1 c0 c1 ready opened failed open r
    rss0=$(rss_kib $($who))
    coproc HOLD { python3 bench/scale/hold.py 127.0.0.1 "$port" "$n" /ping "$TOKEN"; }
    read -r ready opened failed <&"${HOLD[0]}"
    [ "$ready" = ready ] || { echo "bench/scale/hold.py: $ready"; exit 1; }
    sleep 1
    rss1=$(rss_kib $($who))
    c0=$(cpu $($who)); sleep "$IDLE"; c1=$(cpu $($who))
    IFS='|' read -r rps p99 reqs non2xx _ _ <<<"$(measure "http://127.0.0.1:$port/ping" 32 none)"
    echo >&"${HOLD[1]}"
    read -r _ open <&"${HOLD[0]}"
    eval "exec ${HOLD[1]}>&-"
    wait "$HOLD_PID" 2>/dev/null || true
    emit "$n" "$target" "req/s of 32 busy connections" "$rps"
    emit "$n" "$target" "p99 of the busy ones (ms)" "$p99"
    emit "$n" "$target" "RSS per idle connection (KiB)" "$(echo "scale=2; ($rss1 - $rss0) / $opened" | bc)"
    emit "$n" "$target" "CPU while idle (% of a core)" "$(echo "scale=3; ($c1 - $c0) * 100 / $IDLE" | bc)"
    emit "$n" "$target" "idle connections still open after the load" "$open"
    [ "$failed" = 0 ] || echo "  ($failed of $n connections to $target failed to open)"
    [ -z "$non2xx" ] || echo "  ($non2xx answers to $target were not 2xx)"
}

bodies_step() { # size target url who [also]
    local size=$1 target=$2 url=$3 who=$4 also=${5:-none} rps p99 reqs non2xx c1 c2 mb
    printf 'wrk.method = "POST"\nwrk.body = string.rep("x", %d)\nwrk.headers["content-type"] = "application/octet-stream"\n' "$size" > "$work/body.lua"
    IFS='|' read -r rps p99 reqs non2xx c1 c2 <<<"$(measure "$url" 8 "$who" "$also" "$work/body.lua")"
    emit "$size" "$target" "req/s" "$rps"
    emit "$size" "$target" "p99 (ms)" "$p99"
    if [ "$size" -gt 0 ]; then
        mb=$(echo "scale=6; $reqs * $size / 1000000" | bc)
        emit "$size" "$target" "MB/s" "$(echo "scale=2; $rps * $size / 1000000" | bc)"
        emit "$size" "$target" "host CPU per MB (ms)" "$(echo "scale=4; $c1 * 1000 / $mb" | bc)"
        [ "$also" = none ] || emit "$size" "$target" "ingress + nodes CPU per MB (ms)" "$(echo "scale=4; $c2 * 1000 / $mb" | bc)"
    fi
    [ -z "$non2xx" ] || echo "  ($non2xx answers to $target were not 2xx)"
}

for dim in "${dims[@]}"; do
    csv="$OUT/$dim.csv"
    echo "dimension,step,target,metric,value" > "$csv"
    echo "==> $dim (DURATION=${DURATION}s a step)"
    case "$dim" in
        connections)
            for n in "${conn_steps[@]}"; do
                start_mesh shm
                check http://127.0.0.1:18090/ping
                hold_step "$n" mesh 18090 ingress_pids
                stop_mesh
                start_haproxy
                hold_step "$((n > HAPROXY_HOLD ? HAPROXY_HOLD : n))" haproxy 18282 haproxy_pids
                stop_haproxy
            done
            ;;
        bodies)
            start_mesh shm
            check http://127.0.0.1:18090/ping
            start_haproxy
            for size in "${body_steps[@]}"; do
                bodies_step "$size" mesh "http://127.0.0.1:18090/upload?crc=0" service_pids mesh_pids
                bodies_step "$size" "nginx proxy" http://127.0.0.1:18281/up nginx_proxy_pids
                bodies_step "$size" haproxy http://127.0.0.1:18282/up haproxy_pids
            done
            stop_haproxy
            stop_mesh
            ;;
    esac
    python3 bench/scale/plot.py "$csv" "$OUT/$dim.png"
    echo "  -> $csv, $OUT/$dim.png"
done
