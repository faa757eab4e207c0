#!/usr/bin/env bash
# A streamed 1 GiB download and upload through the mesh against nginx proxying the
# same sizes, in one run:
#   (l) nginx (origin) serving a 1 GiB file from /dev/shm, and a second nginx
#       proxying to it (proxy_buffering on, as shipped): the download through the
#       proxy,
#   (m) the mesh (`dpumesh up`, hotel sample, the bench's token through the chain):
#       the frontend pod streams 1 GiB (`/download?bytes=1073741824`, parts sliced from
#       one buffer: no bytes made per request) through the DPU proxy and the ingress,
#   (n) a 1 GiB upload (curl -T from /dev/shm) through the nginx proxy to the origin,
#       which reads and drops it (`return 200`; the proxy buffers requests as
#       shipped, `proxy_request_buffering on`, to a temporary file),
#   (o) the same upload through the mesh to the frontend's `/upload?crc=0` (the body
#       read as it arrives and dropped).
# curl reads each download to /dev/null and sends each upload from the file, ${RUNS:-3}
# times. Prints MB/s, CPU per MB of the host's side (the nginx proxy for l and n; the
# service pod for m and o: what the host pays with the proxy on the DPU) and of the
# mesh's ingress and nodes, and each mesh process's resident memory before and its
# peak (VmHWM) after the downloads and uploads.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${RUNS:-3}"
SIZE=$((1 << 30))
SECRET="$(bench/demo-key.sh)"
export PATH="$PATH:/usr/sbin"
command -v nginx >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null

echo "==> building dpumesh and the hotel sample (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts

. bench/common.sh
TOKEN="$(python3 bench/token.py "$SECRET")"
. bench/mesh-lib.sh

file="/dev/shm/dpumesh-bench-1g.$$"
head -c "$SIZE" /dev/zero > "$file"
trap 'rm -f "$file"; cleanup' EXIT

# The proxy's request buffers spill to a temporary file (as shipped), written by its
# worker (not root): a directory it may write.
mkdir -p "$work/nginx-body"
chmod 755 "$work"
chmod 777 "$work/nginx-body"
for role in origin proxy; do
    if [ "$role" = origin ]; then
        server="listen 127.0.0.1:18180; client_max_body_size 0; location /big { alias $file; } location /up { return 200 \"ok\\n\"; }"
    else
        server="listen 127.0.0.1:18181; client_max_body_size 0; client_body_temp_path $work/nginx-body; location / { proxy_pass http://127.0.0.1:18180; proxy_http_version 1.1; proxy_set_header Connection \"\"; }"
    fi
    cat > "$work/nginx-$role.conf" <<NGINX
worker_processes 1;
pid $work/nginx-$role.pid;
error_log $work/nginx-$role-error.log;
events { worker_connections 64; }
http { access_log off; sendfile on; server { $server } }
NGINX
    nginx -c "$work/nginx-$role.conf"
done
nginx_pids() { # master and workers of one nginx
    local master
    master=$(cat "$work/nginx-$1.pid")
    echo "$master"
    pgrep -P "$master"
}
proxy_pids() { nginx_pids proxy; }
stop_nginx() {
    for role in origin proxy; do nginx -c "$work/nginx-$role.conf" -s stop 2>/dev/null || true; done
}
trap 'rm -f "$file"; stop_nginx; cleanup' EXIT

# Prints name|MB/s|CPU ms per MB (who)|CPU ms per MB (also): RUNS downloads of url.
download() { # name url who [also]
    local name=$1 url=$2 who=$3 also=${4:-none} before before2 after after2 t0 t1 bytes
    curl -s -o /dev/null -H "authorization: Bearer $TOKEN" "$url" # warm
    before=$(cpu $($who)); before2=$(cpu $($also)); t0=$(date +%s.%N)
    for _ in $(seq 1 "$RUNS"); do
        bytes=$(curl -s -o /dev/null -w '%{size_download}' -H "authorization: Bearer $TOKEN" "$url")
        [ "$bytes" = "$SIZE" ] || { echo "$name: $bytes bytes, not $SIZE" >&2; exit 1; }
    done
    t1=$(date +%s.%N); after=$(cpu $($who)); after2=$(cpu $($also))
    local mb=$((RUNS * SIZE / 1000000))
    echo "$name|$(echo "scale=0; $mb / ($t1 - $t0)" | bc)|$(echo "scale=4; ($after - $before) * 1000 / $mb" | bc)|$(echo "scale=4; ($after2 - $before2) * 1000 / $mb" | bc)"
}

