"""Plot runs from their metrics.jsonl: reward, accuracy, KL, length, and where the time goes.

    python -m run.plot out/default_s1 out/default_s2 --out assets/default_run.png
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from infra.log import PHASES  # noqa: E402  (the phases every step times)

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
                 labels=PHASES + ["other (logging, overhead)"],
                 colors=[f"C{i}" for i in range(len(PHASES))] + ["lightgray"])


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


STYLES = ["-", "--", ":", "-."]  # a panel's metrics by line style; each run keeps one colour


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="out_dir folders holding metrics.jsonl")
    parser.add_argument("--out", default="run.png")
    args = parser.parse_args()
    runs = {os.path.basename(run.rstrip("/")): read(run) for run in args.runs}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, metrics) in zip(axes.flat, PANELS):
        if metrics == "stack":  # the first run's time budget
            stacked_times(ax, read(args.runs[0]))
            metrics, title = [], f"{title}, {next(iter(runs))}" if len(runs) > 1 else title
        drawn, zero = {}, set()  # drawn: metric -> (line style, marker, label)
        for colour, (name, rows) in enumerate(runs.items()):
            for style, (wanted, label) in zip(STYLES, metrics):
                key = resolve(rows, wanted)
                label = label.replace("@n", key[key.rfind("@") :]) if key != wanted else label
                x, y = series(rows, key)
                if x and not any(y):  # 0 throughout (a layout the prompt does not ask for, KL(old
                    zero.add(wanted)  # || new) in one epoch): said in a note, not drawn
                elif x:
                    drawn.setdefault(wanted, (style, "o" if key.startswith("eval/") else None,
                                              label))
                    ax.plot(x, y, style, color=f"C{colour}", marker=drawn[wanted][1],
                            markersize=3)
        notes = [f"{label}: {'0 throughout' if wanted in zero else 'not logged'}"
                 for wanted, label in metrics if wanted not in drawn]
        if notes:  # the metrics no run drew
            ax.text(0.02, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=8, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        # the legend: each metric once (its line style, in black), then each run (its colour)
        handles = [Line2D([], [], linestyle=style, marker=marker, markersize=3, color="black",
                          label=label) for style, marker, label in drawn.values()]
        if drawn and len(runs) > 1:
            handles += [Line2D([], [], color=f"C{i}", label=name) for i, name in enumerate(runs)]
        if handles or ax.collections:
            ax.legend(handles=handles or None, fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
