#!/usr/bin/env bash
# The host library in Python against a production WSGI setup, in one run, with the
# same Flask app (samples/hotel-py/app.py) and its /ping route:
#   (g) gunicorn, 2 sync workers (one per core), behind nginx (keep-alive to clients),
#   (t) gunicorn, 2 gthread workers x 4 threads, behind nginx with upstream keep-alive,
#   (w) waitress, 4 threads, behind nginx with upstream keep-alive,
#   (m) the same app on the mesh (`dpumesh up`, samples/hotel-py): the Python service
#       behind the ingress and the nodes' DPU proxies (JWT, role, rate limit),
#   (u) the same route in FastAPI (samples/hotel-py/ping_asgi.py) under uvicorn, 2
#       workers (uvicorn[standard]: uvloop and httptools), behind nginx with upstream
#       keep-alive,
#   (a) that FastAPI app on the mesh (`python -m dpumesh.server --asgi`: every request
#       a task of one asyncio loop that also drives the service's event loop),
# each under wrk -t1 -c32 -d${DURATION:-10}s. Prints req/s, p50/p99 and the host CPU
# per request: the WSGI server and nginx for g/t/w (both run on the host), the Python
# service process for m (the ingress and the DPU proxies run off the host; their CPU
# is printed beside it). Then the binding's overhead per step against the Rust library
# (host-lib/python/bench/binding.py). Installs wrk, nginx (Debian), gunicorn,
# waitress and uvicorn (PyPI) and the dpumesh package when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
SECRET="$(bench/demo-key.sh)"

for tool in wrk nginx; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] \
        || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null
done
export PATH="$PATH:/usr/sbin"
python3 -c "import gunicorn, waitress" 2>/dev/null \
    || pip3 install --quiet --disable-pip-version-check "gunicorn==23.0.0" "waitress==3.0.2"
python3 -c "import uvicorn, uvloop, httptools" 2>/dev/null \
    || pip3 install --quiet --disable-pip-version-check "uvicorn[standard]>=0.30,<1"

echo "==> building dpumesh, the hotel sample and the Python package (release)"
cargo build --release -q -p dpumesh -p dpumesh-sample-hotel -p dpumesh-test-artifacts
./scripts/install-python.sh >/dev/null

. bench/common.sh
TOKEN="$(python3 bench/token.py "$SECRET")"
app_dir="$PWD/samples/hotel-py"

gunicorn --chdir "$app_dir" -w 2 -b 127.0.0.1:18101 --log-level warning app:app &
pids+=($!)
gunicorn --chdir "$app_dir" -w 2 -k gthread --threads 4 --keep-alive 30 -b 127.0.0.1:18102 \
    --log-level warning app:app &
pids+=($!)
(cd "$app_dir" && exec waitress-serve --threads=4 --listen=127.0.0.1:18103 app:app) >/dev/null 2>&1 &
pids+=($!)
uvicorn --app-dir "$app_dir" --workers 2 --host 127.0.0.1 --port 18104 --log-level warning \
    --no-access-log ping_asgi:app &
pids+=($!)

