#!/usr/bin/env bash
# A throwaway single-node Ceph cluster, for trying the `rbd` backend and for the tests.
#
#   scripts/ceph-dev.sh up   [--dir DIR] [--netns NAME [--addr IP]] [--pool POOL] [--bluestore SIZE]
#   scripts/ceph-dev.sh down [--dir DIR]
#
# `up` starts one monitor on 127.0.0.1 and one OSD (memstore, or bluestore on a sparse file of
# SIZE), makes a pool of size 1 and initialises it for RBD, then prints the keys a `[[device]]`
# with `type = "rbd"` needs. With --netns the cluster lives in a network namespace of that name
# (made here, removed by `down`), so several clusters can run side by side; run clients there
# with `nsenter --net=/run/netns/NAME`. With --addr as well, the daemons listen on IP, added
# to the namespace's loopback, so that clients in other namespaces routed to it are other
# hosts. No mgr, no cephadm, no containers. `down` stops the
# daemons and removes DIR; it is safe to run on a half-started cluster.
# Needs ceph-mon, ceph-osd and ceph-common (scripts/deps.sh installs them).
set -euo pipefail

cmd=${1:-}
shift || true
dir=${BULKHEAD_CEPH_DIR:-/tmp/bulkhead-ceph}
netns=""
addr=127.0.0.1
pool=rbd
bluestore=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --netns) netns=$2; shift 2 ;;
    --addr) addr=$2; shift 2 ;;
    --pool) pool=$2; shift 2 ;;
    --bluestore) bluestore=$2; shift 2 ;;
    *) echo "ceph-dev.sh: unknown option \`$1\`" >&2; exit 2 ;;
  esac
done

in_ns() {
  if [ -n "$netns" ]; then nsenter --net="/run/netns/$netns" "$@"; else "$@"; fi
}

down() {
  [ -f "$dir/netns" ] && netns=$(cat "$dir/netns")
  for pidfile in "$dir"/run/*.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill -9 "$pid" 2>/dev/null || true
  done
  # Daemons started by a cluster whose pid files were lost still name the directory.
  pkill -9 -f -- "-c $dir/ceph.conf" 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f -- "-c $dir/ceph.conf" >/dev/null || break; sleep 0.1; done
  if [ -n "$netns" ] && [ -e "/run/netns/$netns" ]; then ip netns delete "$netns"; fi
  rm -rf "$dir"
}

up() {
  if [ "$addr" != 127.0.0.1 ] && [ -z "$netns" ]; then
    echo "ceph-dev.sh: --addr needs --netns (the address is added to the namespace's loopback)" >&2; exit 2
  fi
  command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null || {
    echo "ceph-dev.sh: ceph-mon and ceph-osd are not installed (scripts/deps.sh test installs them)" >&2; exit 1; }
  if [ -e "$dir/ceph.conf" ]; then echo "ceph-dev.sh: a cluster is already in $dir; run \`down\` first" >&2; exit 1; fi
  mkdir -p "$dir/run" "$dir/log" "$dir/mon.a" "$dir/osd.0"
  trap 'echo "ceph-dev.sh: start failed; logs in $dir/log" >&2; tail -n 20 "$dir"/log/*.log >&2 2>/dev/null || true; down' ERR
  if [ -n "$netns" ]; then
    ip netns add "$netns"
    echo "$netns" > "$dir/netns"
    ip -n "$netns" link set lo up
    [ "$addr" = 127.0.0.1 ] || ip -n "$netns" addr add "$addr/32" dev lo
  fi
  # Ceph picks addresses off interfaces other than the loopback: an address given is bound
  # as it is.
  local fsid public="public network = 127.0.0.0/8"
  [ "$addr" = 127.0.0.1 ] || public="public addr = $addr
cluster addr = $addr"
  fsid=$(cat /proc/sys/kernel/random/uuid)
  # memstore keeps each object in 64 KiB pages: as one buffer list, every small write splices
  # in a piece and later reads of the object walk all of them (reads at depth 32 ran at 0.6x
  # after 24 s of 4 KiB random writes), so each measurement would depend on the ones before.
  local store="osd objectstore = memstore
memstore device bytes = 2147483648
memstore page set = true"
  if [ -n "$bluestore" ]; then
    truncate -s "$bluestore" "$dir/osd.0.block"
    store="osd objectstore = bluestore
bluestore block path = $dir/osd.0.block
bluestore block create = false
bluestore cache size = 134217728"
  fi
  cat > "$dir/ceph.conf" <<CONF
[global]
fsid = $fsid
mon host = v2:$addr:3300
$public
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/keyring
run dir = $dir/run
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
admin socket = $dir/run/\$name.asok
ms bind ipv6 = false
ms bind msgr1 = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
paxos propose interval = 0.1
client mount timeout = 15
rados mon op timeout = 30
mon data = $dir/mon.\$id
osd data = $dir/osd.\$id
$store
osd memory target = 939524096
CONF
  ceph-authtool "$dir/keyring" --create-keyring --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
  ceph-authtool "$dir/keyring" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' >/dev/null
  monmaptool --create --enable-all-features --addv a "[v2:$addr:3300]" --fsid "$fsid" "$dir/monmap" >/dev/null
  ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring" -c "$dir/ceph.conf"
  in_ns ceph-mon -i a -c "$dir/ceph.conf"
  local osd_uuid
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  in_ns ceph -c "$dir/ceph.conf" osd new "$osd_uuid" 0 >/dev/null
  in_ns ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" -c "$dir/ceph.conf" >/dev/null 2>&1
  in_ns ceph-osd -i 0 -c "$dir/ceph.conf" 2>>"$dir/log/osd.0.stderr"
  in_ns ceph -c "$dir/ceph.conf" osd pool create "$pool" 8 8 >/dev/null 2>&1
  in_ns rbd -c "$dir/ceph.conf" pool init "$pool"
  ceph-authtool -p -n client.admin "$dir/keyring" > "$dir/client.admin.key"
  chmod 600 "$dir/client.admin.key"
  trap - ERR
  cat <<OUT
# cluster up in $dir${netns:+ (network namespace $netns)}; \`scripts/ceph-dev.sh down --dir $dir\` ends it
CEPH_CONF=$dir/ceph.conf
mon_host = "$addr:3300"
pool = "$pool"
user = "admin"
key_file = "$dir/client.admin.key"
OUT
}

case "$cmd" in
  up) up ;;
  down) down ;;
  *) echo "usage: scripts/ceph-dev.sh up|down [--dir DIR] [--netns NAME [--addr IP]] [--pool POOL] [--bluestore SIZE]" >&2; exit 2 ;;
esac
