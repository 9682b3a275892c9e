"""A calculator environment: multiply two numbers, with a calculator one turn away.

    python grpo.py --config config/calculator.py

The model may write `calc: 37 * 58` on a turn; the environment answers `= 2146` and says to write
the answer next (a user message, context only: no gradient; without that line SmolLM2-135M called
but never answered, docs/tools.md). A turn with `answer: N` ends the episode: correct 1 when N is
the product. The first calculation whose value is the product earns calculated 0.1, once an episode,
and an answer after it 0.1 more (the path to the answer, a step at a time; correct or not).
The prompt shows the line to write: what a small model learns here is the protocol (end the turn
after the call, read the value, copy it into the answer), not which numbers to multiply. A turn
with neither is told how to use the calculator, and costs nothing (a cost per turn would make one
long turn that runs out the token budget pay). The turns' rewards are summed (env_reward="sum").
The environment evaluates arithmetic itself (numbers and + - * / only), never the model's text as
Python.
"""

import ast
import operator
import random
import re

from data.split import in_split

CALC = re.compile(r"calc:\s*([-+*/().\d\s]+)", re.I)
ANSWER = re.compile(r"answer:\s*(-?\d+)", re.I)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.USub: operator.neg}


def problems(split, n, seed):
    rng, out, i = random.Random(f"calculator:{split}:{seed}"), [], 0
    while len(out) < n:
        key = f"calculator:{seed}:{i}"
        if in_split(key, split):
            out.append({"id": key, "a": rng.randint(11, 99), "b": rng.randint(11, 99)})
        i += 1
    return out


def prompt(problem):
    a, b = problem["a"], problem["b"]
    return [{"role": "user", "content": f"What is {a} * {b}? You have a calculator: write "
                                        f"'calc: {a} * {b}' and stop, and I will reply with its "
                                        "value. Then write 'answer: <number>'."}]


def arithmetic(text):
    """The value of + - * / over numbers, from the syntax tree (no eval); ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 1e12:
                raise ValueError("too large")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * /")

    if len(text) > 100:
        raise ValueError("too long")
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


class Calculator:
    def __init__(self, a, b):
        self.product, self.calculated = a * b, False

    def reset(self):
        self.calculated = False
        return None

    def step(self, action):
        answer = ANSWER.search(action)
        if answer:
            digits = answer.group(1)  # a long answer is a wrong one; int() refuses 4,300+ digits
            right = len(digits) <= 40 and int(digits) == self.product
            # an answer after the product was calculated: the step between the call and the copy
            return None, {"correct": float(right), "calculated": 0.1 * self.calculated}, True
        call = CALC.search(action)
        if not call:
            return ("Write 'calc: <expression>' to use the calculator, or 'answer: <number>'.",
                    {"correct": 0.0, "calculated": 0.0}, False)
        try:
            result = arithmetic(call.group(1))
        except ValueError as e:
            return f"error: {e}", {"correct": 0.0, "calculated": 0.0}, False
        bonus = 0.1 if result == self.product and not self.calculated else 0.0
        self.calculated = self.calculated or result == self.product
        value = int(result) if float(result).is_integer() else round(result, 6)
        said = f"= {value}\nWrite 'answer: <number>' when you know it."
        return said, {"correct": 0.0, "calculated": bonus}, False


def environment(problem):
    return Calculator(problem["a"], problem["b"])
