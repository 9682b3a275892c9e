"""Multiplication a small model cannot do in its head, with a Python tool it can call.

    python grpo.py --task=multiply

The tool task (config/multiply_tools.py, tools=True): the prompt says how to call the tool, the
model writes a ```python block, the sandbox's output comes back between <output> tags
(episodes/tools.py TextTools), and the reward judges the number the model itself writes after
the last output: copying the tool's answer is fine, leaving it in the tool's output is not.
"""

import random

from data.split import in_split
from rewards import after_tool_outputs

# The tool's format is the one a small model already writes: a ```python block
# (config/multiply_tools.py sets the tags). No concrete product in the prompt: a small model copies
# concrete numbers.
PROMPT = (
    "What is {a} * {b}? You can run Python: write a ```python code block that prints the result, "
    "and what it prints comes back to you between <output> and </output>. Then end with \"The "
    "answer is\" and the number."
)


def problems(split, n, seed):
    rng, out = random.Random(seed), {}
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if in_split(f"multiply:{a}:{b}", split):  # fixed, disjoint train and test problems
            out[a, b] = {"id": f"{a} * {b}", "a": a, "b": b, "answer": a * b}
    return list(out.values())


def prompt(problem):
    return [{"role": "user", "content": PROMPT.format(a=problem["a"], b=problem["b"])}]


def reward(completion, problem):
    """correct: the last number the model writes after the tool's last output
    (or anywhere, without one)."""
    said = answer(completion, problem)
    return {"correct": float(said is not None and int(said) == problem["answer"])}


def answer(completion, problem):
    """The last number the model itself writes (never one the tool printed, even in an output cut
    short): the answer the reward judges, and maj@n's vote."""
    own = after_tool_outputs(completion)
    digits = "".join(ch if ch.isdigit() else " " for ch in own.replace(",", "")).split()
    return str(int(digits[-1])) if digits else None


def reference(problem):
    return f"The answer is {problem['answer']}."
