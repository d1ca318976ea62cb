#!/usr/bin/env python3
"""The spread behind the adaptive-against-better-mode goal of stored `bench fileio` runs (their
points.csv): the correlation of adaptive's and poll's rounds, the spread of each system's rounds,
and adaptive over the better mode in the same round across all points and runs. With --simulate,
how often two modes of equal speed miss 0.9 by chance given the spread and correlation seen.

The goals themselves, with their misses, come from `bulkhead-bench fileio --from DIR`.

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
        dcors = []
        for (s, mode, t), a in sorted(m.items()):
            if s != "bulkhead-ram-adaptive":
                continue
            p, i = m[("bulkhead-ram-poll", mode, t)], m[("bulkhead-ram-irq", mode, t)]
            logs += [math.log(x / max(y, z)) for x, y, z in zip(a, p, i)]
            if len(a) > 2:
                dcors.append(st.correlation(a, p))
        cors += dcors
        spread = {}
        for (s, _, _), v in m.items():
            spread.setdefault(s, []).append((max(v) - min(v)) / st.median(v))
        print(d)
        if dcors:
            print(f"  mean correlation of adaptive's and poll's rounds: {st.mean(dcors):.2f}")
        print("  spread of rounds, median point: " + ", ".join(f"{s} {100 * st.median(v):.0f}%" for s, v in spread.items()))
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
