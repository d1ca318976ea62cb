#!/usr/bin/env bash
# Builds the kernel lab's kit from Debian packages alone, once: the kernel of bookworm-backports'
# linux-image-amd64 (6.12: it has ublk_drv, nbd and 9p as modules, which this machine's kernel
# and bookworm's 6.1 lack), uncompressed so that QEMU boots it through PVH, and an initramfs of
# busybox-static with those modules and an init that mounts the host's root read-only over 9p
# and switches to it. A lab guest thus runs the host's own programs (bulkhead, fio, e2fsprogs,
# nbd-client) on the lab's kernel. Nothing is downloaded from elsewhere, and the machine's own
# package sources are left as they are: the backports suite is read through a private apt
# configuration under the kit's directory.
# Usage: scripts/guest-lab.sh [DIR]   (default $BULKHEAD_GUEST_LAB or /var/cache/bulkhead/guest-lab)
# Prints the kit's directory; DIR/vmlinux and DIR/initrd.cpio.gz are the kit.
set -euo pipefail
dir="${1:-${BULKHEAD_GUEST_LAB:-/var/cache/bulkhead/guest-lab}}"
layout=1
if [ -f "$dir/stamp" ] && [ "$(cat "$dir/stamp")" = "layout=$layout" ] && [ -f "$dir/vmlinux" ] && [ -f "$dir/initrd.cpio.gz" ]; then
  echo "$dir"
  exit 0
fi
busybox=""
for b in /bin/busybox /usr/bin/busybox; do
  if [ -x "$b" ] && ! ldd "$b" >/dev/null 2>&1; then busybox=$b; break; fi
done
[ -n "$busybox" ] || { echo "guest-lab: a static busybox is needed (apt-get install busybox-static)" >&2; exit 1; }
command -v zstd >/dev/null || { echo "guest-lab: zstd is needed to unpack the 6.12 kernel (apt-get install zstd)" >&2; exit 1; }
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
mkdir -p apt/lists/partial apt/cache/archives/partial
echo "deb http://deb.debian.org/debian bookworm-backports main" > apt/sources.list
apt_opts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache" -o Debug::NoLocking=1
          -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
apt-get "${apt_opts[@]}" download linux-image-amd64 >/dev/null
meta=$(ls linux-image-amd64_*.deb)
pkg=$(dpkg-deb -f "$meta" Depends | tr ',' '\n' | sed -n 's/^ *\(linux-image-[0-9][^ ]*\).*/\1/p' | head -1)
[ -n "$pkg" ] || { echo "guest-lab: $meta names no kernel package" >&2; exit 1; }
apt-get "${apt_opts[@]}" download "$pkg" >/dev/null
dpkg-deb -x "$(ls "${pkg}"_*.deb)" x
vmlinuz=$(ls x/boot/vmlinuz-*)
release=${vmlinuz#x/boot/vmlinuz-}
# This bzImage carries the kernel as one zstd stream: cut it out and decompress it.
off=$(LC_ALL=C grep -obUaP '\x28\xb5\x2f\xfd' "$vmlinuz" | head -1 | cut -d: -f1)
[ -n "$off" ] || { echo "guest-lab: no zstd payload in $vmlinuz" >&2; exit 1; }
tail -c +$((off + 1)) "$vmlinuz" | zstd -dcq > vmlinux 2>/dev/null || true
head -c 4 vmlinux | grep -q ELF || { echo "guest-lab: could not unpack the kernel in $vmlinuz" >&2; exit 1; }

mkdir -p root/bin root/lib/modules root/dev root/proc root/sys root/host
cp "$busybox" root/bin/busybox
moddir="x/lib/modules/$release/kernel"
# The modules the lab needs, each after what it depends on (read from its .modinfo: the
# package ships no modules.dep).
order=()
add() {
  local m=$1 f deps d
  for d in "${order[@]:-}"; do [ "$d" = "$m" ] && return 0; done
  f=$(find "$moddir" -name "$m.ko.xz" -o -name "$m.ko" | head -1)
  [ -n "$f" ] || { f=$(find "$moddir" -name "${m//_/-}.ko*" | head -1); }
  [ -n "$f" ] || { echo "guest-lab: module $m is not in $pkg" >&2; exit 1; }
  case "$f" in *.xz) xz -dc "$f" > "root/lib/modules/$m.ko" ;; *) cp "$f" "root/lib/modules/$m.ko" ;; esac
  deps=$(grep -a -o 'depends=[^[:cntrl:]]*' "root/lib/modules/$m.ko" | head -1 | cut -d= -f2)
  for d in ${deps//,/ }; do add "$d"; done
  order+=("$m")
}
for m in virtio_blk ext4 crc32c_generic loop nbd ublk_drv 9pnet_virtio 9p; do add "$m"; done
cat > root/init <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in ${order[*]}; do insmod /lib/modules/\$m.ko || echo "GUEST FAIL insmod \$m"; done
echo "GUEST UP \$(cut -d' ' -f1 /proc/uptime)"
# The host's root, read-only; writable scratch on tmpfs under /run; then the host's programs
# on this kernel (switch_root, not chroot: a chrooted process may not make user namespaces,
# and the driver domains need them).
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=mmap hostroot /host || echo "GUEST FAIL 9p"
mount -t tmpfs -o mode=755 run /host/run
mount -t tmpfs -o mode=1777 tmp /host/var/tmp
mkdir -p /host/run/lab /host/run/lock
cp /bin/busybox /run.sh /host/run/lab/ 2>/dev/null
[ -f /bin/guest-io ] && cp /bin/guest-io /host/run/lab/
cat > /host/run/lab/stage2 <<'STAGE2'
#!/run/lab/busybox sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs shm /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
status=0
if [ -x /run/lab/run.sh ]; then /run/lab/run.sh; status=\$?; fi
echo "GUEST EXIT \$status"
echo "GUEST DMESG BEGIN"
dmesg
echo "GUEST DMESG END"
sync
/run/lab/busybox poweroff -f
STAGE2
chmod +x /host/run/lab/stage2
mount --move /proc /host/proc
mount --move /sys /host/sys
mount --move /dev /host/dev
exec switch_root /host /run/lab/stage2
INIT
chmod +x root/init
(cd root && find . | LC_ALL=C sort | "$busybox" cpio -o -H newc 2>/dev/null | gzip -1) > initrd.cpio.gz
mv vmlinux "$dir/vmlinux"
mv initrd.cpio.gz "$dir/initrd.cpio.gz"
echo "$pkg" > "$dir/kernel"
echo "layout=$layout" > "$dir/stamp"
echo "$dir"
