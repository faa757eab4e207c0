#!/usr/bin/env bash
# Runs every check and test: formatting, clippy (warnings are errors), and the whole
# workspace's tests (guest components are built for wasm32-wasip2 by the test build).
#
#   ./scripts/test.sh                 the suite, as CI runs it (.ci/run)
#   ./scripts/test.sh --under-load    the suite's tests three times in a row with two
#                                     CPU-burning processes beside them (--runs N for
#                                     another count); each run's pass and fail counts
#                                     are printed at the end and kept in
#                                     target/under-load/run-N.log
#
# In the plain run, the aarch64 build runs in the background beside the x86 tests
# (see start_arm64_build; docs/testing.md, "Where CI's time goes").
#
# Under load, the lints (fmt, clippy) are left out: they measure nothing in time. Every
# test step runs: the end-to-end tests (real processes, kills, restarts, network
# namespaces, the browser), the timing-adjacent ones (deadlines, timeouts, Pingmesh's
# RTTs) and the rest, which must not care. This 2-core machine then has the tests and
# two busy loops (nice 0, as the tests) competing for two cores: what a busy CI host
# or a developer's build beside the suite does.
set -euo pipefail
cd "$(dirname "$0")/.."
# One clean build: incremental state would only double the target directory's size.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

under_load=0
runs=3
while [ $# -gt 0 ]; do
    case "$1" in
        --under-load) under_load=1 ;;
        --runs)
            runs="${2:?--runs needs a count}"
            shift
            ;;
        *)
            echo "usage: $0 [--under-load [--runs N]]" >&2
            exit 2
            ;;
    esac
    shift
done

# One lint, its time printed (where the suite's time goes).
lint() {
    local what=$1 started
    shift
    echo "==> $what"
    started=$(date +%s)
    "$@"
    echo "--- took $(($(date +%s) - started)) s: $what"
}

lints() {
    lint "cargo fmt --check" cargo fmt --all --check
    lint "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
    lint "cargo clippy (guest crates for wasm32-wasip2)" cargo clippy --locked --target wasm32-wasip2 -p dpumesh-filter-sdk -p dpumesh-guest-alloc -p dpumesh-sample-guard -p dpumesh-sample-apikey -p dpumesh-test-filter -p dpumesh-filter-trace -p dpumesh-filter-ratelimit -p dpumesh-filter-circuit-breaker -p dpumesh-filter-rbac -p dpumesh-filter-jwt -- -D warnings
    lint "cargo clippy (the proxy-wasm test plugin for wasm32-wasip1)" cargo clippy --locked --target wasm32-wasip1 -p dpumesh-proxy-wasm-test -- -D warnings
    # A pass per backend: one pass over the workspace with every feature took as long
    # (231 s against 219 s for these three, 2026-12-02), since it checks again every
    # crate the features reach, with its tests.
    lint "cargo clippy (data path with the DOCA backends: type-checked, linked only on BlueField)" cargo clippy --locked -p dpumesh-dpa -p dpumesh-rings -p dpumesh-control --features dpumesh-dpa/doca --all-targets -- -D warnings
    lint "cargo clippy (dpumesh node --data-path doca, dpumesh host on Comch: the commands, x86_64)" cargo clippy --locked -p dpumesh-proxy -p dpumesh --features dpumesh/doca -- -D warnings
    lint "cargo clippy (the same for aarch64, the BlueField's Arm cores)" cargo clippy --locked --target aarch64-unknown-linux-gnu -p dpumesh-dpa -p dpumesh-rings -p dpumesh-control --features dpumesh-dpa/doca --all-targets -- -D warnings
    lint "cargo clippy (dpumesh node --data-path doca, dpumesh host on Comch: the commands, aarch64)" cargo clippy --locked --target aarch64-unknown-linux-gnu -p dpumesh-proxy -p dpumesh --features dpumesh/doca -- -D warnings
    lint "cargo clippy (data path with the verbs backend)" cargo clippy --locked -p dpumesh-dpa -p dpumesh-fabric --features dpumesh-dpa/verbs --all-targets -- -D warnings
}

