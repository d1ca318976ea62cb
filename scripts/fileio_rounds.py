#!/usr/bin/env python3
"""Re-reads stored `bench fileio` results (their points.csv) for the adaptive-against-better-mode
goal: by medians and round by round (as the report's two lines do), the misses of each, the
correlation of adaptive's and poll's rounds, the spread of each system's rounds, and the median
ratio against bindfs. With --simulate, how often two modes of equal speed miss 0.9 by chance
given the spread and correlation seen.

    scripts/fileio_rounds.py docs/bench/fileio-ram-rounds5 [more dirs...] [--simulate]
"""
import csv
import math
import random
import statistics as st
import sys


def load(d):
    rows = list(csv.DictReader(open(f"{d}/points.csv")))
    # Results from before `--rounds` carry one total a point.
    return {(r["system"], r["mode"], int(r["threads"])): [float(x) for x in (r.get("rounds_mibs") or r["total_mibs"]).split(";")] for r in rows}


def main(dirs, simulate):
    logs, cors = [], []
    for d in dirs:
        m = load(d)
        by_med, by_round, miss_med, miss_round, dcors = 0, 0, [], [], []
        for (s, mode, t), a in sorted(m.items()):
            if s != "bulkhead-ram-adaptive":
                continue
            p, i = m[("bulkhead-ram-poll", mode, t)], m[("bulkhead-ram-irq", mode, t)]
            r1 = st.median(a) / max(st.median(p), st.median(i))
            per = [x / max(y, z) for x, y, z in zip(a, p, i)]
            r2 = st.median(per)
            logs += [math.log(x) for x in per]
            by_med += r1 >= 0.9
            by_round += r2 >= 0.9
            if r1 < 0.9:
                miss_med.append(f"{mode} {t} {r1:.3f}")
            if r2 < 0.9:
                miss_round.append(f"{mode} {t} {r2:.3f}")
            if len(a) > 2:
                dcors.append(st.correlation(a, p))
        cors += dcors
        spread = {}
        for (s, _, _), v in m.items():
            spread.setdefault(s, []).append((max(v) - min(v)) / st.median(v))
        hop = [st.median(v) / st.median(m[("bindfs", mo, t)]) for (s, mo, t), v in m.items() if s == "bulkhead-ram-adaptive" and ("bindfs", mo, t) in m]
        print(d)
        print(f"  within 10% by medians: {by_med} of 36, misses: {', '.join(miss_med) or '-'}")
        print(f"  within 10% round by round: {by_round} of 36, misses: {', '.join(miss_round) or '-'}")
        if dcors:
            print(f"  mean correlation of adaptive's and poll's rounds: {st.mean(dcors):.2f}")
        print("  spread of rounds, median point: " + ", ".join(f"{s} {100 * st.median(v):.0f}%" for s, v in spread.items()))
        if hop:
            print(f"  adaptive against bindfs: median {st.median(hop):.2f}x")
    sd = st.stdev(logs)
    print(f"all: adaptive / better mode in the same round, geometric mean {math.exp(st.mean(logs)):.3f}, sd of log {sd:.3f}")
    if simulate:
        rho = st.mean(cors)
        s = sd / math.sqrt(2 * (1 - rho))
        rng = random.Random(1)
        for n in (3, 5):
            med = pair = 0
            trials = 20000
            for _ in range(trials):
                a, p = [], []
                for _ in range(n):
                    c = rng.gauss(0, 1)
                    a.append(s * (math.sqrt(rho) * c + math.sqrt(1 - rho) * rng.gauss(0, 1)))
                    p.append(s * (math.sqrt(rho) * c + math.sqrt(1 - rho) * rng.gauss(0, 1)))
                med += st.median(a) - st.median(p) < math.log(0.9)
                pair += st.median([x - y for x, y in zip(a, p)]) < math.log(0.9)
            print(f"equal modes, {n} rounds (correlation {rho:.2f}): miss by medians {med / trials:.3f}, round by round {pair / trials:.3f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--simulate"]
    if not args:
        sys.exit(__doc__)
    main(args, "--simulate" in sys.argv[1:])