# Prints name|MB/s|CPU ms per MB (who)|CPU ms per MB (also): RUNS uploads to url.
upload() { # name url who [also]
    local name=$1 url=$2 who=$3 also=${4:-none} before before2 after after2 t0 t1 bytes
    curl -s -o /dev/null -H "authorization: Bearer $TOKEN" -T "$file" "$url" # warm
    before=$(cpu $($who)); before2=$(cpu $($also)); t0=$(date +%s.%N)
    for _ in $(seq 1 "$RUNS"); do
        bytes=$(curl -s -o /dev/null -w '%{size_upload} %{http_code}' -H "authorization: Bearer $TOKEN" -T "$file" "$url")
        [ "$bytes" = "$SIZE 200" ] || { echo "$name: $bytes (bytes sent, status), not $SIZE 200" >&2; exit 1; }
    done
    t1=$(date +%s.%N); after=$(cpu $($who)); after2=$(cpu $($also))
    local mb=$((RUNS * SIZE / 1000000))
    echo "$name|$(echo "scale=0; $mb / ($t1 - $t0)" | bc)|$(echo "scale=4; ($after - $before) * 1000 / $mb" | bc)|$(echo "scale=4; ($after2 - $before2) * 1000 / $mb" | bc)"
}

rss_kb() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status"; }
hwm_kb() { awk '/^VmHWM/ { print $2 }' "/proc/$1/status"; }

echo "==> (l) nginx proxy"
check "http://127.0.0.1:18181/big"
rl=$(download "l nginx proxy" "http://127.0.0.1:18181/big" proxy_pids)
echo "==> (n) nginx proxy, upload"
rn=$(upload "n nginx proxy upload" "http://127.0.0.1:18181/up" proxy_pids)

echo "==> (m) the mesh"
start_mesh shm
check "http://127.0.0.1:18090/download?bytes=10"
declare -A before_rss
for p in $(all_mesh_pids); do before_rss[$p]=$(rss_kb "$p"); done
rm_=$(download "m dpumesh" "http://127.0.0.1:18090/download?bytes=$SIZE" service_pids mesh_pids)
echo "==> (o) the mesh, upload"
ro=$(upload "o dpumesh upload" "http://127.0.0.1:18090/upload?crc=0" service_pids mesh_pids)
memory=""
worst=0
for p in $(all_mesh_pids); do
    [ -n "${before_rss[$p]:-}" ] || continue
    what=$(tr '\0' ' ' < "/proc/$p/cmdline" | awk '{ print $2, $3 }')
    hwm=$(hwm_kb "$p")
    growth=$(( (hwm - before_rss[$p]) / 1024 ))
    [ "$growth" -gt "$worst" ] && worst=$growth
    memory="$memory\n  $what: RSS $((before_rss[$p] / 1024)) MiB before, peak $((hwm / 1024)) MiB (+$growth MiB)"
done
stop_mesh

echo
echo "name|MB/s|host CPU ms/MB|mesh (ingress + nodes) CPU ms/MB"
echo "$rl"
echo "$rm_"
echo "$rn"
echo "$ro"
IFS='|' read -r _ ml cl _ <<<"$rl"
IFS='|' read -r _ mm cm im <<<"$rm_"
IFS='|' read -r _ mn cn _ <<<"$rn"
IFS='|' read -r _ mo co io <<<"$ro"
echo
echo "1 GiB download m/l MB/s: $(echo "scale=2; $mm / $ml" | bc)"
echo "host CPU per MB m/l (service pod vs nginx proxy): $(echo "scale=2; $cm / $cl" | bc) ($cm vs $cl ms/MB); ingress + nodes $im ms/MB"
echo "1 GiB upload o/n MB/s: $(echo "scale=2; $mo / $mn" | bc)"
echo "host CPU per MB o/n (service pod vs nginx proxy): $(echo "scale=2; $co / $cn" | bc) ($co vs $cn ms/MB); ingress + nodes $io ms/MB"
echo -e "memory of the mesh's processes over $RUNS downloads and $RUNS uploads:$memory"
echo "largest growth: $worst MiB (goal: at most 64)"
