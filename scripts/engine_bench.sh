#!/usr/bin/env bash
# The `file` backend's engines side by side: 4 KiB random reads and writes at queue depth 1 and
# 16 through the NBD export (fio's nbd engine, libnbd) on a 1 GiB file filled with random
# data, served with `direct = true`. The file is made in DIR: a disk's directory, or /dev/shm
# to see the engines on a file in memory.
#
#   scripts/engine_bench.sh [SECONDS_PER_JOB] [ENGINES] [DIR]   (defaults: 5, "sync io_uring", /var/tmp)
#
# Prints one line per job: engine, job, IOPS, p50 and p99 completion latency.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}"
engines="${2:-sync io_uring}"
dir="${3:-/var/tmp}"
scripts/deps.sh bench >/dev/null
cargo build --release --locked -q -p bulkhead
bin="$PWD/target/release/bulkhead"
work=$(mktemp -d "$dir/bulkhead-engine-bench.XXXXXX")
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
dd if=/dev/urandom of="$work/disk.img" bs=1M count=1024 status=none
for engine in $engines; do
  printf '[fuse]\nenabled = false\n[[device]]\nname = "d"\nqueues = 2\n[device.backend]\ntype = "file"\npath = "%s"\ndirect = true\nengine = "%s"\n' \
    "$work/disk.img" "$engine" >"$work/c.toml"
  "$bin" serve --config "$work/c.toml" --run-dir "$work/run" 2>"$work/serve.log" &
  pid=$!
  for _ in $(seq 100); do [ -S "$work/run/nbd.sock" ] && break; sleep 0.1; done
  uri="nbd+unix:///d?socket=$work/run/nbd.sock"
  for job in "randread 1" "randread 16" "randwrite 1" "randwrite 16"; do
    set -- $job
    read -r iops p50 p99 _ <<<"$(scripts/fio_job.sh "$uri" "$1" 4k "$2" 1G "$secs")"
    printf '%-8s %-9s QD%-2s %7s IOPS  p50 %6s us  p99 %7s us\n' "$engine" "$1" "$2" "$iops" "$p50" "$p99"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
done
