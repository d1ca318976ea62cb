#!/usr/bin/env bash
# qcow2 next to raw through bulkhead's FUSE export: an allocated raw file, a fully allocated qcow2
# (`preallocation=falloc`) and a fresh one (every first write allocates), 1 GiB each, served
# together; fio (libaio, O_DIRECT) on each exported file: 4 KiB random writes and reads at
# QD1, reads at QD16, 1 MiB sequential writes and reads at QD4. Then `qemu-img check` on both
# images.
#
#   sudo scripts/images_bench.sh [SECONDS_PER_JOB]   (default 5)
#
# Prints one line per device and job: IOPS and MiB/s, and each qcow2 figure as a share of raw.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}"
scripts/deps.sh test >/dev/null
cargo build --release --locked -q -p bulkhead
bin="$PWD/target/release/bulkhead"
work=$(mktemp -d /var/tmp/bulkhead-images-bench.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
fallocate -l 1G "$work/raw.img"  # allocated, as the preallocated qcow2
qemu-img create -q -f qcow2 -o preallocation=falloc "$work/full.qcow2" 1G
qemu-img create -q -f qcow2 "$work/fresh.qcow2" 1G
{
  printf '[nbd]\nenabled = false\n'
  printf '[[device]]\nname = "raw"\n[device.backend]\ntype = "file"\npath = "%s"\n' "$work/raw.img"
  for d in full fresh; do
    printf '[[device]]\nname = "%s"\n[device.backend]\ntype = "file"\nformat = "qcow2"\npath = "%s"\n' "$d" "$work/$d.qcow2"
  done
} >"$work/c.toml"
"$bin" serve --config "$work/c.toml" --run-dir "$work/run" 2>"$work/serve.log" &
pid=$!
for _ in $(seq 100); do [ -e "$work/run/fuse/fresh" ] && break; sleep 0.1; done
declare -A raw
for dev in raw full fresh; do
  for job in "randwrite 4k 1" "randread 4k 1" "randread 4k 16" "write 1M 4" "read 1M 4"; do
    set -- $job
    read -r iops mibs <<<"$(fio --name=j --filename="$work/run/fuse/$dev" --direct=1 --ioengine=libaio --rw="$1" \
      --bs="$2" --iodepth="$3" --runtime="$secs" --time_based --output-format=json 2>/dev/null |
      python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; k='write' if 'write' in '$1' else 'read'; print(round(j[k]['iops']), round(j[k]['bw']/1024))")"
    key="$1-$2-$3"
    [ "$dev" = raw ] && raw[$key]=$iops
    share=$(python3 -c "print(f'{100*$iops/${raw[$key]}:.0f}% of raw')")
    printf '%-6s %-9s %-3s QD%-2s %7s IOPS %6s MiB/s  %s\n' "$dev" "$1" "$2" "$3" "$iops" "$mibs" "$share"
  done
done
kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=
for d in full fresh; do
  printf '%s: %s\n' "$d" "$(qemu-img check "$work/$d.qcow2" 2>&1 | grep -E 'No errors|error|leak' | head -1)"
done
