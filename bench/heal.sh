#!/usr/bin/env bash
# How fast the local mesh heals. `dpumesh up` runs the hotel sample under a steady
# load (wrk -t1 -c4 on GET /hotels, which crosses both nodes: frontend and user on
# node1, reservation on node2). Each kind of process is then killed with SIGKILL
# ${KILLS:-5} times in turn, ${SETTLE:-11} s apart: a pod (reservation), node2, node1,
# the ingress. For each kill it measures the time from the kill until a fresh request
# is answered 200 again (probing every 10 ms), and prints the median and the worst per
# kind. At the end:
# what the load saw (requests, non-2xx answers, timeouts: a timeout would be a request
# hanging past the mesh's request timeout), and any region a killed process left in
# /dev/shm. Installs wrk (Debian) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
KILLS="${KILLS:-5}"
# Time between kills: longer than `dpumesh up`'s 10 s "ran long enough" so each kill
# is a first death (restarted after 0.1 s), not a crash loop backing off.
SETTLE="${SETTLE:-11}"
SECRET="$(bench/demo-key.sh)"

command -v wrk >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts

work="$(mktemp -d)"
up_pid=""
wrk_pid=""
cleanup() {
    [ -n "$wrk_pid" ] && kill "$wrk_pid" 2>/dev/null || true
    [ -n "$up_pid" ] && kill -INT "$up_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

TOKEN="$(python3 bench/token.py "$SECRET")"

sed -e "s#^policy: policy.yaml#policy: $PWD/samples/hotel/policy.yaml#" \
    samples/hotel/mesh.yaml > "$work/mesh.yaml"
./target/release/dpumesh up --config "$work/mesh.yaml" > "$work/up.log" 2>&1 &
up_pid=$!
for _ in $(seq 1 300); do grep -q "Ctrl-C stops" "$work/up.log" && break; sleep 0.2; done
grep -q "Ctrl-C stops" "$work/up.log" || { cat "$work/up.log"; echo "the mesh did not start"; exit 1; }
ingress="$(sed -n 's#^  ingress   http://\([^/]*\)/.*#\1#p' "$work/up.log")"
url="http://$ingress/hotels?user=3"
timeout="$(sed -n 's/^ *request_timeout: *\([0-9]*\)s.*/\1/p' samples/hotel/mesh.yaml)"

status() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 2 -H "authorization: Bearer $TOKEN" "$url" || true
}
[ "$(status)" = 200 ] || { echo "the mesh does not serve $url"; exit 1; }

wrk -t1 -c4 -d1h --timeout "$((timeout + 2))s" -H "authorization: Bearer $TOKEN" "$url" \
    > "$work/wrk.log" 2>&1 &
wrk_pid=$!
sleep 1

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
killed_pids=()
results=()
for kind in "pod reservation:hotel reservation" "node2:dpumesh node .*--name node2" \
            "node1:dpumesh node .*--name node1" "ingress:dpumesh ingress"; do
    name="${kind%%:*}"
    pattern="${kind#*:}"
    times=()
    for _ in $(seq 1 "$KILLS"); do
        pid=""
        for _ in $(seq 1 500); do
            pid="$(pgrep -P "$up_pid" -f "$pattern" | head -1 || true)"
            [ -n "$pid" ] && break
            sleep 0.01
        done
        [ -n "$pid" ] || { echo "no $name process"; exit 1; }
        killed_pids+=("$pid")
        start="$(now_ms)"
        kill -KILL "$pid"
        # Dead before probing: a probe must not be answered by the process being killed.
        while kill -0 "$pid" 2>/dev/null; do sleep 0.005; done
        until [ "$(status)" = 200 ]; do
            sleep 0.01
            [ $(( $(now_ms) - start )) -lt 60000 ] || { echo "$name: not serving 60 s after the kill"; tail -30 "$work/up.log"; exit 1; }
        done
        times+=("$(( $(now_ms) - start ))")
        # Let it settle (and its restart history calm down) before the next kill.
        sleep "$SETTLE"
    done
    sorted="$(printf '%s\n' "${times[@]}" | sort -n)"
    median="$(echo "$sorted" | sed -n "$(( (KILLS + 1) / 2 ))p")"
    worst="$(echo "$sorted" | tail -1)"
    results+=("$(printf '%-16s median %5d ms   worst %5d ms   (%s)' "$name" "$median" "$worst" "$(echo "${times[@]}" | tr ' ' ',')")")
done

kill -INT "$wrk_pid" 2>/dev/null || true
wait "$wrk_pid" 2>/dev/null || true
wrk_pid=""

echo
echo "From SIGKILL to serving again (GET /hotels answered 200), $KILLS kills each:"
printf '  %s\n' "${results[@]}"
echo
echo "The load meanwhile (wrk -t1 -c4, timeout $((timeout + 2)) s = request timeout + 2 s):"
grep -E "requests in|Non-2xx|Socket errors|Latency" "$work/wrk.log" | sed 's/^/  /'
grep -q "timeout [1-9]" "$work/wrk.log" && echo "  a request hung past its timeout" || echo "  no request hung past its timeout"
left=0
for pid in "${killed_pids[@]}"; do
    n="$(find /dev/shm -maxdepth 1 -name "dpumesh-*-$pid-*" 2>/dev/null | wc -l)"
    left=$((left + n))
done
echo "  regions of killed processes left in /dev/shm: $left"
echo
echo "Deaths dpumesh up saw (each was started again):"
grep "^dpumesh up: .* exited" "$work/up.log" | sed 's/^dpumesh up: //; s/ exited (\(.*\));.*/: \1/' \
    | sort | uniq -c | sed 's/^/  /'
