#!/usr/bin/env bash
# Run every cargo-fuzz target (multirail-proto's decoders, multirail's framing layer and one serving
# connection of an in-process agent) for SECONDS each (default 60), starting from
# the committed seed corpus (copied to a temp dir so the run leaves the repo clean).
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly flags; on a stable toolchain
# RUSTC_BOOTSTRAP=1 unlocks them. Exits non-zero on any crash (the artifact path is printed).
set -euo pipefail
secs="${1:-60}"
case "$secs" in ''|*[!0-9]*) echo "usage: $0 [SECONDS]  (a positive integer)" >&2; exit 2;; esac
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz ..."
    cargo install --locked cargo-fuzz
fi
targets=(frame metadata ucx_am inbound serve)
# Per target libFuzzer flags. serve: the agent's serving threads allocate while an input runs, so
# libFuzzer's per-input leak check would run LeakSanitizer's full scan on most inputs (half the
# CPU); leaks across inputs are bounded by its own checks (no serving thread left behind) and -rss_limit_mb.
declare -A extra=([serve]="-detect_leaks=0")
cargo fuzz build -O
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
for t in "${targets[@]}"; do
    mkdir -p "$work/$t"
    cp corpus/"$t"/* "$work/$t/"
    log="$work/$t.log"
    echo "== fuzzing $t for ${secs}s"
    # libFuzzer's own timer; the outer timeout is a backstop against a hung target.
    if timeout $((secs + 120)) cargo fuzz run -O "$t" "$work/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 ${extra[$t]:-} >"$log" 2>&1; then
        runs="$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')"
        echo "   $t: ok, ${runs:-?} executions, corpus $(ls "$work/$t" | wc -l) inputs"
    else
        status=1
        echo "   $t: FAILED" >&2
        # A target's own assertion first (serve prints the script it sent), then libFuzzer's end.
        sed -n '/panicked at/,/stack backtrace/p' "$log" | head -n 80 >&2
        tail -n 40 "$log" >&2
    fi
done
exit "$status"
