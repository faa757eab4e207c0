#!/usr/bin/env bash
# The mesh against its peers on this machine, in one run: wrk -t1 -c32 -d${DURATION:-10}s with the same token against
#   (a) nginx serving a fixed 200,
#   (b) nginx as a plain reverse proxy to (a),
#   (c) HAProxy 2.6 in front of (a): JWT HS256 verify + expiry, a role rule on the
#       path, a per-subject rate limit (stick table),
#   (d) the DPUmesh local mesh (`dpumesh up`, hotel sample) with the same policy as
#       Wasm filters (jwt, rbac, ratelimit) in front of the frontend service's /ping.
# Prints rps and p50/p99 for each, the ratios d/c and d/b, and CPU seconds per 1000
# requests of the service process vs HAProxy + nginx (the host CPU DPU offload saves).
# Installs wrk, nginx and haproxy (Debian packages) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
SECRET="dpumesh-demo-hs256-secret-0123456789"

missing=""
for tool in wrk nginx haproxy; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing="$missing $tool"
done
if [ -n "$missing" ]; then
    echo "==> installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
export PATH="$PATH:/usr/sbin"

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts

work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    nginx -c "$work/nginx.conf" -s stop 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

TOKEN="$(python3 - "$SECRET" <<'PY'
import base64, hashlib, hmac, json, sys, time
b = lambda x: base64.urlsafe_b64encode(x).rstrip(b"=").decode()
h = b(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
p = b(json.dumps({"iss": "dpumesh-demo", "aud": "hotel", "sub": "bench", "roles": ["user"],
                  "role": "user", "iat": int(time.time()), "exp": int(time.time()) + 3600}).encode())
s = b(hmac.new(sys.argv[1].encode(), f"{h}.{p}".encode(), hashlib.sha256).digest())
print(f"{h}.{p}.{s}")
PY
)"

cat > "$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    upstream origin { server 127.0.0.1:18080; keepalive 64; }
    server { listen 127.0.0.1:18080; location / { return 200 "pong\n"; } }
    server {
        listen 127.0.0.1:18081;
        location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
}
NGINX
nginx -c "$work/nginx.conf"

cat > "$work/haproxy.cfg" <<HAP
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    option http-keep-alive
frontend fe
    bind 127.0.0.1:18082
    stick-table type string len 64 size 100k expire 60s store http_req_rate(1s)
    http-request deny deny_status 401 unless { req.hdr(authorization) -m beg "Bearer " }
    http-request set-var(txn.bearer) http_auth_bearer
    http-request set-var(txn.alg) var(txn.bearer),jwt_header_query('\$.alg')
    http-request deny deny_status 401 unless { var(txn.alg) -m str HS256 }
    http-request deny deny_status 401 unless { var(txn.bearer),jwt_verify(txn.alg,"$SECRET") -m int 1 }
    http-request set-var(txn.exp) var(txn.bearer),jwt_payload_query('\$.exp','int')
    http-request set-var(txn.now) date()
    http-request deny deny_status 401 if { var(txn.exp),sub(txn.now) -m int lt 0 }
    http-request set-var(txn.sub) var(txn.bearer),jwt_payload_query('\$.sub')
    http-request set-var(txn.role) var(txn.bearer),jwt_payload_query('\$.role')
    http-request deny deny_status 403 if { path_beg /admin } !{ var(txn.role) -m str admin }
    http-request deny deny_status 403 unless { var(txn.role) -m str user }
    http-request track-sc0 var(txn.sub)
    http-request deny deny_status 429 if { sc_http_req_rate(0) gt 1000000000 }
    default_backend origin
backend origin
    http-reuse always
    server s1 127.0.0.1:18080
HAP
haproxy -f "$work/haproxy.cfg" -db >/dev/null 2>&1 &
pids+=($!)

# The mesh on its own ports, from a mesh file in the run's temporary folder (the
# sample's policy by absolute path; nothing is written into the repository).
sed -e 's/127.0.0.1:8000/127.0.0.1:18090/' -e 's/127.0.0.1:7101/127.0.0.1:18091/' \
    -e 's/127.0.0.1:7102/127.0.0.1:18092/' -e 's/127.0.0.1:9101/127.0.0.1:18093/' \
    -e 's/127.0.0.1:9102/127.0.0.1:18094/' \
    -e "s#^policy: policy.yaml#policy: $PWD/samples/hotel/policy.yaml#" \
    samples/hotel/mesh.yaml > "$work/mesh.yaml"
