#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite: unit tests, the loom model, the
# two-process channel test and the kernel tests (FUSE, loop devices, ext4, fio, namespaces,
# sandbox, restarts), which must run here (BULKHEAD_REQUIRE_KERNEL=1 turns a missing kernel
# feature into a failure, not a skip). Then the shared-memory crates' tests again under
# AddressSanitizer, and every fuzz target for 20 s (nightly toolchain). Ends with one line:
# "N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
export BULKHEAD_REQUIRE_KERNEL="${BULKHEAD_REQUIRE_KERNEL:-1}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# A hang must fail the run with its output, not run into CI's own time limit.
timeout --kill-after=60 "${BULKHEAD_TEST_TIMEOUT:-3000}" cargo test --workspace --locked --features bulkhead/test-driver "$@" 2>&1 | tee -a "$log"

if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "== shared-memory crates under AddressSanitizer =="
  RUSTFLAGS="-Zsanitizer=address" ASAN_OPTIONS="detect_leaks=1" \
    cargo +nightly test --locked -q -p bulkhead-shmem -p bulkhead-ring -p bulkhead-channel -p bulkhead-doorbell \
      --lib --tests --target "$(rustc -vV | sed -n 's/^host: //p')" --target-dir target/asan -- --skip loom 2>&1 | tee -a "$log"
  # Every fuzz target for a few seconds: one that no longer builds, or crashes at once, fails.
  echo "== fuzz targets, ${BULKHEAD_FUZZ_SECONDS:-20} s each =="
  scripts/fuzz.sh "${BULKHEAD_FUZZ_SECONDS:-20}"
else
  echo "SKIP: AddressSanitizer pass and fuzz targets need the nightly toolchain (rustup toolchain install nightly)"
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
