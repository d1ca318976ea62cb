#!/usr/bin/env bash
# Builds the test guests' kit from Debian packages alone, once: the kernel of the
# linux-image-amd64 package (uncompressed, so QEMU boots it through PVH), and an initramfs of
# busybox-static, the virtio and ext4 modules of that kernel, and an init that runs the
# /run.sh a test appends as a second archive. Nothing is downloaded from elsewhere.
# Usage: scripts/guest-kit.sh [DIR]   (default $BULKHEAD_GUEST_KIT or /var/cache/bulkhead/guest-kit)
# Prints the kit's directory; DIR/vmlinux and DIR/initrd.cpio.gz are the kit.
set -euo pipefail
dir="${1:-${BULKHEAD_GUEST_KIT:-/var/cache/bulkhead/guest-kit}}"
# The kit's layout version: a change below that needs a rebuild bumps it.
layout=1
if [ -f "$dir/stamp" ] && [ "$(cat "$dir/stamp")" = "layout=$layout" ] && [ -f "$dir/vmlinux" ] && [ -f "$dir/initrd.cpio.gz" ]; then
  echo "$dir"
  exit 0
fi
busybox=""
for b in /bin/busybox /usr/bin/busybox; do
  if [ -x "$b" ] && ! ldd "$b" >/dev/null 2>&1; then busybox=$b; break; fi
done
if [ -z "$busybox" ]; then
  echo "guest-kit: a static busybox is needed (apt-get install busybox-static)" >&2
  exit 1
fi
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
download() {
  apt-get download "$1" >/dev/null 2>&1 || { apt-get update -qq && apt-get download "$1" >/dev/null; }
}
download linux-image-amd64
meta=$(ls linux-image-amd64_*.deb)
# The meta package names the kernel package it stands for.
pkg=$(dpkg-deb -f "$meta" Depends | tr ',' '\n' | sed -n 's/^ *\(linux-image-[0-9][^ ]*\).*/\1/p' | head -1)
[ -n "$pkg" ] || { echo "guest-kit: $meta names no kernel package" >&2; exit 1; }
download "$pkg"
dpkg-deb -x "$(ls "${pkg}"_*.deb)" x
vmlinuz=$(ls x/boot/vmlinuz-*)
release=${vmlinuz#x/boot/vmlinuz-}
# The bzImage carries the kernel as one xz stream: cut it out and decompress it.
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)
[ -n "$off" ] || { echo "guest-kit: no xz payload in $vmlinuz" >&2; exit 1; }
tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream > vmlinux 2>/dev/null || true
head -c 4 vmlinux | grep -q ELF || { echo "guest-kit: could not unpack the kernel in $vmlinuz" >&2; exit 1; }

mkdir -p root/bin root/lib/modules root/dev root/proc root/sys root/mnt root/tmp
cp "$busybox" root/bin/busybox
mods="drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev
      drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci drivers/block/virtio_blk
      lib/crc16 fs/mbcache fs/jbd2/jbd2 crypto/crc32c_generic fs/ext4/ext4"
order=""
for m in $mods; do
  src="x/lib/modules/$release/kernel/$m.ko"
  if [ -f "$src.xz" ]; then xz -dc "$src.xz" > "root/lib/modules/$(basename "$m").ko"
  elif [ -f "$src" ]; then cp "$src" root/lib/modules/
  else echo "guest-kit: $src is not in $pkg" >&2; exit 1; fi
  order="$order $(basename "$m")"
done
cat > root/init <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in$order; do insmod /lib/modules/\$m.ko || echo "GUEST FAIL insmod \$m"; done
echo "GUEST UP \$(cut -d' ' -f1 /proc/uptime)"
status=0
if [ -x /run.sh ]; then /run.sh; status=\$?; fi
echo "GUEST EXIT \$status"
echo "GUEST DMESG BEGIN"
dmesg
echo "GUEST DMESG END"
poweroff -f
EOF
chmod +x root/init
(cd root && find . | LC_ALL=C sort | "$busybox" cpio -o -H newc 2>/dev/null | gzip -1) > initrd.cpio.gz
mv vmlinux "$dir/vmlinux"
mv initrd.cpio.gz "$dir/initrd.cpio.gz"
echo "$pkg" > "$dir/kernel"
echo "layout=$layout" > "$dir/stamp"
echo "$dir"
