#!/usr/bin/env bash
# The mesh against its peers on this machine, in one run, with the same token:
#   (a) nginx serving a fixed 200,
#   (b) nginx as a plain reverse proxy to (a),
#   (c) HAProxy in front of (a) at its best setting here (nbthread 2, one per core):
#       JWT HS256 verify + expiry, a role rule on the path, a per-subject rate limit,
#   (d) the DPUmesh local mesh (`dpumesh up`, hotel sample) with the same policy as
#       Wasm filters (jwt, rbac, ratelimit) in front of the frontend service's /ping,
#       over the shared-memory fabric (the default on one host),
#   (e) the same mesh with the TCP fabric forced (`transport: tcp`, as across hosts),
#       its links over mutual TLS (the default),
#   (f) (e) without TLS (`identity: {mtls: off}`): what mutual TLS costs on the TCP
#       fabric, in req/s and in CPU per request of the ingress and nodes,
#   (g) (d) with every filter run through wasmtime's component calls and its chains
#       fused (`DPUMESH_CORE_CALLS=off`): what running the filters as core instances
#       saves the nodes,
#   (h) (d) with two shards per node (`cores: 2`; (d) shares the machine's cores
#       among its nodes, one shard each on 2 cores): what a second shard per node
#       gives or costs on this machine,
#   (i) HTTPS at the ingress (d with `ingress.tls`, one certificate) against HAProxy
#       terminating TLS with the same certificate and the same policy in front of (a):
#       keep-alive req/s, and new TLS connections per second (`connection: close`
#       on every request: each a full handshake, ECDSA P-256, TLS 1.3),
#   (j) gRPC unary calls (gRPC's interop UnaryCall, 100 bytes each way, h2load -c32
#       -m10 over h2c): the mesh with the interop service as a pod (a tonic server
#       on the host library) behind the bench chain, against HAProxy with the same
#       policy proxying h2 to the same tonic server on TCP,
#   (l)–(o) at the end: a streamed 1 GiB download and upload through nginx proxy and
#       through the mesh (bench/stream.sh, which also runs alone),
#   (k) nginx (a), unmodified, joined to the mesh through a bridge (one mesh-file
#       line), against nginx proxying to it (b): req/s and the host's CPU per request
#       (the bridge + the server, against nginx proxying + serving: the sidecar cost),
#       each as fast as it answers, then both at one offered load (h2load --h1 --rps:
#       80 % of what the bridged row carried),
# each under wrk -t1 -c32 -d${DURATION:-10}s after an unmeasured ${WARMUP:-3}s; then HTTP/2 with h2load -c32 -m10
# against (c) serving h2 and (d).
# Prints req/s, p50/p99, CPU per request of the peers and of the mesh's parts (the
# service process: what the host pays; the ingress and nodes: what the ingress node
# and the DPUs carry), context switches per request summed over every mesh process,
# and the ratios the goals are stated in. Installs wrk, nginx, haproxy and h2load
# (Debian packages) when missing.
# ROWS="b j k" runs only those rows (letters as above; "l" for (l)-(o)) and prints
# the ratios it has both sides of ("-" for the others): to repeat a few rows quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-3}"
SECRET="$(bench/demo-key.sh)"

missing=""
for tool in wrk nginx haproxy h2load; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing="$missing $tool"
done
if [ -n "$missing" ]; then
    echo "==> installing$missing"
    pkgs="${missing/h2load/nghttp2-client}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null
fi
export PATH="$PATH:/usr/sbin"

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-sample-grpc -p dpumesh-test-artifacts

. bench/common.sh

TOKEN="$(python3 bench/token.py "$SECRET")"

