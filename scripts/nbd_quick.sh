#!/usr/bin/env bash
# bulkhead's NBD export alone, three fio jobs: 4 KiB random read QD1, random write QD1, random
# read QD16, each printed as "IOPS P50_US P99_US MIB_S". For quick before/after comparisons
# of the export and the notification modes; `bulkhead-bench nbd` has the peers.
#
#   scripts/nbd_quick.sh [SECONDS] [NOTIFY] [SPIN_BUDGET_US] [ram|file]
#                         (defaults: 4, adaptive, "auto", ram)
#
# BULKHEAD_BIN=PATH serves with that binary instead of building this tree (alternate two
# copies for an A/B comparison); JOBS=large runs 1 MiB sequential read and write at QD4
# instead, after filling the first 512 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-4}" notify="${2:-adaptive}" budget="${3:-\"auto\"}" backing="${4:-ram}"
scripts/deps.sh bench >/dev/null
bin="${BULKHEAD_BIN:-}"
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p bulkhead
  bin=target/release/bulkhead
fi
work=$(mktemp -d /var/tmp/bulkhead-nbd-quick.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
if [ "$backing" = file ]; then
  truncate -s 1G "$work/disk.img"
  b="type = \"file\"
path = \"$work/disk.img\""
else
  b='type = "ram"'
fi
printf '[fuse]\nenabled = false\n[[device]]\nname = "d"\nsize = "1G"\nnotify = "%s"\nspin_budget_us = %s\n[device.backend]\n%s\n' \
  "$notify" "$budget" "$b" >"$work/c.toml"
"$bin" serve --config "$work/c.toml" --run-dir "$work/run" 2>"$work/serve.log" &
pid=$!
for _ in $(seq 100); do [ -S "$work/run/nbd.sock" ] && break; sleep 0.1; done
[ -S "$work/run/nbd.sock" ] || { cat "$work/serve.log" >&2; exit 1; }
uri="nbd+unix:///d?socket=$work/run/nbd.sock"
if [ "${JOBS:-}" = large ]; then
  fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size=512M >/dev/null 2>&1
  echo "read  1M QD4 $(scripts/fio_job.sh "$uri" read 1M 4 512M "$secs")"
  echo "write 1M QD4 $(scripts/fio_job.sh "$uri" write 1M 4 512M "$secs")"
  exit 0
fi
echo "randread  QD1  $(scripts/fio_job.sh "$uri" randread 4k 1 512M "$secs")"
echo "randwrite QD1  $(scripts/fio_job.sh "$uri" randwrite 4k 1 512M "$secs")"
echo "randread  QD16 $(scripts/fio_job.sh "$uri" randread 4k 16 512M "$secs")"
