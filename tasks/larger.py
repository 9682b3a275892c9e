"""Your own task in one file: say which of two numbers is larger.

    python grpo.py --task=tasks/larger.py
"""

import random
import re

from data.split import in_split


def problems(split, n, seed):
    rng, pairs = random.Random(seed), {}
    while len(pairs) < n:
        a, b = rng.sample(range(1, 1000), 2)
        # fixed, disjoint train and test problems
        if in_split(f"larger:{min(a, b)}:{max(a, b)}", split):
            pairs[min(a, b), max(a, b)] = {"id": f"{a} or {b}", "a": a, "b": b}
    return list(pairs.values())


def prompt(problem):
    question = f"Which is larger, {problem['a']} or {problem['b']}? Answer with the number."
    return [{"role": "user", "content": question}]


def reward(completion, problem):
    said = [int(n) for n in re.findall(r"\d+", completion)]
    low, high = sorted((problem["a"], problem["b"]))
    # the last number is the answer; one that names both ("a or b", the question copied) is none
    right = bool(said) and said[-1] == high and low not in said
    return {"correct": float(right), "brief": 0.1 * (len(completion) < 40)}


# a completion that earns full reward (python -m episodes.task --audit tasks/larger.py)
def reference(problem):
    return str(max(problem["a"], problem["b"]))


def answer(completion, problem):  # optional: the number said, for the eval's majority vote (maj@n)
    numbers = re.findall(r"\d+", completion)
    return str(int(numbers[-1])) if numbers else None
