"""How fast the verifiers score (W1): python -m dev.bench_rewards [--before=REV]

Scores a batch of 1,000 realistic Countdown completions (right, wrong, malformed, long rambling)
several times through the task (tasks/countdown.py) and prints the median, in this process and in
forked children under reward_timeout (side by side: the deadline's cost), plus the per-call cost of
the math and code verifiers.

The math verifier is measured beside the one before math-verify (rewards.py at REV, default
BEFORE, loaded from git as a module): per call on each path, per step of the default run (64
completions of 2-digit sums, in this process and in a run's reward worker), and the agreement of
both with math-verify's own regression suite (tests/math_verify_cases.json).
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import tempfile
import time

from config import load_config
from data.arith import math_problems
from data.countdown import countdown_problems
from episodes.task import load_task, score
from rewards import code_reward, math_reward, score_batch, warm_math_verify
from scoring.runner import run_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "e080eb6"  # the last rewards.py whose math verifier ran sympy in a child process


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rewards_at(rev):
    """rewards.py at git revision `rev`, imported as a module of its own (None if git lacks it)."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:rewards.py"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = os.path.join(tempfile.mkdtemp(), "rewards_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("rewards_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def countdown():
    problems = countdown_problems("test", 250, seed=0)
    texts, batch = [], []
    for p in problems:
        sums = " and ".join(f"{n} + {m}" for n in p["numbers"] for m in p["numbers"])
        ramble = "Let me try " + sums * 20
        added = "+".join(map(str, p["numbers"]))
        texts += [f"<think>{ramble[:400]}</think><answer>{p['solution']}</answer>",  # right
                  f"<think>{ramble[:200]}</think><answer>{added}</answer>",  # often wrong
                  # malformed
                  f"<think>{ramble}</think><answer>{p['target']} = {p['solution']}</answer>",
                  ramble * 3]  # no answer, ~4 KB
        batch += [p] * 4
    lengths = [len(t) // 4 for t in texts]
    for label, overrides in (("in this process (reward_timeout=0)", ["--reward_timeout=0"]),
                             ("in a forked child (reward_timeout=10)", []),
                             ("in 2 forked children (reward_workers=2)", ["--reward_workers=2"])):
        cfg = load_config(overrides=["--task=countdown", *overrides])
        task = load_task(cfg)
        seconds = timed(lambda: score(task, texts, batch, lengths, cfg), repeats=7)
        print(f"countdown, {label}: 1000 completions in {seconds * 1e3:.1f} ms "
              f"({seconds * 1e6 / 1000:.1f} us each)")


def default_run_step():
    """64 completions as the default run writes them (README): 8 sums x 8 styles."""
    texts, problems = [], []
    for p in math_problems("train", 8, seed=0, kinds=("add",), max_number=25):
        q, s = p["question"], int(p["answer"])
        a, b = q.removeprefix("What is ").removesuffix("?").split(" + ")
        texts += [f"{a} + {b} = {s}\n\nThe final answer is \\boxed{{{s}}}.",  # seed 1 from step 25
                  f"{a} + {b} = {s + 1}\n\nThe final answer is \\boxed{{{s + 1}}}.",
                  f"{a} + {b} = {s}",  # seed 2: the bare sum, judged by its last number
                  f"<think>{a} plus {b}</think><answer>\\boxed{{{s}}}</answer>",
                  "<think> ... </think><answer>\\boxed{...}</answer>",  # the prompt's example
                  f"<answer>\\boxed{{{a} + {b}}}</answer>",  # the question, restated
                  f"So the answer is {s} apples, since we add the two numbers to get the total.",
                  "Let me think about this step by step. First I add the ones, then the tens."]
        problems += [p] * 8
    return texts, problems


def boxed(answer):
    return f"<think>w</think><answer>\\boxed{{{answer}}}</answer>"


def math_speed(versions):
    """Per call on each path, and per step of the default run."""
    calls = [("plain number, right", boxed("27"), "27", 2000),
             ("plain number, wrong", boxed("26"), "27", 2000),
             ("restated sum", boxed("13 + 14"), "27", 2000),
             ("last number", "13 + 14 = 27", "27", 2000),
             ("fraction", boxed("\\frac{3}{4}"), "0.75", 2000),
             ("symbolic (sympy / math-verify)", boxed("x^2+2x+1"), "(x+1)^2", 10)]
    for label, text, gold, repeats in calls:
        row = "  ".join(f"{name} {timed(lambda: fn(text, gold, True), repeats) * 1e6:9.0f} us"
                        for name, fn in versions)
        print(f"math per call, {label:31}: {row}")
    texts, problems = default_run_step()
    lengths = [len(t) // 4 for t in texts]
    # taken in turns, so a busy machine slows all alike; "none": a reward that only returns, the
    # cost of the worker itself (fork, pipe)
    versions = [*versions, ("none", lambda text, answer, last_number: {"correct": 0.0})]
    for timeout, where in ((0, "in this process"), (10.0, "in a reward worker (timeout 10 s)")):
        times = {name: [] for name, _ in versions}
        for _ in range(15):
            for name, fn in versions:
                start = time.perf_counter()
                results = run_rewards(lambda text, p: fn(text, p["answer"], True), texts, problems,
                                      timeout)
                score_batch(results, lengths)
                times[name].append(time.perf_counter() - start)
        row = "  ".join(f"{name} {statistics.median(t) * 1e3:6.2f} ms" for name, t in times.items())
        print(f"math per 64 completions (half a step of the default run), {where}: {row}")
    right = {name: sum(fn(t, p["answer"], True)["correct"] for t, p in zip(texts, problems))
             for name, fn in versions[:-1]}
    counts = "  ".join(f"{name} {n:.0f}" for name, n in right.items())
    print(f"math per step, right answers of the 64: {counts}")


def suite_agreement(versions):
    """Agreement with math-verify's own verdicts on its boxed regression cases."""
    with open(os.path.join(ROOT, "tests", "math_verify_cases.json")) as f:
        cases = json.load(f)["cases"]
    texts, golds = [c["completion"] for c in cases], [{"answer": c["gold"]} for c in cases]
    for name, fn in versions:
        for timeout, where in ((0, "in this process"), (10.0, "in a reward worker")):
            start = time.perf_counter()
            results = run_rewards(lambda text, p: fn(text, p["answer"]), texts, golds, timeout,
                                  quiet=True)
            agree = sum(isinstance(r, dict) and r["correct"] == c["math_verify"]
                        for r, c in zip(results, cases))
            errors = sum(isinstance(r, str) for r in results)
            print(f"math-verify's suite, {name:6}, {where:18}: agrees on {agree}/{len(cases)}, "
                  f"{errors} errors, {time.perf_counter() - start:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help="git revision of the rewards.py whose "
                        "math verifier to measure beside this one ('' = none)")
    args = parser.parse_args()
    before = rewards_at(args.before) if args.before else None
    if args.before and before is None:
        print(f"(no rewards.py at git revision {args.before}: the math verifier is measured alone)")
    countdown()
    warm_math_verify()
    versions = [("before", before.math_reward)] * (before is not None) + [("after", math_reward)]
    math_speed(versions)
    suite_agreement(versions)
    code = "<think>w</think><answer>```python\ndef add(a, b):\n    return a + b\n```</answer>"
    tests = ["assert add(1, 2) == 3", {"call": "add(2, 3)", "expected": 5}]
    code_reward(code, tests)  # the first call probes the sandbox once
    print(f"code, sandboxed: {timed(lambda: code_reward(code, tests), 10) * 1e3:.0f} ms per "
          "completion")


if __name__ == "__main__":
    main()
