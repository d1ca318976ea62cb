#!/bin/bash
# A/B of two builds of bulkhead through the FUSE file of the embedded default: 4 KiB random
# reads with fio (io_uring, O_DIRECT) at QD1 and QD32, ROUNDS rounds alternating the builds.
# Prints one line per round, build and depth: IOPS and the median completion latency (µs).
#
#   scripts/ab-fuse.sh OLD_BINARY NEW_BINARY [ROUNDS] [SECONDS]
set -eu
old=$1 new=$2 rounds=${3:-3} secs=${4:-8}
command -v fio >/dev/null || { echo "needs fio" >&2; exit 1; }
for r in $(seq "$rounds"); do
  for v in old new; do
    bin=$old; [ $v = new ] && bin=$new
    rd=$(mktemp -d /tmp/ab-fuse.XXXXXX)
    "$bin" serve --run-dir "$rd/run" > "$rd/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do [ -e "$rd/run/fuse/disk0" ] && break; sleep 0.1; done
    for qd in 1 32; do
      fio --name=ab --filename="$rd/run/fuse/disk0" --rw=randread --bs=4k --iodepth=$qd --ioengine=io_uring \
        --direct=1 --size=512M --runtime="$secs" --time_based --output-format=json 2>/dev/null |
        python3 -c "import json,sys;j=json.load(sys.stdin)['jobs'][0]['read'];print('$r $v qd$qd', round(j['iops']), round(j['clat_ns']['percentile']['50.000000']/1000,2))"
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -rf "$rd"
  done
done
