#!/usr/bin/env bash
# NBD export throughput and latency, side by side with qemu-nbd and nbdkit serving the same
# backing: RAM (bulkhead `ram`, nbdkit `memory`, qemu-nbd on a /dev/shm file) and a file on
# disk (bulkhead `file`, nbdkit `file`, qemu-nbd on the same file). fio's nbd engine (libnbd)
# is the client; every server is reached over a unix socket.
#
#   scripts/nbd_bench.sh [SECONDS_PER_JOB]      (default 5)
#
# Prints one markdown table: 4 KiB random read and write at queue depth 1 (IOPS, p50/p99
# latency), 4 KiB random read at depth 16 (IOPS), 1 MiB sequential read and write at depth 4
# (MiB/s).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}"
scripts/deps.sh bench >/dev/null
cargo build --release --locked -q -p bulkhead
bin="$PWD/target/release/bulkhead"
work=$(mktemp -d /var/tmp/bulkhead-nbd-bench.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work" /dev/shm/bulkhead-nbd-bench.img
}
trap cleanup EXIT INT TERM
size=1G

wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }

start_server() { # name backing -> sets uri
  local name=$1 backing=$2 sock="$work/$1-$2.sock"
  case "$name" in
    bulkhead)
      local b
      if [ "$backing" = ram ]; then b='type = "ram"'; else b="type = \"file\"
path = \"$work/disk.img\""; fi
      printf '[fuse]\nenabled = false\n[[device]]\nname = "d"\nsize = "%s"\n[device.backend]\n%s\n' "$size" "$b" >"$work/c.toml"
      "$bin" serve --config "$work/c.toml" --run-dir "$work/run-$backing" 2>"$work/serve.log" &
      pids+=($!); sock="$work/run-$backing/nbd.sock"; wait_sock "$sock"; uri="nbd+unix:///d?socket=$sock" ;;
    qemu-nbd)
      local f="$work/disk.img"; [ "$backing" = ram ] && f=/dev/shm/bulkhead-nbd-bench.img
      qemu-nbd -f raw -t -e 16 --cache=none --aio=threads -k "$sock" "$f" 2>/dev/null &
      pids+=($!); wait_sock "$sock"; uri="nbd+unix:///?socket=$sock" ;;
    nbdkit)
      if [ "$backing" = ram ]; then nbdkit -f -U "$sock" memory "$size" & else nbdkit -f -U "$sock" file "$work/disk.img" cache=none & fi
      pids+=($!); wait_sock "$sock"; uri="nbd+unix:///?socket=$sock" ;;
  esac
}

stop_servers() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }

job() { scripts/fio_job.sh "$uri" "$1" "$2" "$3" 512M "$secs"; } # rw bs depth -> "iops p50us p99us MiBs"

truncate -s "$size" "$work/disk.img"
truncate -s "$size" /dev/shm/bulkhead-nbd-bench.img
echo "| backing | server | 4K randread QD1 IOPS (p50/p99 µs) | 4K randwrite QD1 IOPS (p50/p99 µs) | 4K randread QD16 IOPS | 1M seq read QD4 MiB/s | 1M seq write QD4 MiB/s |"
echo "|---|---|---|---|---|---|---|"
for backing in ram file; do
  for server in bulkhead qemu-nbd nbdkit; do
    if ! command -v "${server/bulkhead/$bin}" >/dev/null 2>&1; then echo "| $backing | $server | not installed ||||| |"; continue; fi
    start_server "$server" "$backing"
    # Fill the range first so reads hit written data on every server.
    fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size=512M >/dev/null 2>&1
    read -r a ap50 ap99 _ <<<"$(job randread 4k 1)"
    read -r b bp50 bp99 _ <<<"$(job randwrite 4k 1)"
    read -r c _ _ _ <<<"$(job randread 4k 16)"
    read -r _ _ _ d <<<"$(job read 1M 4)"
    read -r _ _ _ e <<<"$(job write 1M 4)"
    echo "| $backing | $server | $a ($ap50/$ap99) | $b ($bp50/$bp99) | $c | $d | $e |"
    stop_servers
  done
done
