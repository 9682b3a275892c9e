"""Two runs' metrics.jsonl side by side: equal except times and memory, or the first difference.

    python -m dev.compare_runs out/before out/after          # e.g. a fixed-seed tiny run before and after a refactor
    python -m dev.compare_runs out/before out/after --steps 3 --rel 1e-6

A refactor keeps behaviour: with the same seed and settings every logged value of every step must
match (times and memory excepted, they measure the machine). Exits 1 on the first mismatch.
"""

import argparse
import json
import math
import os
import sys

IGNORED = ("time/", "mem/")  # what the machine, not the algorithm, decides


def read(path, steps):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:steps] if steps else rows


def differences(a, b, rel=0.0):
    """(step, key, value a, value b) for every logged value that differs beyond `rel`, times and memory excepted."""
    out = []
    if len(a) != len(b):
        out.append((None, "steps", len(a), len(b)))
    for ma, mb in zip(a, b):
        keys = {k for k in ma.keys() | mb.keys() if not k.startswith(IGNORED)}
        for k in sorted(keys):
            x, y = ma.get(k, "missing"), mb.get(k, "missing")
            same = x == y
            if not same and isinstance(x, (int, float)) and isinstance(y, (int, float)):
                same = math.isclose(x, y, rel_tol=rel, abs_tol=0.0)
            if not same:
                out.append((ma.get("step"), k, x, y))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--steps", type=int, default=0, help="compare the first N steps only; 0 = all")
    parser.add_argument("--rel", type=float, default=0.0, help="relative tolerance; 0 = identical values")
    args = parser.parse_args()
    diffs = differences(read(args.a, args.steps), read(args.b, args.steps), args.rel)
    for step, key, x, y in diffs[:20]:
        print(f"step {step}: {key}: {x!r} != {y!r}")
    n = len(read(args.a, args.steps))
    print(f"{n} steps compared: {'identical' if not diffs else f'{len(diffs)} differences'} (times and memory ignored)")
    sys.exit(1 if diffs else 0)