# What the tests need besides the toolchain.
prepare() {
    echo "==> the Python host library (pip install ./host-lib/python)"
    ./scripts/install-python.sh
    ./scripts/install-deploy-tools.sh >/dev/null
}

# Runs one step of the tests. A failed step ends the suite, or, under load (where one
# run must count every failure), is counted and the next step runs.
keep_going=0
failed_steps=0
step() {
    local what=$1 started
    shift
    echo "==> $what"
    started=$(date +%s)
    if ! "$@"; then
        echo "FAILED step: $what"
        [ "$keep_going" = 1 ] || exit 1
        failed_steps=$((failed_steps + 1))
    fi
    # Where the suite's time goes (CI must stay under 45 minutes).
    echo "--- took $(($(date +%s) - started)) s: $what"
}

# The aarch64 build (test-arm64.sh --no-run), started in the background once the x86
# tests are running: it is about eight minutes of CPU-bound compiling, and the x86 run
# is about five minutes of mostly waiting processes (meshes starting, probes, clients),
# so overlapping them shortens CI by minutes. The tests are made to pass on a busy
# machine (`--under-load` runs them beside two CPU burners), and a compile at -j2 is
# that load. Cargo holds its build lock while it compiles, not while test binaries run,
# so the background build waits for the x86 `cargo test` to start its first binary
# (or 120 s); the later cargo steps wait for the lock while it builds.
arm64_build_pid=""
arm64_build_log=target/arm64-build.log
start_arm64_build() { # the x86 run's log
    local x86_log=$1
    # A log left by an earlier run must not start the build before cargo test locks.
    : >"$x86_log"
    (
        for _ in $(seq 1 120); do
            grep -q '^ *Running ' "$x86_log" 2>/dev/null && break
            sleep 1
        done
        exec ./scripts/test-arm64.sh --no-run
    ) >"$arm64_build_log" 2>&1 &
    arm64_build_pid=$!
}

# Waits for the background aarch64 build and shows its output.
finish_arm64_build() {
    local rc=0
    echo "==> the aarch64 build, started beside the x86 tests (log: $arm64_build_log)"
    wait "$arm64_build_pid" || rc=$?
    arm64_build_pid=""
    grep -vE '^ *(Compiling|Checking|Building|Downloaded|Downloading) ' "$arm64_build_log" || true
    return "$rc"
}

# `cargo test` with its output kept in a log too (the background build watches it).
x86_tests() { # log args...
    local log=$1
    shift
    cargo test --workspace --locked "$@" 2>&1 | tee "$log"
}

tests() {
    local more=()
    [ "$keep_going" = 1 ] && more=(--no-fail-fast)
    if [ "$under_load" = 0 ]; then
        step "cargo test (build)" cargo test --workspace --locked --no-run
        runtime_all=$(runtime_all_binary)
        start_arm64_build target/x86-tests.log
        step "cargo test" x86_tests target/x86-tests.log
    else
        step "cargo test" cargo test --workspace --locked "${more[@]}"
        runtime_all=$(runtime_all_binary)
    fi
    # None of the next four runs cargo: they run while the aarch64 build holds its lock
    # (before, the fused tests and the sweep waited for it: about three minutes of CI).
    step "pytest (the Python host library: the seed's examples, errors, WSGI, ASGI)" \
        python3 -m pytest -q host-lib/python/tests
    step "deploy/ (Helm chart rendered by Helm, DPF manifests against the DPF CRDs, kustomize, Kubernetes schemas)" \
        python3 -m pytest -q deploy/tests
    # The binary cargo test built and ran above, run again as cargo would run it (from
    # its package's directory): only the runtime has a test target `all`.
    step "the runtime's chain and fault tests again, every test chain fused into one component" \
        env -C runtime DPUMESH_TEST_FUSED=1 "$runtime_all" chain:: faults:: claims::
    # A benchmark, not a test: this runs it so it cannot rot (its build is the debug
    # one cargo test just made, SCALE_BUILT=1: no cargo). Its figures are not judged.
    step "bench/scale.sh --quick (the scaling sweep runs: two short steps a dimension)" \
        env SCALE_BUILT=1 ./bench/scale.sh --quick
    [ -z "$arm64_build_pid" ] || step "the DPU side for Arm64: the aarch64 cross-build" finish_arm64_build
    step "cargo test (verbs backend: with no RDMA device it says so)" \
        cargo test --locked "${more[@]}" -p dpumesh-fabric --features verbs --lib verbs
    step "the DPU side for Arm64 (aarch64 cross-build, tests under qemu)" \
        ./scripts/test-arm64.sh "${more[@]}"
}

