"""Plot runs from their metrics.jsonl: reward, accuracy, KL, length, and where the time goes.

    python plot.py out/default_s1 out/default_s2 --out assets/default_run.png
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402

from log import PHASES  # noqa: E402  (the phases every step times)

PANELS = [  # (title, [(metric, label)])
    ("reward (train batch)", [("reward", "reward")]),
    ("accuracy", [("acc", "train batch"), ("eval/pass@1_greedy", "test pass@1 (greedy)"),
                  ("eval/pass@n", "test pass@n (T = train)"), ("eval/maj@n", "test maj@n")]),
    ("answer format",
     [("reward/parsed", "tagged answer (train)"), ("format", "think+answer layout (train)")]),
    ("KL", [("kl", "token KL to reference"), ("approx_kl_old", "KL(old || new)")]),
    ("response length (tokens)", [("response_length", "train batch")]),
    ("seconds per step (stacked)", "stack"),
]


def stacked_times(ax, rows):
    """Where each step's seconds went, phase on phase (from the time/* metrics of one run)."""
    timed = [r for r in rows if "time/step" in r]
    layers = [[r.get(f"time/{p}", 0.0) for r in timed] for p in PHASES]
    other = [max(r["time/step"] - sum(r.get(f"time/{p}", 0.0) for p in PHASES), 0.0) for r in timed]
    ax.stackplot([r["step"] for r in timed], *layers, other,
                 labels=PHASES + ["other (logging, overhead)"])


def read(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def resolve(rows, key):
    """'eval/pass@n' -> the run's pass@k of the largest k logged (k = eval_n); 'eval/maj@n' -> its
    maj@<eval_n>; any other key as it is."""
    if not key.endswith("@n"):
        return key
    stem = key[:-1]
    found = {k for r in rows for k in r if k.startswith(stem) and k[len(stem) :].isdigit()}
    return max(found, key=lambda k: int(k[len(stem) :]), default=key)


def series(rows, key):
    """(x, y) of one metric; eval points sit at the number of updates they measured."""
    x_key = "eval/updates" if key.startswith("eval/") else "step"
    points = [(r.get(x_key, r["step"]), r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="out_dir folders holding metrics.jsonl")
    parser.add_argument("--out", default="run.png")
    args = parser.parse_args()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, metrics) in zip(axes.flat, PANELS):
        if metrics == "stack":  # the first run's time budget
            stacked_times(ax, read(args.runs[0]))
            metrics = []
        for run in args.runs:
            rows = read(run)
            for wanted, label in metrics:
                key = resolve(rows, wanted)
                label = label.replace("@n", key[key.rfind("@") :]) if key != wanted else label
                x, y = series(rows, key)
                if x:
                    name = (f"{label} [{os.path.basename(run.rstrip('/'))}]" if len(args.runs) > 1
                            else label)
                    ax.plot(x, y, marker="o" if key.startswith("eval/") else None, markersize=3,
                            label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines or ax.collections:
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
