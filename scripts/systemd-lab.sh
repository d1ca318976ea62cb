#!/usr/bin/env bash
# Builds, once, the root file system the package's life test boots with systemd as PID 1
# (systemd-nspawn --boot): Debian bookworm's minbase with systemd, dbus, what the package
# depends on, and the tools an admin uses on a device (e2fsprogs, util-linux, nbdinfo).
# Made from Debian's packages by mmdebstrap; the test copies it and never changes it.
# Usage: scripts/systemd-lab.sh [DIR]  (default $BULKHEAD_SYSTEMD_LAB or /var/cache/bulkhead/systemd-root)
# Prints the root's directory.
set -euo pipefail
dir="${1:-${BULKHEAD_SYSTEMD_LAB:-/var/cache/bulkhead/systemd-root}}"
layout=1
if [ -f "$dir.stamp" ] && [ "$(cat "$dir.stamp")" = "layout=$layout" ] && [ -x "$dir/lib/systemd/systemd" ]; then
  echo "$dir"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "systemd-lab: mmdebstrap is needed (apt-get install mmdebstrap)" >&2; exit 1; }
command -v systemd-nspawn >/dev/null || { echo "systemd-lab: systemd-nspawn is needed (apt-get install systemd-container)" >&2; exit 1; }
rm -rf "$dir" "$dir.stamp"
mkdir -p "$(dirname "$dir")"
mmdebstrap --quiet --variant=minbase \
  --include=systemd,systemd-sysv,dbus,libssl3,fuse3,e2fsprogs,util-linux,procps,libnbd-bin \
  bookworm "$dir" >&2
echo "layout=$layout" > "$dir.stamp"
echo "$dir"
