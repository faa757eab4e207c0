# What the bench scripts share (sourced, not run): a scratch folder and the processes
# a run started (`pids`, the `dpumesh up` in `up_pid`), cleaned up on exit; a 200
# check with the token; a process's CPU time.
# Needs: TOKEN set before `check` runs.

work="$(mktemp -d)"
pids=()
up_pid=""
cleanup() {
    [ -n "$up_pid" ] && kill -INT "$up_pid" 2>/dev/null || true
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    nginx -c "$work/nginx.conf" -s stop 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

check() { # url: 200 with the token (peers may still be starting: up to 10 s)
    local code=000
    for _ in $(seq 1 50); do
        code=$(curl -s -o /dev/null -w '%{http_code}' -H "authorization: Bearer $TOKEN" "$1" || true)
        [ "$code" = 200 ] && return 0
        sleep 0.2
    done
    echo "$1 answered $code"; exit 1
}

cpu() { # utime+stime in seconds of the given pids
    local t=0
    for p in "$@"; do
        [ -r "/proc/$p/stat" ] || continue
        t=$(awk -v t="$t" '{ print t + $14 + $15 }' "/proc/$p/stat")
    done
    echo "scale=4; $t / $(getconf CLK_TCK)" | bc
}

# Starts nginx (one worker, its pid and error log in the scratch folder, no access
# log) with what stdin holds inside its `http` block; cleanup stops it.
start_nginx() {
    {
        printf 'worker_processes 1;\npid %s/nginx.pid;\nerror_log %s/nginx-error.log;\n' "$work" "$work"
        printf 'events { worker_connections 1024; }\nhttp {\n    access_log off;\n'
        cat
        printf '}\n'
    } > "$work/nginx.conf"
    nginx -c "$work/nginx.conf"
}
