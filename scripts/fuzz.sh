#!/usr/bin/env bash
# Runs every cargo-fuzz target in turn for SECONDS each (default 30), from its seeds
# (fuzz/seeds/<target>: scripts/fuzz-seeds.py writes them, and each finding's input stays there
# as a regression) and its working corpus (fuzz/corpus/<target>, grown), and
# prints one line per target: runs, coverage, corpus, findings. Exits non-zero if a target
# does not build, or finds a crash, a leak or a timeout (its input is in
# fuzz/artifacts/<target>/). FUZZ_TARGETS="a b" runs only those.
#
#   scripts/fuzz.sh            # 30 s each
#   scripts/fuzz.sh 600        # a campaign: 10 minutes each
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-30}"
targets="${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}"
build=$(mktemp)
trap 'rm -f "$build"' EXIT
if ! cargo +nightly fuzz build -O >"$build" 2>&1; then
  tail -n 30 "$build" >&2
  echo "fuzz: the targets do not build" >&2
  exit 1
fi
failed=0
for t in $targets; do
  mkdir -p "corpus/$t" "seeds/$t" "artifacts/$t"
  log=$(mktemp)
  before=$(find "artifacts/$t" -type f | wc -l)
  started=$SECONDS
  # -timeout: an input that takes 10 s is a hang; -rss_limit_mb: 2 GiB is a leak.
  if cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
       -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result=FOUND
    failed=1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  # The time it ran: libFuzzer stops at its first finding.
  took=$(( SECONDS - started ))
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1 | cut -d' ' -f2)
  corp=$(grep -o 'corp: [0-9]*' "$log" | tail -n1 | cut -d' ' -f2)
  found=$(( $(find "artifacts/$t" -type f | wc -l) - before ))
  printf '%-20s %s: %s runs in %s s, coverage %s, corpus %s, findings %s\n' \
    "$t" "$result" "${runs:-0}" "${took:-?}" "${cov:-?}" "${corp:-?}" "$found"
  if [ "$result" = FOUND ]; then
    grep -E 'ERROR|panicked|SUMMARY|Test unit written' "$log" | head -n 8 | sed 's/^/    /' >&2
    # The whole report, stack traces included, beside the input.
    cp "$log" "artifacts/$t/finding.log"
    echo "    the whole report: fuzz/artifacts/$t/finding.log" >&2
  fi
  rm -f "$log"
done
exit "$failed"
