#!/usr/bin/env bash
# Builds the Debian packages with cargo-deb: target/debian/bulkhead_VERSION-1_ARCH.deb (the
# binary, the systemd unit and tmpfiles entry, an example config in /etc/bulkhead, manual
# pages and shell completions generated from the command-line definitions, fio's engine
# (libbulkhead_fio.so, built against the installed fio), and the docs) and
# bulkhead-bench_VERSION-1_ARCH.deb (the benchmarks, a program of their own, and their pages,
# with the scripts and the static guest program they run).
# Usage: scripts/package.sh [--profile dev [--prebuilt]] [cargo-deb options, e.g. -o DIR]
#   --profile dev: package the debug build; --prebuilt: as it is, without building (the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
build=1
if [ "${1:-}" = "--profile" ]; then profile="${2:?--profile needs a name}"; shift 2; fi
if [ "${1:-}" = "--prebuilt" ]; then build=0; shift; fi
command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked --version 3.8.0
dir=$([ "$profile" = dev ] && echo debug || echo "$profile")
[ "$build" = 1 ] && cargo build --locked -p bulkhead -p bulkhead-bench --profile "$profile"
assets=target/package-assets
rm -rf "$assets"
mkdir -p "$assets/completions"
"target/$dir/bulkhead" man --out "$assets/man"
"target/$dir/bulkhead-bench" man --out "$assets/bench-man"
gzip -9n "$assets"/man/*.1 "$assets"/bench-man/*.1
"target/$dir/bulkhead" completions bash >"$assets/completions/bulkhead"
"target/$dir/bulkhead" completions zsh >"$assets/completions/_bulkhead"
"target/$dir/bulkhead" completions fish >"$assets/completions/bulkhead.fish"
# fio's engine for bulkhead's block layer, with libbulkhead linked in (its symbols stripped,
# its engine table kept: fio finds it by name).
"$(dirname "$0")/fio-engine.sh" --profile "$profile" "$assets/libbulkhead_fio.so"
strip --strip-unneeded "$assets/libbulkhead_fio.so"
# The benchmarks' guests run guest-io, built static (as crates/guest builds it from source).
RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols" cargo build --release --locked -q -p bulkhead-guest-io \
  --target x86_64-unknown-linux-gnu --target-dir target/guest
cp target/guest/x86_64-unknown-linux-gnu/release/guest-io "$assets/guest-io"
# The symbols go in a package of their own (bulkhead-dbgsym), not in the binary installed.
cargo deb -p bulkhead --no-build --locked --profile "$profile" --strip "$@"
cargo deb -p bulkhead-bench --no-build --locked --profile "$profile" --strip "$@"
