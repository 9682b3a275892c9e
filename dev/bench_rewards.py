"""How fast the verifiers score (W1): python -m dev.bench_rewards

Scores a batch of 1,000 realistic Countdown completions (right, wrong, malformed, long rambling)
several times through the task (tasks/countdown.py) and prints the median, in this process and in
forked children under reward_timeout (side by side: the deadline's cost), plus the per-call cost of
the math and code verifiers.
"""

import statistics
import time

from config import load_config
from data.countdown import countdown_problems
from rewards import code_reward, math_reward
from task import load_task, score


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    problems = countdown_problems("test", 250, seed=0)
    texts, batch = [], []
    for p in problems:
        ramble = "Let me try " + " and ".join(f"{n} + {m}" for n in p["numbers"] for m in p["numbers"]) * 20
        texts += [f"<think>{ramble[:400]}</think><answer>{p['solution']}</answer>",  # right
                  f"<think>{ramble[:200]}</think><answer>{'+'.join(map(str, p['numbers']))}</answer>",  # often wrong
                  f"<think>{ramble}</think><answer>{p['target']} = {p['solution']}</answer>",  # malformed
                  ramble * 3]  # no answer, ~4 KB
        batch += [p] * 4
    lengths = [len(t) // 4 for t in texts]
    for label, overrides in (("in this process (reward_timeout=0)", ["--reward_timeout=0"]),
                             ("in a forked child (reward_timeout=10)", []),
                             ("in 2 forked children (reward_workers=2)", ["--reward_workers=2"])):
        cfg = load_config(overrides=["--task=countdown", *overrides])
        task = load_task(cfg)
        seconds = timed(lambda: score(task, texts, batch, lengths, cfg), repeats=7)
        print(f"countdown, {label}: 1000 completions in {seconds * 1e3:.1f} ms ({seconds * 1e6 / 1000:.1f} us each)")
    math_text = "<think>w</think><answer>\\boxed{\\frac{3}{4}}</answer>"
    print(f"math, exact path: {timed(lambda: math_reward(math_text, '0.75'), 200) * 1e6:.0f} us per completion")
    sym_text = "<think>w</think><answer>\\boxed{x^2+2x+1}</answer>"
    print(f"math, sympy path: {timed(lambda: math_reward(sym_text, '(x+1)^2'), 10) * 1e3:.0f} ms per completion")
    code = "<think>w</think><answer>```python\ndef add(a, b):\n    return a + b\n```</answer>"
    tests = ["assert add(1, 2) == 3", {"call": "add(2, 3)", "expected": 5}]
    code_reward(code, tests)  # the first call probes the sandbox once
    print(f"code, sandboxed: {timed(lambda: code_reward(code, tests), 10) * 1e3:.0f} ms per completion")


if __name__ == "__main__":
    main()
