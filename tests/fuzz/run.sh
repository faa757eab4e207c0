#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer's coverage instrumentation (what `cargo fuzz`
# does, without needing cargo-fuzz) and runs each named target for a number of
# executions, printing the count libFuzzer reports. Needs a nightly toolchain
# (`rustup toolchain install nightly`).
#
#   tests/fuzz/run.sh                      # every target, 10 million executions each
#   tests/fuzz/run.sh path framing         # those targets
#   RUNS=1000000 tests/fuzz/run.sh frame   # fewer executions
set -euo pipefail
cd "$(dirname "$0")"
RUNS=${RUNS:-10000000}
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo +nightly build --release --bins --target-dir target-cov --target "$triple"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(sed -n 's/^name = "\(.*\)"/\1/p' Cargo.toml | grep -v '^dpumesh-fuzz$')
fi
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    start=$(date +%s)
    out=$("target-cov/$triple/release/$t" "corpus/$t" -runs="$RUNS" \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 2>&1) || {
        echo "$out" | tail -30
        echo "$t: CRASH (input in tests/fuzz/artifacts/$t)"
        exit 1
    }
    runs=$(echo "$out" | sed -n 's/^stat::number_of_executed_units: *//p')
    echo "$t: $runs executions, no crash, $(( $(date +%s) - start )) s"
done