start_nginx <<NGINX
    keepalive_requests 1000000;
    upstream sync { server 127.0.0.1:18101; }
    upstream gthread { server 127.0.0.1:18102; keepalive 32; }
    upstream waitress { server 127.0.0.1:18103; keepalive 32; }
    upstream uvicorn { server 127.0.0.1:18104; keepalive 32; }
    server { listen 127.0.0.1:18111; location / { proxy_pass http://sync; } }
    server {
        listen 127.0.0.1:18112;
        location / { proxy_pass http://gthread; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
    server {
        listen 127.0.0.1:18113;
        location / { proxy_pass http://waitress; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
    server {
        listen 127.0.0.1:18114;
        location / { proxy_pass http://uvicorn; proxy_http_version 1.1; proxy_set_header Connection ""; }
    }
NGINX

sed -e 's/127.0.0.1:8010/127.0.0.1:18120/' -e 's/127.0.0.1:7111/127.0.0.1:18121/' \
    -e 's/127.0.0.1:7112/127.0.0.1:18122/' -e 's/127.0.0.1:9111/127.0.0.1:18123/' \
    -e 's/127.0.0.1:9112/127.0.0.1:18124/' -e 's/127.0.0.1:9120/127.0.0.1:18125/' \
    -e "s#^policy: ../hotel/policy.yaml#policy: $PWD/samples/hotel/policy.yaml#" \
    -e "s#dpumesh.server, \"app:app\"#dpumesh.server, --app-dir, $app_dir, \"app:app\"#" \
    samples/hotel-py/mesh.yaml > "$work/mesh.yaml"
# The same mesh with the FastAPI app as its frontend, on ports of its own (started
# after the first one's measurement: one mesh runs at a time).
sed -e 's/1812\([0-5]\)/1813\1/g' \
    -e "s#dpumesh.server, --app-dir, $app_dir, \"app:app\"#dpumesh.server, --asgi, --app-dir, $app_dir, ping_asgi:app#" \
    "$work/mesh.yaml" > "$work/mesh-asgi.yaml"
grep -q "ping_asgi:app" "$work/mesh-asgi.yaml" || { echo "the ASGI mesh file was not made"; exit 1; }
up() { # mesh file, log: starts `dpumesh up` and waits until it is ready
    ./target/release/dpumesh up --config "$1" > "$2" 2>&1 &
    up_pid=$!
    for _ in $(seq 1 300); do grep -q "Ctrl-C stops" "$2" && break; sleep 0.2; done
    grep -q "Ctrl-C stops" "$2" || { cat "$2"; echo "the mesh did not start"; exit 1; }
}
down() {
    kill -INT "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
    up_pid=""
}
up "$work/mesh.yaml" "$work/up.log"

tree() { # a pid and its children
    echo "$1"; pgrep -P "$1" || true
}
nginx_pids() { pgrep -x nginx; }
service_pid() { # the Python frontend pod
    for p in $(pgrep -P "$up_pid" -f "dpumesh.server"); do
        tr '\0' '\n' < "/proc/$p/environ" | grep -qx 'DPUMESH_SERVICE=frontend' && echo "$p"
    done
}
mesh_pids() { pgrep -P "$up_pid" -f "dpumesh (node|ingress)"; }
none() { :; }

run() { # name url "server pids" "other host pids"
    local name=$1 url=$2 server=$3 other=$4
    local s1 s2 o1 o2 out rps p50 p99 reqs non2xx
    s1=$(cpu $($server)); o1=$(cpu $($other))
    out=$(wrk -t1 -c32 -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "$url")
    s2=$(cpu $($server)); o2=$(cpu $($other))
    rps=$(awk '/Requests\/sec/ { print $2 }' <<<"$out")
    reqs=$(awk '/requests in/ { print $1 }' <<<"$out")
    p50=$(awk '$1 == "50%" { print $2 }' <<<"$out")
    p99=$(awk '$1 == "99%" { print $2 }' <<<"$out")
    non2xx=$(awk '/Non-2xx/ { print $5 }' <<<"$out")
    echo "$name|$rps|$p50|$p99|$(echo "scale=2; ($s2 - $s1) * 1000000 / $reqs" | bc)|$(echo "scale=2; ($o2 - $o1) * 1000000 / $reqs" | bc)|${non2xx:-0}"
}

echo "==> measuring (wrk -t1 -c32 -d${DURATION}s each)"
for port in 18111 18112 18113 18114 18120; do check "http://127.0.0.1:$port/ping"; done
g=$(run "g gunicorn sync x2 + nginx" http://127.0.0.1:18111/ping "tree ${pids[0]}" nginx_pids)
t=$(run "t gunicorn gthread 2x4 + nginx" http://127.0.0.1:18112/ping "tree ${pids[1]}" nginx_pids)
w=$(run "w waitress 4 threads + nginx" http://127.0.0.1:18113/ping "tree ${pids[2]}" nginx_pids)
m=$(run "m dpumesh, Python service" http://127.0.0.1:18120/ping service_pid mesh_pids)
u=$(run "u uvicorn x2 + nginx (FastAPI)" http://127.0.0.1:18114/ping "tree ${pids[3]}" nginx_pids)
down
up "$work/mesh-asgi.yaml" "$work/up-asgi.log"
check "http://127.0.0.1:18130/ping"
a=$(run "a dpumesh, FastAPI service" http://127.0.0.1:18130/ping service_pid mesh_pids)

printf '\n%-34s %10s %9s %9s %16s %16s\n' target req/s p50 p99 "server us/req" "other us/req"
for row in "$g" "$t" "$w" "$m" "$u" "$a"; do
    IFS='|' read -r name rps p50 p99 s o non <<<"$row"
    [ "$non" != 0 ] && name="$name ($non non-2xx!)"
    printf '%-34s %10s %9s %9s %16s %16s\n' "$name" "$rps" "$p50" "$p99" "$s" "$o"
done
echo "(server: the WSGI or ASGI server's processes, or the Python service pod on the mesh;"
echo " other: nginx for g/t/w/u (on the host), the ingress + nodes for m/a (off the host))"
best=""
for row in "$g" "$t" "$w"; do
    IFS='|' read -r name _ _ _ s o _ <<<"$row"
    host=$(echo "$s + $o" | bc)
    if [ -z "$best" ] || [ "$(echo "$host < $best" | bc)" = 1 ]; then best=$host; bestname=$name; fi
done
IFS='|' read -r _ rm _ _ sm _ _ <<<"$m"
echo
echo "host CPU per request: mesh Python service $sm us vs $bestname $best us (server + nginx): $(echo "scale=2; $sm / $best" | bc)x"
IFS='|' read -r _ ru _ _ su ou _ <<<"$u"
IFS='|' read -r _ ra _ _ sa _ _ <<<"$a"
hu=$(echo "$su + $ou" | bc)
echo "ASGI: mesh FastAPI service $sa us vs uvicorn + nginx $hu us: $(echo "scale=2; $sa / $hu" | bc)x host CPU, $(echo "scale=2; $ra / $ru" | bc)x req/s"

down
echo
echo "==> the binding per step against the Rust library (in-memory transport)"
python3 host-lib/python/bench/binding.py "${BINDING_REQUESTS:-20000}" "${BINDING_ROUNDS:-5}"