start_nginx <<NGINX
    keepalive_requests 1000000;
    upstream origin { server 127.0.0.1:18080; keepalive 64; }
    server { listen 127.0.0.1:18080; location / { return 200 "pong\n"; } }
    server {
        listen 127.0.0.1:18081;
        location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
NGINX

# One certificate for both TLS terminators (ECDSA P-256, as the mesh's own).
mkdir -p "$work/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
    -keyout "$work/tls/key.pem" -out "$work/tls/cert.pem" 2>/dev/null
cat "$work/tls/cert.pem" "$work/tls/key.pem" > "$work/tls/haproxy.pem"

cat > "$work/haproxy.cfg" <<HAP
global
    nbthread 2
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    option http-keep-alive
frontend fe
    bind 127.0.0.1:18082
    bind 127.0.0.1:18083 proto h2
    bind 127.0.0.1:18084 ssl crt $work/tls/haproxy.pem alpn h2,http/1.1
    bind 127.0.0.1:18085 proto h2
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
    use_backend grpc if { dst_port 18085 }
    default_backend origin
backend origin
    http-reuse always
    server s1 127.0.0.1:18080
backend grpc
    http-reuse always
    server g1 127.0.0.1:18086 proto h2
HAP
haproxy -f "$work/haproxy.cfg" -db >/dev/null 2>&1 &
pids+=($!)
# gRPC's interop service on TCP: HAProxy's backend for (j).
./target/release/grpc-interop serve 127.0.0.1:18086 &
pids+=($!)
# One UnaryCall (SimpleRequest: response_size 100, a 100-byte payload), framed.
python3 - "$work/unary.grpc" <<'PY'
import sys
payload = b"\x12\x64" + bytes(100)                       # Payload.body: 100 bytes
message = b"\x10\x64" + b"\x1a" + bytes([len(payload)]) + payload
open(sys.argv[1], "wb").write(b"\x00" + len(message).to_bytes(4, "big") + message)
PY

. bench/mesh-lib.sh

oncpu_ns() { # nanoseconds on CPU of every thread of a pid (schedstat: finer than ticks)
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'
}
idle() { # seconds: CPU of each node process while the mesh serves nothing, in % of a core
    local secs=$1 p out=""
    local nodes
    nodes=$(pgrep -P "$up_pid" -f "dpumesh node")
    declare -A before
    for p in $nodes; do before[$p]=$(oncpu_ns "$p"); done
    sleep "$secs"
    for p in $nodes; do
        out="$out $(echo "scale=3; ($(oncpu_ns "$p") - ${before[$p]}) * 100 / ($secs * 1000000000)" | bc)%"
    done
    echo "$out"
}

h2() { # name url: 2xx answers per second under h2load -c32 -m10, and their count
    local out
    out=$(h2load -c32 -m10 -D "$DURATION" -H "authorization: Bearer $TOKEN" "$1" 2>/dev/null)
    local ok
    ok=$(awk '/status codes:/ { print $3 }' <<<"$out")
    # Only 2xx count: a refusal (429, 503) is not a request served.
    echo "$2|$(echo "scale=2; ${ok:-0} / $DURATION" | bc)|${ok:-0}"
}

want() { # row: whether this run measures it (ROWS, default all)
    [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" $1 "* ]]
}
ratio() { # x y: x / y to two places, "-" when either was not measured
    if [ -n "$1" ] && [ -n "$2" ]; then echo "scale=2; $1 / $2" | bc; else echo "-"; fi
}
a="" b="" c="" ch2="" ci="" cin="" d="" dh2="" e="" f="" g="" h="" di="" din="" k="" cj="" dj=""
idle_nodes="-" idle_quiet="-"