# The runtime's `all` test binary as the workspace's test build made it (asking cargo
# again is a no-op build, and gives the path with its hash). --workspace, not
# -p dpumesh-runtime: the workspace's feature resolution, so that build is the one
# reused (-p alone resolved features anew and rebuilt wasmtime, ~6 minutes of CI).
runtime_all_binary() {
    cargo test --workspace --locked --no-run --message-format=json -q 2>/dev/null | python3 -c '
import json, sys
found = None
# Every line is read (no early exit): cargo, writing into a closed pipe, would fail
# the pipeline.
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and t.get("name") == "all" \
            and "dpumesh-runtime" in m.get("package_id", "") and m.get("executable"):
        found = m["executable"]
if not found:
    sys.exit("the runtime'"'"'s test binary `all` is not in the test build")
print(found)
'
}

# A failed step ends the suite: the background build goes with it.
stop_arm64_build() {
    if [ -n "$arm64_build_pid" ]; then
        pkill -TERM -P "$arm64_build_pid" 2>/dev/null || true
        kill "$arm64_build_pid" 2>/dev/null || true
    fi
}

./scripts/install-toolchain.sh

if [ "$under_load" = 0 ]; then
    trap stop_arm64_build EXIT
    lints
    prepare
    tests
    exit 0
fi

# --under-load: build first (without load: the build is not under test), then run.
prepare
echo "==> building every test once, before the load starts"
cargo test --workspace --locked --no-run
cargo test --locked -p dpumesh-fabric --features verbs --lib --no-run
./scripts/test-arm64.sh --no-run

burners=()
stop_burners() {
    if [ ${#burners[@]} -gt 0 ]; then
        kill "${burners[@]}" 2>/dev/null || true
    fi
    burners=()
}
trap stop_burners EXIT

logs=target/under-load
mkdir -p "$logs"
summary=()
failed_runs=0
for run in $(seq 1 "$runs"); do
    for _ in 1 2; do
        nice -n 0 sh -c 'while :; do :; done' &
        burners+=($!)
    done
    log="$logs/run-$run.log"
    echo "==> run $run of $runs under load (two CPU burners: pids ${burners[*]}), log in $log"
    started=$(date +%s)
    keep_going=1
    failed_steps=0
    tests >"$log" 2>&1
    took=$(($(date +%s) - started))
    stop_burners
    # cargo: "test result: ok. 12 passed; 0 failed; ..."; pytest: "3 passed, 1 failed in 2s".
    counts=$(awk '
        /^test result:/ { p += $4; f += $6 }
        !/^test result:/ && /(passed|failed).* in [0-9.]+s/ {
            for (i = 1; i < NF; i++) {
                if ($(i + 1) ~ /^passed/) p += $i
                if ($(i + 1) ~ /^failed/) f += $i
            }
        }
        END { printf "%d passed, %d failed", p, f }' "$log")
    line="run $run: $counts in ${took}s ($failed_steps failed steps)"
    if [ "$failed_steps" != 0 ]; then
        failed_runs=$((failed_runs + 1))
        line="$line; failures:"$'\n'"$(grep -E '^test .* FAILED$|^FAILED|^---- ' "$log" | sort -u | sed 's/^/    /')"
    fi
    echo "$line"
    summary+=("$line")
done
echo "==> under load, $runs runs:"
printf '%s\n' "${summary[@]}"
[ "$failed_runs" = 0 ]
