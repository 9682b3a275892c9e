"""Multiplication a small model cannot do in its head, with a plain Python function as its tool.

    python grpo.py --config config/multiply_call.py

The TOOLS task: `multiply` below is the tool, its type hints and docstring its schema, which the
chat template lists in the system turn (config/tools_chatml.jinja for SmolLM2, whose own template
renders no tools). The model calls it as <tool_call>{"name": "multiply", "arguments": {...}}
</tool_call> (vLLM's hermes parser reads it), the result comes back as a tool message, and the
reward judges the number the model writes after the last result: the call is the way to it.
"""

import random

from data.split import in_split
from rewards import after_tool_outputs

PROMPT = ("What is {a} * {b}? Call the multiply tool, then end with \"The answer is\" and the "
          "number.")
# the model's turn opens with the call's tag, written by the prompt (a 135M model given the schema
# and a worked exchange still writes a <tool_response> of its own more often than a call); the
# call itself, its name and arguments, and the answer after its result are the model's
COMPLETION_PREFIX = "<tool_call>\n"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


TOOLS = [multiply]


def problems(split, n, seed):
    rng, out = random.Random(seed), {}
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if in_split(f"multiply_call:{a}:{b}", split):  # fixed, disjoint train and test problems
            out[a, b] = {"id": f"{a} * {b}", "a": a, "b": b, "answer": a * b}
    return list(out.values())


# one worked exchange first, as the default run's prompt has one; its numbers are no problem's
# (a's are 100..999, b's 10..99)
EXAMPLE = [
    {"role": "user", "content": PROMPT.format(a=1234, b=5)},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 1234, "b": 5}}}]},
    {"role": "tool", "name": "multiply", "content": "6170"},
    {"role": "assistant", "content": "The answer is 6170."},
]


def prompt(problem):
    return [*EXAMPLE, {"role": "user", "content": PROMPT.format(a=problem["a"], b=problem["b"])}]


def reward(completion, problem):
    """correct: the last number the model writes after the last tool result (anywhere, without
    one); called: it made a call (logged, weight 0)."""
    said = answer(completion, problem)
    return {"correct": float(said is not None and int(said) == problem["answer"]),
            "called": float("</tool_response>" in completion)}


WEIGHTS = {"called": 0.0}


def answer(completion, problem):
    """The last number the model itself writes after the tool's last result (never the result's)."""
    own = after_tool_outputs(completion, ("<tool_response>", "</tool_response>"))
    digits = "".join(ch if ch.isdigit() else " " for ch in own.replace(",", "")).split()
    return str(int(digits[-1])) if digits else None


def reference(problem):
    return f"The answer is {problem['answer']}."
