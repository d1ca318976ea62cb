#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite: unit tests, the loom model, the
# two-process channel test and the kernel tests (FUSE, loop devices, ext4, fio), which must run
# here (BULKHEAD_REQUIRE_KERNEL=1 turns a missing kernel feature into a failure, not a skip).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
export BULKHEAD_REQUIRE_KERNEL="${BULKHEAD_REQUIRE_KERNEL:-1}"
cargo test --workspace --locked "$@"
