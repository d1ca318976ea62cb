#!/usr/bin/env bash
# Installs the system packages bulkhead's serve, tests and benchmarks use, if any is missing.
# Usage: scripts/deps.sh serve|test|bench
set -euo pipefail
need=()
want() { command -v "$1" >/dev/null 2>&1 || need+=("$2"); }
# The test guests' initramfs needs busybox linked statically (busybox-static, not busybox).
static_busybox() { dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed" || need+=(busybox-static); }
want losetup util-linux
want mkfs.ext4 e2fsprogs
# The NBD export's pre-shared-key TLS links the system's OpenSSL: headers and pkg-config to build.
pkg-config --exists openssl 2>/dev/null || need+=(libssl-dev pkg-config)
# The ublk export's library (libublk) makes its kernel bindings with bindgen, which needs libclang.
dpkg-query -W -f='${Status}' libclang-dev 2>/dev/null | grep -q "ok installed" || need+=(libclang-dev)
case "${1:-serve}" in
  # fio's engine (scripts/fio-engine.sh) fetches the installed fio's source with curl.
  test) want fio fio; want curl curl; want qemu-io qemu-utils; want qemu-img qemu-utils; want nbdinfo libnbd-bin
        want nbdcopy libnbd-bin; want nbdfuse libnbd-bin; want fusermount3 fuse3
        want nbdkit nbdkit; want qemu-nbd qemu-utils; want ip iproute2; want sysbench sysbench
        want blkparse blktrace; want btt blktrace; want cryptsetup cryptsetup-bin; want openssl openssl
        want qemu-system-x86_64 qemu-system-x86; want qemu-storage-daemon qemu-system-common; static_busybox
        # The kernel lab's NBD client test (the guest runs this host's nbd-client).
        want nbd-client nbd-client
        # The shipped alert rules' tests (promtool) and a real Prometheus scraping serve.
        want promtool prometheus; want prometheus prometheus
        # The rbd tests' throwaway cluster (scripts/ceph-dev.sh); ceph-common brings librbd1.
        want ceph-mon ceph-mon; want ceph-osd ceph-osd; want rbd ceph-common
        # The package's life under a real systemd: a container booted with systemd as PID 1
        # on a Debian root that mmdebstrap makes (scripts/systemd-lab.sh).
        want systemd-nspawn systemd-container; want mmdebstrap mmdebstrap
        # The control socket's check of another user connects from a small script.
        [ -x /usr/bin/python3 ] || need+=(python3); want setpriv util-linux ;;
  bench) want fio fio; want curl curl; want sysbench sysbench; want nbdkit nbdkit; want nbdfuse libnbd-bin
         want qemu-storage-daemon qemu-system-common; want fusermount3 fuse3; want qemu-nbd qemu-utils
         want bindfs bindfs; want cryptsetup cryptsetup-bin; want qemu-system-x86_64 qemu-system-x86; static_busybox
         want nbd-client nbd-client ;;
esac
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing packages: ${need[*]} (run as root to install them)" >&2
    exit 1
  fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Packages that bring a service (prometheus) are installed, not started: a policy-rc.d of
  # our own, for the install alone, tells their scripts so.
  made_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  # shellcheck disable=SC2046 # one word per package, duplicates removed
  rc=0
  apt-get install -y -qq $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null || rc=$?
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || exit "$rc"
fi
case "${1:-serve}" in
  # `bulkhead-bench ublk` compares with rublk, the ublk project's own server.
  bench) command -v rublk >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/rublk" ] \
           || cargo install -q rublk --no-default-features --locked --version 0.2.15 ;;
esac
case "${1:-serve}" in
  # The package test builds bulkhead_*.deb with cargo-deb (scripts/package.sh).
  test) command -v cargo-deb >/dev/null 2>&1 || cargo install -q cargo-deb --locked --version 3.8.0
        # The fuzz targets run briefly in the suite (scripts/fuzz.sh), on the nightly toolchain.
        if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
          cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install -q cargo-fuzz --locked --version 0.13.2
        fi ;;
esac
case "${1:-serve}" in
  # The guests' kit (a kernel and an initramfs from Debian packages) and the kernel lab
  # (bookworm-backports' kernel, which has ublk and nbd), built once and cached.
  test|bench) "$(dirname "$0")/guest-kit.sh" >/dev/null; "$(dirname "$0")/guest-lab.sh" >/dev/null ;;
esac
case "${1:-serve}" in
  # The root the package's life test boots systemd in, built once and cached.
  test) "$(dirname "$0")/systemd-lab.sh" >/dev/null ;;
esac
