#!/usr/bin/env bash
# The block tap's cost with its spinners placed by hand, and what one CPU handing itself from
# process to process costs on this machine: the floor under an interpose hop when three
# spinners (frontend, tap domain, driver domain) share two CPUs.
#
#   scripts/tap_pinned.sh [bench tap options]   (default: --mode poll --no-nbdkit
#                                                 --bytes 256M --requests 20000)
#
# 1. Two processes pinned to CPU 1 hand a flag back and forth, each calling sched_yield()
#    until the flag is its own: the time per round trip is two same-CPU switches. Then the
#    same with 1.5 us of work on each side per turn, as a tap domain and a driver domain do.
# 2. `bulkhead-bench tap` with the benchmark process (the client thread, FUSE workers) on
#    CPU 0 and every domain it starts (driver and tap) moved to CPU 1 as it appears.
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--mode poll --no-nbdkit --bytes 256M --requests 20000)
[ "$(nproc)" -ge 2 ] || { echo "tap_pinned: needs two CPUs" >&2; exit 1; }
cargo build --release --locked -q -p bulkhead
bin="$PWD/target/release/bulkhead"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/switch.c" <<'C'
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void work(double ns) { double t = now(); while (now() - t < ns) {} }
int main(int argc, char **argv) {
    double each = argc > 1 ? atof(argv[1]) : 0; /* ns of work on each side per turn */
    volatile long *flag = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cpu_set_t one; CPU_ZERO(&one); CPU_SET(1, &one);
    if (flag == MAP_FAILED || sched_setaffinity(0, sizeof one, &one)) { perror("setup"); return 1; }
    const long n = 200000;
    if (fork() == 0) {
        for (long i = 0; i < n; i++) { while (*flag != 2 * i + 1) sched_yield(); work(each); *flag = 2 * i + 2; }
        _exit(0);
    }
    double t = now();
    for (long i = 0; i < n; i++) { work(each); *flag = 2 * i + 1; while (*flag != 2 * i + 2) sched_yield(); }
    double per = (now() - t) / n / 1000;
    wait(0);
    printf("same-CPU round trip between two processes (two switches), %.1f us of work each side: %.2f us\n", each / 1000, per);
    return 0;
}
C
cc -O2 -o "$tmp/switch" "$tmp/switch.c"
"$tmp/switch"
"$tmp/switch" 1500
taskset -c 0 "$bin" bench tap "${args[@]}" > "$tmp/tap.out" 2>&1 &
bench=$!
while kill -0 "$bench" 2>/dev/null; do
  for p in $(pgrep -f "^$bin (driver|tap)" || true); do
    taskset -a -p 2 "$p" >/dev/null 2>&1 || true
  done
  sleep 0.05
done
wait "$bench" || true
cat "$tmp/tap.out"
