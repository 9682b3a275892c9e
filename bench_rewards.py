"""How fast the verifiers score (SPEC W1): python bench_rewards.py

Scores a batch of 1,000 realistic Countdown completions (right, wrong, malformed, long rambling)
several times and prints the median, plus the per-call cost of the math and code verifiers.
"""

import statistics
import time

from data.countdown import countdown_problems
from rewards import code_reward, math_reward, score_batch


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
    seconds = timed(lambda: score_batch(texts, batch, lengths), repeats=7)
    print(f"countdown: 1000 completions in {seconds * 1e3:.1f} ms ({seconds * 1e6 / 1000:.1f} us each), one core")
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
