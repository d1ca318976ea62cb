#!/usr/bin/env bash
# Installs what bulkhead needs, builds it and runs `bulkhead serve` (embedded default: a 1 GiB
# ram device disk0, adaptive notification, exported at ./bulkhead-run/fuse/disk0).
# Extra arguments go to `bulkhead serve` (for example --config FILE --run-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh serve
cargo build --release --locked -q
exec target/release/bulkhead serve "$@"
