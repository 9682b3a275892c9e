"""Multiplication a small model cannot do in its head, with a Python tool it can call.   --task=multiply

The tool task (config/multiply_tools.py, tools=True): the prompt shows how to call the tool, the model
writes <python>print(...)</python>, the sandbox's output comes back between <output> tags (rollout.ToolEngine),
and the reward judges the number the model itself writes after the last output: copying the tool's
answer is fine, leaving it in the tool's output is not.
"""

import random

from data.split import in_split

# No product of the question's numbers in the example: a small model copies concrete numbers
PROMPT = (
    "What is {a} * {b}? You can run Python: write code between <python> and </python>, and what it prints "
    "comes back between <output> and </output>. For example:\n"
    "<python>print(12 * 34)</python>\n<output>\n408\n</output>\nThe answer is 408.\n"
    "Now answer: what is {a} * {b}? End with \"The answer is\" and the number."
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
    """correct: the last number the model writes after the tool's last output (or anywhere, without one)."""
    own = completion[completion.rfind("</output>") + len("</output>") :] if "</output>" in completion else completion
    digits = "".join(ch if ch.isdigit() else " " for ch in own.replace(",", "")).split()
    called = "<python>" in completion
    return {"correct": float(bool(digits) and int(digits[-1]) == problem["answer"]), "called": float(called)}


WEIGHTS = {"called": 0.0}  # logged (reward/called), not rewarded: the tool must pay off through correctness
