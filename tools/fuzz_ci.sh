#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ briefly from its seed corpus (docs/RELIABILITY.md "Fuzzing").
#
#   tools/fuzz_ci.sh            # every target, FUZZ_SECONDS (default 4) each: about a minute in all
#   FUZZ_SECONDS=600 FUZZ_WORK=fuzz/work tools/fuzz_ci.sh safetensors image   # longer runs, corpora kept
#
# Uses cargo-fuzz (libFuzzer) on the stable toolchain without a sanitizer (`-s none`): Rust code is
# memory-safe, so what the fuzzer looks for is panics, aborts, hangs and runaway memory, which libFuzzer
# catches without ASan. The seed corpus is copied to a scratch directory, so the repository's corpus only
# changes when someone commits new seeds. A crash leaves its input under fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-4}
if ! command -v cargo-fuzz >/dev/null; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
cargo fuzz build -s none -O
bin=fuzz/target/x86_64-unknown-linux-gnu/release
# FUZZ_WORK keeps the grown corpora (e.g. fuzz/work, git-ignored) for the next run; default: scratch.
if [ -n "${FUZZ_WORK:-}" ]; then
    work=$FUZZ_WORK
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
fi
for t in "${targets[@]}"; do
    mkdir -p "$work/$t"
    cp -r "fuzz/corpus/$t/." "$work/$t/"
    [ -d "fuzz/regressions/$t" ] && cp -r "fuzz/regressions/$t/." "$work/$t/"
    echo "== fuzz $t (${secs}s)"
    rc=0
    mkdir -p "fuzz/artifacts/$t"
    # The binary cargo fuzz built, run directly (`cargo fuzz run` would first check for a rebuild).
    "$bin/$t" -artifact_prefix="fuzz/artifacts/$t/" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 "$work/$t" >"$work/$t.log" 2>&1 || rc=$?
    grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb)|ERROR|panicked|SUMMARY" "$work/$t.log" || true
    if [ "$rc" -ne 0 ]; then
        tail -40 "$work/$t.log"
        echo "fuzz target $t failed (rc $rc); its input is under fuzz/artifacts/$t/"
        exit 1
    fi
done
