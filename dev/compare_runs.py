"""Two runs side by side: equal except times and memory, or the first differences.

    python -m dev.compare_runs out/before out/after  # a fixed-seed run before and after a change
    python -m dev.compare_runs out/before out/after --steps 3 --rel 1e-6
    python -m dev.compare_runs out/on out/off --ignore tokens_computed,pad_frac,entropy

A refactor keeps behaviour: with the same seed and settings every logged value of every step must
match (times and memory excepted: they measure the machine), and so must the sample dumps and the
eval results, where the runs wrote them (samples.jsonl, eval.jsonl). Exits 1 on a mismatch.
A fast path that skips work is held to its plain path the same way, less the figures that measure
the work itself (--ignore: `tokens_computed`, `pad_frac`, and the means over the computed rows).
"""

import argparse
import json
import math
import os
import sys

IGNORED = ("time/", "mem/")  # what the machine, not the algorithm, decides
LOGS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")


def read(path, name, steps=0):
    """The records of one JSONL log (None if the run did not write it),
    the first `steps` metrics."""
    file = os.path.join(path, name)
    if not os.path.exists(file):
        return None
    with open(file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if steps and name != "eval.jsonl":
        rows = [r for r in rows if r.get("step", 0) < steps]
    return rows


def same(x, y, rel):
    """Equal values; numbers within `rel`; dicts and lists compared item by item."""
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k], rel) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(same(a, b, rel) for a, b in zip(x, y))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x != y:
        return math.isclose(x, y, rel_tol=rel, abs_tol=0.0)
    return x == y


def differences(a, b, rel=0.0, ignore=()):
    """(record, key, value a, value b) for every value that differs beyond `rel`, times, memory and
    the keys `ignore` excepted; a record is its step where it has one, else its line number."""
    out = []
    if len(a) != len(b):
        out.append((None, "records", len(a), len(b)))
    for i, (ra, rb) in enumerate(zip(a, b)):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith(IGNORED) and k not in ignore}
        for k in sorted(keys):
            x, y = ra.get(k, "missing"), rb.get(k, "missing")
            if not same(x, y, rel):
                out.append((ra.get("step", f"line {i + 1}"), k, x, y))
    return out


def compare(a, b, steps=0, rel=0.0, ignore=()):
    """{log name: differences} for every log either run wrote."""
    out = {}
    for name in LOGS:
        x, y = read(a, name, steps), read(b, name, steps)
        if x is None and y is None:
            continue
        if x is None or y is None:
            out[name] = [(None, "file", "present" if x is not None else "missing",
                          "present" if y is not None else "missing")]
        else:
            out[name] = differences(x, y, rel, ignore)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--steps", type=int, default=0, help="the first N steps only; 0 = all")
    parser.add_argument("--rel", type=float, default=0.0, help="relative tolerance; 0 = identical")
    parser.add_argument("--ignore", default="", help="comma-separated keys not compared")
    args = parser.parse_args()
    ignore = {k for k in args.ignore.split(",") if k}
    found = compare(args.a, args.b, args.steps, args.rel, ignore)
    for name, diffs in found.items():
        for step, key, x, y in diffs[:20]:
            print(f"{name}: step {step}: {key}: {x!r} != {y!r}")
        n = len(read(args.a, name, args.steps) or [])
        verdict = "identical" if not diffs else f"{len(diffs)} differences"
        skipped = ", ".join(["times", "memory", *sorted(ignore)])
        print(f"{name}: {n} records compared: {verdict} ({skipped} ignored)")
    sys.exit(1 if any(found.values()) else 0)
