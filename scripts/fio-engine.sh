#!/usr/bin/env bash
# Builds bulkhead's fio engine, libbulkhead_fio.so (crates/capi/fio/bulkhead_fio.c), with
# libbulkhead.a linked in. An external fio engine must be built against the headers of the
# fio that loads it (fio checks its engine interface version, and the engine reads fio's own
# structures), and fio installs no headers: the source of the installed version is fetched
# from Debian's archive once, checked against its published checksum, configured as Debian
# configures it, and kept in /var/cache/bulkhead/fio-VERSION.
# Usage: scripts/fio-engine.sh [--profile release|dev] OUT.so
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
if [ "${1:-}" = "--profile" ]; then profile="${2:?--profile needs a name}"; shift 2; fi
out="${1:?usage: scripts/fio-engine.sh [--profile release|dev] OUT.so}"
command -v fio >/dev/null 2>&1 || { echo "fio-engine: fio is not installed (apt-get install fio)" >&2; exit 1; }
version=$(fio --version | sed 's/^fio-//')
# The checksums of the source tarballs in Debian's archive (from each version's .dsc).
case "$version" in
  3.33) sha256=d2410e13e0f379d061d077cc5ae325835bb7c6186aa7bafc1df954cbc9b014fc ;;
  *) echo "fio-engine: fio $version has no source checksum here; add the one from its Debian .dsc" >&2; exit 1 ;;
esac
src="/var/cache/bulkhead/fio-$version"
# One fetch at a time: builds started together wait for the first to finish.
mkdir -p /var/cache/bulkhead
exec 9>/var/cache/bulkhead/.fio-source.lock
flock 9
if [ ! -f "$src/config-host.h" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  url="http://deb.debian.org/debian/pool/main/f/fio/fio_$version.orig.tar.gz"
  echo "fio-engine: fetching fio $version's source ($url)" >&2
  curl -fsS --retry 3 -o "$tmp/fio.tar.gz" "$url"
  echo "$sha256  $tmp/fio.tar.gz" | sha256sum -c --quiet -
  tar -xzf "$tmp/fio.tar.gz" -C "$tmp"
  (cd "$tmp/fio-$version" && ./configure --disable-native --prefix=/usr >/dev/null)
  rm -rf "$src"
  mv "$tmp/fio-$version" "$src"
fi
flock -u 9
dir=$([ "$profile" = dev ] && echo debug || echo "$profile")
cargo build --locked -q -p bulkhead-capi --profile "$profile"
cc -O2 -g -shared -fPIC -Wall -Wno-unused-parameter -Werror \
  -include "$src/config-host.h" -I "$src" -I crates/capi/include -D_GNU_SOURCE \
  crates/capi/fio/bulkhead_fio.c "target/$dir/libbulkhead.a" -lpthread -ldl -lm -o "$out"
