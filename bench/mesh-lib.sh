# The local mesh for the bench scripts (sourced after common.sh, not run): a mesh
# file on the bench's own ports from the hotel sample, starting and stopping
# `dpumesh up`, the processes of its parts, and one wrk run measured with the CPU and
# context switches of chosen processes.
# Needs: TOKEN, DURATION (WARMUP optional), and the release build of dpumesh and
# the hotel sample (or another build's folder in BIN, e.g. ./target/debug).

# The mesh on its own ports, from a mesh file in the run's temporary folder (the
# sample's policy by absolute path; nothing is written into the repository).
mesh_file() { # transport [plain|component|cores2|nopingmesh|tls|grpc|bridge]
    # POLICY: another policy file (bench/scale.sh's generated ones).
    local policy="${POLICY:-$PWD/samples/hotel/policy.yaml}"
    case "${2:-}" in grpc|bridge) policy=$(bench_policy) ;; esac
    sed -e 's/127.0.0.1:8000/127.0.0.1:18090/' -e 's/127.0.0.1:7101/127.0.0.1:18091/' \
        -e 's/127.0.0.1:7102/127.0.0.1:18092/' -e 's/127.0.0.1:9101/127.0.0.1:18093/' \
        -e 's/127.0.0.1:9102/127.0.0.1:18094/' \
        -e "s#^policy: policy.yaml#policy: $policy\ntransport: $1#" \
        samples/hotel/mesh.yaml > "$work/mesh-$1.yaml"
    grep -q "^transport: $1" "$work/mesh-$1.yaml" || { echo "samples/hotel/mesh.yaml: no 'policy: policy.yaml' line"; exit 1; }
    # The load generator is one client address: it gets every slot (a mesh whose
    # clients all arrive through one load balancer's address would do the same), or
    # h2load's 320 streams would meet the per-client share (429) instead of the mesh.
    sed -i -e 's/^ingress:$/ingress:\n  slots_per_client: 1024/' "$work/mesh-$1.yaml"
    grep -q "^  slots_per_client: 1024" "$work/mesh-$1.yaml" || { echo "samples/hotel/mesh.yaml: no 'ingress:' line"; exit 1; }
    if [ "${2:-}" = plain ]; then echo "identity: {mtls: off}" >> "$work/mesh-$1.yaml"; fi
    if [ "${2:-}" = nopingmesh ]; then
        # Without the `pingmesh` section: no agent probing from the nodes.
        python3 - "$work/mesh-$1.yaml" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
start = text.index("\npingmesh:") + 1
end = text.index("\n", text.index("ecmp_paths", start)) + 1
open(path, "w").write(text[:start] + text[end:])
PY
        ! grep -q '^pingmesh:' "$work/mesh-$1.yaml" || { echo "the pingmesh section is still there"; exit 1; }
    fi
    if [ "${2:-}" = tls ]; then
        # HTTPS at the ingress with the bench's certificate (bench/mesh.sh makes it).
        sed -i -e "s#^ingress:\$#ingress:\n  tls: {certificates: [{cert: $work/tls/cert.pem, key: $work/tls/key.pem}]}#" "$work/mesh-$1.yaml"
        grep -q "^  tls: " "$work/mesh-$1.yaml" || { echo "samples/hotel/mesh.yaml: no 'ingress:' line"; exit 1; }
    fi
    if [ "${2:-}" = grpc ]; then
        # gRPC's interop service as a pod of node1, beside the frontend.
        sed -i -e 's/^services:$/services:\n  grpc: {nodes: [node1], command: [grpc-interop, pod]}/' "$work/mesh-$1.yaml"
        grep -q "^  grpc: " "$work/mesh-$1.yaml" || { echo "samples/hotel/mesh.yaml: no 'services:' line"; exit 1; }
    fi
    if [ "${2:-}" = bridge ]; then
        # nginx (a), unmodified, joined through a bridge on node1.
        sed -i -e 's/^services:$/services:\n  legacy: {nodes: [node1], bridge: {to: 127.0.0.1:18080}}/' "$work/mesh-$1.yaml"
        grep -q "^  legacy: " "$work/mesh-$1.yaml" || { echo "samples/hotel/mesh.yaml: no 'services:' line"; exit 1; }
    fi
    if [ "${2:-}" = cores2 ]; then
        # Two shards per node whatever the machine has.
        sed -i -e 's/\(rnic: 127\.0\.0\.1[12]:4791\)}/\1, cores: 2}/' "$work/mesh-$1.yaml"
        [ "$(grep -c 'cores: 2}' "$work/mesh-$1.yaml")" = 2 ] || { echo "samples/hotel/mesh.yaml: node lines not as expected"; exit 1; }
    fi
    # MESH_EXTRA: a command given the file last (bench/scale.sh adds nodes with it).
    if [ -n "${MESH_EXTRA:-}" ]; then "$MESH_EXTRA" "$work/mesh-$1.yaml"; fi
}
# The sample's policy with gRPC's interop service (at its path) and a bridged server
# (at /legacy) behind the bench chain (jwt, rbac, ratelimit: the policy HAProxy
# applies), written into the run's folder with the sample's relative paths made
# absolute; prints its path.
bench_policy() {
    python3 - "$PWD" "$work/policy-bench.yaml" <<'PY'
import sys
root, out = sys.argv[1], sys.argv[2]
text = open(f"{root}/samples/hotel/policy.yaml").read()
text = text.replace("../../target/", f"{root}/target/")
text = text.replace("secret_file: .dpumesh/", f"secret_file: {root}/samples/hotel/.dpumesh/")
path = "/grpc.testing.TestService/"
for old, new in [
    ("            - {path: {prefix: /ping}}\n",
     "            - {path: {prefix: /ping}}\n            - {path: {prefix: %s}}\n"
     "            - {path: {prefix: /legacy}}\n" % path),
    ("\nservices:\n", "\nservices:\n  grpc: {chain: bench}\n  legacy: {chain: bench}\n"),
    ("\nroutes:\n", "\nroutes:\n  - {path_prefix: %s, service: grpc, chain: bench}\n"
     "  - {path_prefix: /legacy, service: legacy, chain: bench}\n" % path),
]:
    if old not in text:
        sys.exit(f"samples/hotel/policy.yaml: no {old!r}")
    text = text.replace(old, new, 1)
open(out, "w").write(text)
print(out)
PY
}

