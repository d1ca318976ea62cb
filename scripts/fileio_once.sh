#!/usr/bin/env bash
# The IDDR thesis' experiment (ch. 5) once, for bulkhead next to the peers, in one run:
# ext2 on a loop device (--direct-io=on) over the exported file, sysbench fileio, 16 KiB blocks,
# O_DIRECT, 256 MiB in 16 files, a 1 GiB ram device. Peers come from the shared peers script.
# usage: scripts/fileio_once.sh [MODES] [THREADS] [SECS] [NOTIFY] [PEERS]
#   defaults: "rndrd rndwr seqrd seqwr" "1 4 16" 4 "irq poll adaptive" "native nbdkit qsd"
set -euo pipefail
cd "$(dirname "$0")/.."
MODES=${1:-"rndrd rndwr seqrd seqwr"}; THREADS=${2:-"1 4 16"}; SECS=${3:-4}
NOTIFY=${4:-"irq poll adaptive"}; PEERS=${5:-"native nbdkit qsd"}
scripts/deps.sh bench
cargo build --release --locked -q
BIN=$PWD/target/release/bulkhead
W=$(mktemp -d /dev/shm/bulkhead-fileio.XXXX); MNT=$W/mnt; mkdir -p $MNT
L=; SP=
cleanup() {
  umount $MNT 2>/dev/null || true
  [ -n "$L" ] && losetup -d $L 2>/dev/null || true
  [ -n "$SP" ] && kill -TERM $SP 2>/dev/null && wait $SP 2>/dev/null || true
  rm -rf $W
}
trap cleanup EXIT
for N in $NOTIFY; do
  SYS="bulkhead-$N"
  printf '[[device]]\nname = "disk0"\nsize = "1G"\nnotify = "%s"\n[device.backend]\ntype = "ram"\n' $N > $W/c.toml
  $BIN serve --config $W/c.toml --run-dir $W/run 2>$W/serve.log & SP=$!
  for _ in $(seq 100); do [ -e $W/run/fuse/disk0 ] && break; sleep 0.1; done
  L=$(losetup --direct-io=on -f --show $W/run/fuse/disk0)
  echo "# $SYS dio=$(cat /sys/block/$(basename $L)/loop/dio)"
  mkfs.ext2 -q -F $L && mount $L $MNT
  (cd $MNT && sysbench fileio --file-total-size=256M --file-num=16 prepare >/dev/null)
  for m in $MODES; do for t in $THREADS; do
    out=$(cd $MNT && sysbench fileio --file-total-size=256M --file-num=16 --file-test-mode=$m \
      --file-block-size=16384 --file-extra-flags=direct --threads=$t --time=$SECS run)
    r=$(echo "$out" | awk '/read, MiB\/s/{print $3}'); w=$(echo "$out" | awk '/written, MiB\/s/{print $3}')
    lat=$(echo "$out" | awk '/95th percentile/{print $3}')
    echo "$SYS $m threads=$t read_MiBs=$r write_MiBs=$w p95_ms=$lat"
  done; done
  umount $MNT; losetup -d $L; L=
  kill -TERM $SP; wait $SP || true; SP=
done
PEERS_SCRIPT=$(cd .. && pwd)/shared/tools/peers_fileio.sh
if [ -n "$PEERS" ] && [ -x "$PEERS_SCRIPT" ] || [ -f "$PEERS_SCRIPT" ]; then
  bash "$PEERS_SCRIPT" "$PEERS" "$MODES" "$THREADS" "$SECS"
else
  echo "# peers skipped: $PEERS_SCRIPT not found"
fi
