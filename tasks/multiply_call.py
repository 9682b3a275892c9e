"""Multiplication a small model cannot do in its head, with plain Python functions as its tools.

    python grpo.py --config config/multiply_call.py

The TOOLS task: `add` and `multiply` below are the tools, their type hints and docstrings their
schemas, which the chat template lists in the system turn (config/tools_chatml.jinja for SmolLM2,
whose own template renders no tools). The model calls one as <tool_call>{"name": "multiply",
"arguments": {...}}</tool_call> (vLLM's hermes parser reads it), the result comes back as a tool
message, and the reward judges the number the model writes after the last result: the right call
is the way to it. The prompt's one worked exchange adds, so the base model, greedy, calls `add`
for a product too (pass@1 0.03): what it learns is to pick the tool the question needs.
"""

import random

from data.split import in_split
from rewards import after_tool_outputs

PROMPT = "What is {a} {op} {b}? Call a tool, then end with \"The answer is\" and the number."
# the model's turn opens with the call, up to the tool's name, written by the prompt (a 135M model
# given the schemas and a worked exchange writes a <tool_response> of its own, never a call); the
# tool's name, its arguments, and the answer after its result are the model's
COMPLETION_PREFIX = '<tool_call>\n{"name": "'


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


TOOLS = [add, multiply]


def problems(split, n, seed):
    rng, out = random.Random(seed), {}
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if in_split(f"multiply_call:{a}:{b}", split):  # fixed, disjoint train and test problems
            out[a, b] = {"id": f"{a} * {b}", "a": a, "b": b, "answer": a * b}
    return list(out.values())


# one worked exchange first, as the default run's prompt has one: a sum, with `add`; its numbers
# are no problem's (a's are 100..999, b's 10..99)
EXAMPLE = [
    {"role": "user", "content": PROMPT.format(a=1234, op="+", b=5)},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1234, "b": 5}}}]},
    {"role": "tool", "name": "add", "content": "1239"},
    {"role": "assistant", "content": "The answer is 1239."},
]


def prompt(problem):
    question = PROMPT.format(a=problem["a"], op="*", b=problem["b"])
    return [*EXAMPLE, {"role": "user", "content": question}]


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
