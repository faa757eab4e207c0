#!/usr/bin/env bash
# The DPU's HTTP response cache against the same request served by the host service
# through the mesh, in one run (`dpumesh up`, hotel sample, shared-memory fabric, the
# frontend's chain jwt → rbac → ratelimit → breaker in front of both):
#   (h) GET /catalog?mode=fresh: cacheable, answered by the node from its BlueCache
#       store after the chain (after one warm-up miss),
#   (s) GET /catalog?mode=nostore: the same page with `no-store`, so every request
#       reaches the service,
# each under wrk -t1 -c32 -d${DURATION:-10}s. Prints req/s, p50/p99, the service
# process's CPU per request (what the host pays: ~0 on hits) and the ingress + nodes'
# (what the ingress node and the DPUs carry), context switches per request, and the
# ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
SECRET="$(bench/demo-key.sh)"
command -v wrk >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts

. bench/common.sh
. bench/mesh-lib.sh
TOKEN="$(python3 bench/token.py "$SECRET")"

start_mesh shm
check "http://127.0.0.1:18090/catalog?mode=nostore"
check_policy "http://127.0.0.1:18090/catalog?mode=fresh"
# Warm the cache: the first answer is stored as it goes back.
for _ in 1 2 3; do check "http://127.0.0.1:18090/catalog?mode=fresh"; sleep 0.2; done
curl -s -D - -o /dev/null -H "authorization: Bearer $TOKEN" "http://127.0.0.1:18090/catalog?mode=fresh" | grep -qi '^x-cache: HIT' \
    || { echo "the warm-up did not fill the cache"; exit 1; }

echo "==> measuring (wrk -t1 -c32 -d${DURATION}s each)"
h=$(run "h cache hit, answered on the node" "http://127.0.0.1:18090/catalog?mode=fresh" service_pids mesh_pids all_mesh_pids)
s=$(run "s no-store, served by the host" "http://127.0.0.1:18090/catalog?mode=nostore" service_pids mesh_pids all_mesh_pids)
hits=$(curl -s http://127.0.0.1:18093/cache)
stop_mesh

printf '\n%-42s %10s %9s %9s %14s %14s %10s\n' target req/s p50 p99 "host us/req" "mesh us/req" "cs/req"
for row in "$h" "$s"; do
    IFS='|' read -r name rps p50 p99 cpu non mesh sw _ <<<"$row"
    [ "$non" != 0 ] && name="$name ($non non-2xx!)"
    printf '%-42s %10s %9s %9s %14s %14s %10s\n' "$name" "$rps" "$p50" "$p99" "$cpu" "$mesh" "$sw"
done
echo "(host us/req: the frontend service process; mesh us/req: the ingress and node processes)"
IFS='|' read -r _ rh _ _ ch _ mh _ _ <<<"$h"
IFS='|' read -r _ rs _ _ cs _ ms _ _ <<<"$s"
echo
echo "hit/no-store req/s: $(echo "scale=2; $rh / $rs" | bc)   host CPU per request: hit $ch us vs $cs us"
echo "ingress + node CPU per request: hit $mh us vs $ms us"
echo "node1's cache: $hits"