echo "==> measuring (wrk -t1 -c32 -d${DURATION}s each, after ${WARMUP}s unmeasured)"
check http://127.0.0.1:18080/ping; check http://127.0.0.1:18081/ping; check http://127.0.0.1:18082/ping
check_policy http://127.0.0.1:18082/ping
if want a; then a=$(run "a nginx direct" http://127.0.0.1:18080/ping "pgrep -x nginx"); fi
if want b || want k; then b=$(run "b nginx proxy" http://127.0.0.1:18081/ping "pgrep -x nginx"); fi
if want c || want d; then
    c=$(run "c haproxy nbthread 2, jwt/rbac/ratelimit" http://127.0.0.1:18082/ping haproxy_pids)
    ch2=$(h2 http://127.0.0.1:18083/ping "c haproxy h2")
fi
if want i; then
    CURL_CA_BUNDLE="$work/tls/cert.pem" check https://127.0.0.1:18084/ping
    ci=$(run "i haproxy https keep-alive" https://127.0.0.1:18084/ping haproxy_pids)
    cin=$(WRK_CLOSE=1 run "i haproxy https new connections" https://127.0.0.1:18084/ping haproxy_pids)
fi

if want d; then
    start_mesh shm
    check http://127.0.0.1:18090/ping; check_policy http://127.0.0.1:18090/ping
    # Idle first (after the checks' requests have settled): what a node costs doing
    # nothing.
    sleep 2
    idle_nodes=$(idle "$((DURATION > 5 ? DURATION : 5))")
    d=$(run "d dpumesh (shm fabric)" http://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    dh2=$(h2 http://127.0.0.1:18090/ping "d dpumesh h2 (shm fabric)")
    stop_mesh
fi

if want g; then
    start_mesh shm component
    check http://127.0.0.1:18090/ping; check_policy http://127.0.0.1:18090/ping
    g=$(run "g dpumesh (shm fabric, component calls, fused)" http://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    stop_mesh
fi

if want h; then
    start_mesh shm cores2
    check http://127.0.0.1:18090/ping; check_policy http://127.0.0.1:18090/ping
    h=$(run "h dpumesh (shm fabric, two shards a node)" http://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    stop_mesh
fi

# The idle node again without the Pingmesh agent (its probes and uploads are work the
# agent does on purpose): what the node's own threads cost doing nothing.
if want d; then
    start_mesh shm nopingmesh
    check http://127.0.0.1:18090/ping
    sleep 2
    idle_quiet=$(idle "$((DURATION > 5 ? DURATION : 5))")
    stop_mesh
fi

if want i; then
    start_mesh shm tls
    CURL_CA_BUNDLE="$work/tls/cert.pem" check https://127.0.0.1:18090/ping
    di=$(run "i dpumesh https keep-alive" https://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    din=$(WRK_CLOSE=1 run "i dpumesh https new connections" https://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    stop_mesh
fi

grpc_check() { # url: gRPC calls pass, with the token
    ./target/release/grpc-interop client --server "$1" --token "$TOKEN" empty_unary large_unary >/dev/null ||
        { echo "$1: gRPC calls fail"; exit 1; }
}
if want j; then
    grpc_check http://127.0.0.1:18085
    cj=$(grpc_run "j haproxy grpc unary" http://127.0.0.1:18085/grpc.testing.TestService/UnaryCall haproxy_grpc_pids)
    start_mesh shm grpc
    grpc_check http://127.0.0.1:18090
    dj=$(grpc_run "j dpumesh grpc unary" http://127.0.0.1:18090/grpc.testing.TestService/UnaryCall grpc_pod_pids mesh_pids)
    stop_mesh
fi

if want k; then
    start_mesh shm bridge
    check http://127.0.0.1:18090/legacy/ping; check_policy http://127.0.0.1:18090/legacy/ping
    k=$(run "k dpumesh bridge to nginx" http://127.0.0.1:18090/legacy/ping bridge_pids mesh_pids all_mesh_pids)
    # The same two at the same offered load (80 % of what the bridged row carried,
    # which the bridge's path through the ingress and nodes on these 2 cores limits):
    # CPU per request depends on the load (a saturated nginx batches its wake-ups), so
    # the sidecar cost is compared at one rate too.
    IFS='|' read -r _ rk_ _ <<<"$k"
    pace=$(echo "scale=0; ${rk_%.*} * 8 / 10" | bc)
    kp=$(paced http://127.0.0.1:18090/legacy/ping "$pace" bridge_pids)
    bp=$(paced http://127.0.0.1:18081/ping "$pace" "pgrep -x nginx")
    stop_mesh
fi

if want e; then
    start_mesh tcp
    check http://127.0.0.1:18090/ping
    e=$(run "e dpumesh (tcp fabric, mutual TLS)" http://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    stop_mesh
fi

if want f || want e; then
    start_mesh tcp plain
    check http://127.0.0.1:18090/ping
    f=$(run "f dpumesh (tcp fabric, no TLS)" http://127.0.0.1:18090/ping service_pids mesh_pids all_mesh_pids)
    stop_mesh
fi

printf '\n%-42s %10s %9s %9s %14s %14s %10s %7s\n' target req/s p50 p99 "CPU us/req" "mesh us/req" "cs/req" "idle"
for row in "$a" "$b" "$c" "$d" "$e" "$f" "$g" "$h" "$ci" "$di" "$cin" "$din" "$k"; do
    [ -n "$row" ] || continue
    IFS='|' read -r name rps p50 p99 cpu non mesh sw idle <<<"$row"
    [ "$non" != 0 ] && name="$name ($non non-2xx!)"
    case "$name" in
        [defghk]*|"i dpumesh"*) printf '%-42s %10s %9s %9s %14s %14s %10s %6s%%\n' "$name" "$rps" "$p50" "$p99" "$cpu" "$mesh" "$sw" "$idle" ;;
        *) printf '%-42s %10s %9s %9s %14s %14s %10s %6s%%\n' "$name" "$rps" "$p50" "$p99" "$cpu" "" "" "$idle" ;;
    esac
done
echo "(CPU us/req: the peer's processes for a-c (HAProxy + nginx for c), the frontend service process for d-h,"
echo " the bridge + nginx for k;"
echo " mesh us/req: the ingress and node processes, what the ingress node and the DPUs carry;"
echo " cs/req: context switches summed over every thread of the ingress, nodes and pods;"
echo " idle: the share of the machine's cores nobody used during the run)"
printf '\n%-42s %10s %10s\n' "HTTP/2 (h2load -c32 -m10)" "2xx/s" 2xx
for row in "$ch2" "$dh2"; do
    [ -n "$row" ] || continue
    IFS='|' read -r name rps ok <<<"$row"
    printf '%-42s %10s %10s\n' "$name" "$rps" "$ok"
done

IFS='|' read -r _ ra _ _ ca _ _ _ _ <<<"$a"
IFS='|' read -r _ rb _ _ _ _ _ _ _ <<<"$b"
IFS='|' read -r _ rc _ pc cc _ _ _ ic <<<"$c"
IFS='|' read -r _ rd _ pd cd _ md swd id <<<"$d"
IFS='|' read -r _ re _ _ _ _ me _ _ <<<"$e"
IFS='|' read -r _ rf _ _ _ _ mf _ _ <<<"$f"
IFS='|' read -r _ rg _ _ _ _ mg _ _ <<<"$g"
IFS='|' read -r _ rh _ ph _ _ mh swh _ <<<"$h"
IFS='|' read -r _ rci _ _ cci _ _ _ _ <<<"$ci"
IFS='|' read -r _ rdi _ _ _ _ mdi _ _ <<<"$di"
IFS='|' read -r _ rcin _ _ _ _ _ _ _ <<<"$cin"
IFS='|' read -r _ rdin _ _ _ _ _ _ _ <<<"$din"
IFS='|' read -r _ rch2 _ <<<"$ch2"
IFS='|' read -r _ rdh2 _ <<<"$dh2"
echo
echo "d/c req/s: $(ratio "$rd" "$rc")   d/b req/s: $(ratio "$rd" "$rb")   p99 d $pd vs c $pc"
echo "service CPU per request vs nginx direct: $(ratio "$cd" "$ca")"
echo "ingress + node CPU per request vs HAProxy + nginx: $(ratio "$md" "$cc")"
echo "context switches per request across the mesh: $swd"
echo "cores left idle under load: d $id% vs c $ic%"
echo "tcp fabric e/c req/s: $(ratio "$re" "$rc")"
echo "mutual TLS on the tcp fabric: req/s e/f $(ratio "$re" "$rf"), ingress + node CPU per request e $me vs f $mf us"
echo "HTTP/2 d/c req/s: $(ratio "$rdh2" "$rch2")"
echo "core instances: req/s d/g $(ratio "$rd" "$rg"), ingress + node CPU per request d $md vs g $mg us"
echo "shards: req/s d/h $(ratio "$rd" "$rh"), p99 d $pd vs h $ph, ingress + node CPU per request d $md vs h $mh us, cs/req d $swd vs h $swh"
echo "idle node CPU (each node, % of a core):$idle_nodes; without the Pingmesh agent:$idle_quiet"
echo "HTTPS keep-alive i/i req/s (mesh / HAProxy): $(ratio "$rdi" "$rci"), ingress + node CPU per request $mdi us vs HAProxy + nginx $cci us"
echo "HTTPS new connections/s (mesh / HAProxy): $(ratio "$rdin" "$rcin") ($rdin vs $rcin)"
printf '\n%-42s %10s %10s %14s %14s\n' "gRPC unary (h2load -c32 -m10)" calls/s answered "CPU us/call" "mesh us/call"
for row in "$cj" "$dj"; do
    [ -n "$row" ] || continue
    IFS='|' read -r name rps ok cpu mesh <<<"$row"
    printf '%-42s %10s %10s %14s %14s\n' "$name" "$rps" "$ok" "$cpu" "$mesh"
done
echo "(CPU us/call: HAProxy + the tonic server for j haproxy, the service pod for j dpumesh)"
IFS='|' read -r _ rcj _ ccj _ <<<"$cj"
IFS='|' read -r _ rdj _ cdj mdj <<<"$dj"
IFS='|' read -r _ rk _ _ ck _ mk _ _ <<<"$k"
IFS='|' read -r _ _ _ _ cb _ _ _ _ <<<"$b"
echo "bridged nginx k/b req/s: $(ratio "$rk" "$rb"), host CPU per request (bridge + nginx vs nginx proxy + origin): $ck vs $cb us ($(ratio "$ck" "$cb")), ingress + node $mk us"
if [ -n "${kp:-}" ]; then
    IFS='|' read -r rkp ckp <<<"$kp"
    IFS='|' read -r rbp cbp <<<"$bp"
    echo "  the same at one offered load (${pace}/s; answered: $rkp/s vs $rbp/s): $ckp vs $cbp us ($(ratio "$ckp" "$cbp"))"
fi
echo "gRPC unary j/j calls/s (mesh / HAProxy): $(ratio "$rdj" "$rcj"), service CPU per call $cdj us (tonic on TCP + HAProxy: $ccj us), ingress + node $mdj us"

if want l; then
    echo
    echo "==> (l)-(o): a streamed 1 GiB download and upload (bench/stream.sh)"
    ./bench/stream.sh | sed -n '/^name|MB/,$p'
fi