start_mesh() { # transport [plain|component|cores2|nopingmesh|tls|grpc]
    mesh_file "$1" "${2:-}"
    # component: every filter through wasmtime's component calls, chains fused (how
    # the nodes ran filters before core instances).
    local core=on
    [ "${2:-}" = component ] && core=off
    DPUMESH_CORE_CALLS=$core "${BIN:-./target/release}"/dpumesh up --config "$work/mesh-$1.yaml" > "$work/up-$1.log" 2>&1 &
    up_pid=$!
    for _ in $(seq 1 300); do grep -q "Ctrl-C stops" "$work/up-$1.log" && break; sleep 0.2; done
    grep -q "Ctrl-C stops" "$work/up-$1.log" || { cat "$work/up-$1.log"; echo "the mesh did not start"; exit 1; }
}
stop_mesh() {
    kill -INT "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
    up_pid=""
}

check_policy() { # url: the policy is on
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' "$1" || true)
    [ "$code" = 401 ] || { echo "$1 without a token answered $code"; exit 1; }
}

switches() { # voluntary + involuntary context switches of every thread of the pids
    local t=0 v
    for p in "$@"; do
        for s in /proc/"$p"/task/*/status; do
            v=$(awk '/^voluntary_ctxt_switches|^nonvoluntary_ctxt_switches/ { s += $2 } END { print s + 0 }' "$s" 2>/dev/null || echo 0)
            t=$((t + v))
        done
    done
    echo "$t"
}
service_pids() { # the frontend pod (the flaky service runs the same program)
    for p in $(pgrep -P "$up_pid" -f "hotel frontend"); do
        tr '\0' '\n' < "/proc/$p/environ" | grep -qx 'DPUMESH_SERVICE=frontend' && echo "$p"
    done
}
haproxy_pids() { pgrep -x haproxy; pgrep -x nginx; }
grpc_server_pids() { pgrep -f "grpc-interop serve"; }
grpc_pod_pids() { pgrep -P "$up_pid" -f "grpc-interop pod"; }
haproxy_grpc_pids() { pgrep -x haproxy; grpc_server_pids; }
# What the host pays for a bridged server: the bridge (the sidecar) and the server.
bridge_pids() { pgrep -P "$up_pid" -f "dpumesh bridge"; pgrep -x nginx; }
mesh_pids() { pgrep -P "$up_pid" -f "dpumesh (node|ingress)"; }
all_mesh_pids() { pgrep -P "$up_pid"; }
none() { :; }

idle_ticks() { # "idle total": the machine's idle (+ iowait) and total ticks so far
    awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print $5 + $6, t }' /proc/stat
}
idle_share() { # before after (idle_ticks): the share of the machine left idle, in %
    local b=($1) a=($2)
    echo "scale=1; (${a[0]} - ${b[0]}) * 100 / (${a[1]} - ${b[1]})" | bc
}

# gRPC unary calls under h2load -c32 -m10 (UnaryCall, 100 bytes each way, the body
# in $work/unary.grpc): prints name|calls/s|answered|CPU us/call|second CPU us/call.
# h2load counts HTTP statuses; gRPC's travels in trailers, so the scripts check a
# call with a gRPC client before measuring.
grpc_run() { # name url pids [second pids]
    local name=$1 url=$2 who=$3 also=${4:-none} before after before2 after2 out ok
    local args=(-c32 -m10 -d "$work/unary.grpc" -H "authorization: Bearer $TOKEN"
        -H "content-type: application/grpc" -H "te: trailers")
    [ "${WARMUP:-0}" -gt 0 ] && h2load "${args[@]}" -D "$WARMUP" "$url" >/dev/null 2>&1
    before=$(cpu $($who)); before2=$(cpu $($also))
    out=$(h2load "${args[@]}" -D "$DURATION" "$url" 2>/dev/null)
    after=$(cpu $($who)); after2=$(cpu $($also))
    ok=$(awk '/status codes:/ { print $3 }' <<<"$out")
    ok=${ok:-0}
    [ "$ok" -gt 0 ] || { echo "$name: no call answered"; exit 1; }
    echo "$name|$(echo "scale=2; $ok / $DURATION" | bc)|$ok|$(echo "scale=2; ($after - $before) * 1000000 / $ok" | bc)|$(echo "scale=2; ($after2 - $before2) * 1000000 / $ok" | bc)"
}

# Prints name|req/s|p50|p99|CPU us/req|non-2xx|second CPU us/req|cs/req|idle %: the
# last is the share of both cores nobody used during the run (a target that leaves
# cores idle under load is limited by its hand-offs, not by its CPU per request).
# With WRK_CLOSE=1 every request asks for `connection: close`: each is a new
# connection (over https, a new full TLS handshake: wrk does not resume sessions).
paced() { # url rate pids: req/s answered and CPU us per request of the pids with h2load
    # sending HTTP/1.1 at `rate` requests a second over 32 connections (an offered load,
    # not as fast as the target answers): CPU per request at the same load on both sides
    local url=$1 rate=$2 who=$3 before after out n
    local per=$(( (rate + 31) / 32 ))
    h2load --h1 -c32 --rps="$per" -D "${WARMUP:-2}" -H "authorization: Bearer $TOKEN" "$url" >/dev/null 2>&1 || true
    before=$(cpu $($who))
    out=$(h2load --h1 -c32 --rps="$per" -D "$DURATION" -H "authorization: Bearer $TOKEN" "$url" 2>&1)
    after=$(cpu $($who))
    n=$(awk '/^status codes:/ { print $3 }' <<<"$out")
    [ -n "$n" ] && [ "$n" -gt 0 ] || { echo "-|-"; return; }
    echo "$(echo "scale=0; $n / $DURATION" | bc)|$(echo "scale=2; ($after - $before) * 1000000 / $n" | bc)"
}

run() { # name url pids [second pids] [pids whose context switches count]
    local name=$1 url=$2 who=$3 also=${4:-none} sw=${5:-none}
    local before after before2 after2 s1 s2 i1 i2 out rps p50 p99 reqs non2xx
    local extra=()
    [ "${WRK_CLOSE:-0}" = 1 ] && extra=(-H "connection: close")
    # With WARMUP=S (mesh.sh: 3) every target is warmed up first for S seconds,
    # unmeasured: a mesh just started still fills its instance pools and caches, and
    # peers and mesh alike start measured runs hot.
    if [ "${WARMUP:-0}" -gt 0 ]; then
        wrk -t1 -c32 -d"${WARMUP}s" -H "authorization: Bearer $TOKEN" "${extra[@]}" "$url" >/dev/null
    fi
    before=$(cpu $($who)); before2=$(cpu $($also)); s1=$(switches $($sw)); i1=$(idle_ticks)
    out=$(wrk -t1 -c32 -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "${extra[@]}" "$url")
    after=$(cpu $($who)); after2=$(cpu $($also)); s2=$(switches $($sw)); i2=$(idle_ticks)
    rps=$(awk '/Requests\/sec/ { print $2 }' <<<"$out")
    reqs=$(awk '/requests in/ { print $1 }' <<<"$out")
    p50=$(awk '$1 == "50%" { print $2 }' <<<"$out")
    p99=$(awk '$1 == "99%" { print $2 }' <<<"$out")
    non2xx=$(awk '/Non-2xx/ { print $5 }' <<<"$out")
    echo "$name|$rps|$p50|$p99|$(echo "scale=2; ($after - $before) * 1000000 / $reqs" | bc)|${non2xx:-0}|$(echo "scale=2; ($after2 - $before2) * 1000000 / $reqs" | bc)|$(echo "scale=2; ($s2 - $s1) / $reqs" | bc)|$(idle_share "$i1" "$i2")"
}

