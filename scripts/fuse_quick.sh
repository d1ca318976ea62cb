#!/usr/bin/env bash
# bulkhead's FUSE export alone, 4 KiB fio jobs on a loop device over the FUSE file (libaio,
# direct): random read QD1 and QD16, random write QD1, each printed as
# "IOPS P50_US P99_US MIB_S", then random read QD1 on the FUSE file itself (psync). For quick
# before/after comparisons of the transports and the notification modes; bench fileio has the
# peers.
#
#   scripts/fuse_quick.sh [SECONDS] [NOTIFY] [IO_URING]
#                         (defaults: 4, adaptive, auto; IO_URING is auto | on | off)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-4}" notify="${2:-adaptive}" uring="${3:-auto}"
scripts/deps.sh bench >/dev/null
cargo build --release --locked -q -p bulkhead
work=$(mktemp -d /var/tmp/bulkhead-fuse-quick.XXXXXX)
pid= lo=
cleanup() {
  [ -n "$lo" ] && losetup -d "$lo" 2>/dev/null
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
printf '[fuse]\nio_uring = "%s"\n[nbd]\nenabled = false\n[[device]]\nname = "d"\nsize = "1G"\nnotify = "%s"\n[device.backend]\ntype = "ram"\n' \
  "$uring" "$notify" >"$work/c.toml"
target/release/bulkhead serve --config "$work/c.toml" --run-dir "$work/run" 2>"$work/serve.log" &
pid=$!
for _ in $(seq 100); do [ -e "$work/run/fuse/d" ] && break; sleep 0.1; done
[ -e "$work/run/fuse/d" ] || { cat "$work/serve.log" >&2; exit 1; }
grep -o 'over .*' "$work/serve.log" | head -1
lo=$(losetup --direct-io=on -f --show "$work/run/fuse/d")
job() { # file rw qd engine
  fio --name=q --filename="$1" --rw="$2" --bs=4k --iodepth="$3" --ioengine="$4" --direct=1 \
    --size=512M --runtime="$secs" --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["read"] if j["read"]["io_bytes"] else j["write"]; p=d["clat_ns"]["percentile"]; print("%.0f %.1f %.1f %.1f" % (d["iops"], p["50.000000"]/1e3, p["99.000000"]/1e3, d["bw"]/1024))'
}
echo "loop randread  QD1  $(job "$lo" randread 1 libaio)"
echo "loop randwrite QD1  $(job "$lo" randwrite 1 libaio)"
echo "loop randread  QD16 $(job "$lo" randread 16 libaio)"
echo "file randread  QD1  $(job "$work/run/fuse/d" randread 1 psync)"