grep -q "^policy: /" "$work/mesh.yaml" || { echo "samples/hotel/mesh.yaml: no 'policy: policy.yaml' line"; exit 1; }
./target/release/dpumesh up --config "$work/mesh.yaml" > "$work/up.log" 2>&1 &
up_pid=$!
pids+=($up_pid)
for _ in $(seq 1 300); do grep -q "Ctrl-C stops" "$work/up.log" && break; sleep 0.2; done
grep -q "Ctrl-C stops" "$work/up.log" || { cat "$work/up.log"; echo "the mesh did not start"; exit 1; }

# Every target must answer the token with 200 before it is measured.
for url in http://127.0.0.1:18080/ping http://127.0.0.1:18081/ping http://127.0.0.1:18082/ping http://127.0.0.1:18090/ping; do
    code=$(curl -s -o /dev/null -w '%{http_code}' -H "authorization: Bearer $TOKEN" "$url")
    [ "$code" = 200 ] || { echo "$url answered $code"; exit 1; }
done
# ...and the policy must really be on: no token is 401 at (c) and (d).
for url in http://127.0.0.1:18082/ping http://127.0.0.1:18090/ping; do
    code=$(curl -s -o /dev/null -w '%{http_code}' "$url")
    [ "$code" = 401 ] || { echo "$url without a token answered $code"; exit 1; }
done

cpu() { # utime+stime in seconds of the given pids
    local t=0
    for p in "$@"; do
        [ -r "/proc/$p/stat" ] || continue
        t=$(awk -v t="$t" '{ print t + $14 + $15 }' "/proc/$p/stat")
    done
    echo "scale=4; $t / $(getconf CLK_TCK)" | bc
}
service_pids() { # the frontend pod (the flaky service runs the same program)
    for p in $(pgrep -P "$up_pid" -f "hotel frontend"); do
        tr '\0' '\n' < "/proc/$p/environ" | grep -qx 'DPUMESH_SERVICE=frontend' && echo "$p"
    done
}
haproxy_pids() { pgrep -x haproxy; pgrep -x nginx; }
mesh_pids() { pgrep -P "$up_pid" -f "dpumesh (node|ingress)"; }

run() { # name url pids-function [second pids-function, reported as a 7th field]
    local name=$1 url=$2 who=$3 also=${4:-} before after before2=0 after2=0 out rps p50 p99 reqs
    before=$(cpu $($who))
    [ -n "$also" ] && before2=$(cpu $($also))
    out=$(wrk -t1 -c32 -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "$url")
    after=$(cpu $($who))
    [ -n "$also" ] && after2=$(cpu $($also))
    rps=$(awk '/Requests\/sec/ { print $2 }' <<<"$out")
    reqs=$(awk '/requests in/ { print $1 }' <<<"$out")
    p50=$(awk '$1 == "50%" { print $2 }' <<<"$out")
    p99=$(awk '$1 == "99%" { print $2 }' <<<"$out")
    non2xx=$(awk '/Non-2xx/ { print $5 }' <<<"$out")
    echo "$name|$rps|$p50|$p99|$(echo "scale=4; ($after - $before) * 1000 / $reqs" | bc)|${non2xx:-0}|$(echo "scale=4; ($after2 - $before2) * 1000 / $reqs" | bc)"
}

echo "==> measuring (wrk -t1 -c32 -d${DURATION}s each)"
a=$(run "a nginx direct" http://127.0.0.1:18080/ping "pgrep -x nginx")
b=$(run "b nginx proxy" http://127.0.0.1:18081/ping "pgrep -x nginx")
c=$(run "c haproxy+jwt/rbac/ratelimit" http://127.0.0.1:18082/ping haproxy_pids)
d=$(run "d dpumesh (CPU: the service process)" http://127.0.0.1:18090/ping service_pids mesh_pids)

printf '\n%-44s %10s %10s %10s %16s %8s\n' target req/s p50 p99 "CPU s/1k req" non-2xx
for row in "$a" "$b" "$c" "$d"; do
    IFS='|' read -r name rps p50 p99 cpu non _ <<<"$row"
    printf '%-44s %10s %10s %10s %16s %8s\n' "$name" "$rps" "$p50" "$p99" "$cpu" "$non"
done
IFS='|' read -r _ _ _ _ _ _ dm <<<"$d"
echo "(d: CPU of the ingress and node processes in the same run, i.e. what the DPUs and the ingress node would carry: $dm s per 1000 requests)"
IFS='|' read -r _ rb _ _ _ _ _ <<<"$b"
IFS='|' read -r _ rc _ _ cc _ _ <<<"$c"
IFS='|' read -r _ rd _ _ cd _ _ <<<"$d"
echo
echo "d/c rps: $(echo "scale=2; $rd / $rc" | bc)   d/b rps: $(echo "scale=2; $rd / $rb" | bc)"
echo "host CPU per 1000 requests, service process vs HAProxy+nginx: $(echo "scale=3; $cd / $cc" | bc)"
