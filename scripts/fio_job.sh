#!/usr/bin/env bash
# One fio job over NBD, summarised: `scripts/fio_job.sh URI RW BS DEPTH SIZE SECONDS` prints
# "IOPS P50_US P99_US MIB_S" (completion latency; reads if the job read, else writes).
set -euo pipefail
fio --name=j --ioengine=nbd --uri="$1" --rw="$2" --bs="$3" --iodepth="$4" --size="$5" \
    --time_based --runtime="$6" --output-format=json 2>/dev/null |
  python3 -c '
import json, sys
text = sys.stdin.read()
j = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print a line before the JSON
d = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
p = d["clat_ns"].get("percentile", {})
print("%.0f %.1f %.1f %.0f" % (d["iops"], p.get("50.000000", 0) / 1e3, p.get("99.000000", 0) / 1e3, d["bw_bytes"] / 2**20))'
