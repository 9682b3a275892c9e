"""Write a Python function that passes hidden tests (D1, W1): a small set made locally.

    python grpo.py --task=code

Each problem asks for one function ("kth_largest(xs) returns the 2nd largest element ..."); its
tests are calls with inputs drawn from the problem's own seed and the expected values of its
reference solution (kept as "solution"), checked exactly by rewards.code_reward: the calls run in
the sandbox (scoring/), the expected values stay outside it. correct = the share of tests passed.
A dataset works the same (data_path, one row per problem):

    {"prompt": "Write add(a, b) that returns a + b.", "tests": ["assert add(1, 2) == 3"]}

with "tests" a list of assert tests (setup lines, asserts in a function or a loop), of
{"call": "add(1, 2)", "expected": 3} (exact, safer for training), or of {"stdin": ...,
"stdout": ...} for a program (APPS). MBPP's own columns map with
data_columns="text:prompt,test_list:tests"; its test_imports and test_setup_code run before each
test. A HumanEval row (prompt, test, entry_point, canonical_solution) needs no mapping: its test is
run as HumanEval's harness runs it, then check(entry_point). No test runs outside the sandbox
(execute.run_tests).
"""

import json
import random

from data.split import draw_distinct
from rewards import code_reward

RUNS_CODE = True  # the reward runs the model's code: it needs the sandbox (audit.check_sandbox)
PROMPT = (
    "Write a Python function {signature} that {task}. Think step by step inside <think> </think> "
    "tags, then give only the code, in a ```python block, inside <answer> </answer> tags."
)
ORDINALS = {1: "1st", 2: "2nd", 3: "3rd", 4: "4th", 5: "5th"}


def _ints(rng, lo=-20, hi=50, size=(3, 9)):
    return [rng.randint(lo, hi) for _ in range(rng.randint(*size))]


# Each kind: rng -> (what the function does, a reference solution's source, its arguments'
# generator, parameters). The expected values of the tests are the reference's outputs, so every
# problem is solvable by construction.
def _kth_largest(rng):
    k = rng.randint(1, 5)
    return (f"returns the {ORDINALS[k]} largest element of the list xs (duplicates count "
            f"separately; xs has at least {k} elements)",
            f"def kth_largest(xs):\n    return sorted(xs, reverse=True)[{k - 1}]",
            lambda r: (_ints(r, size=(k, k + 6)),), k)


def _sum_multiples(rng):
    m = rng.randint(2, 50)
    return (f"returns the sum of the positive integers below n that are multiples of {m}",
            f"def sum_multiples(n):\n    return sum(range({m}, n, {m}))",
            lambda r: (r.randint(0, 200),), m)


def _count_letter(rng):
    c = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return (f"returns how many times the letter '{c}' occurs in the string s",
            f"def count_letter(s):\n    return s.count({c!r})",
            lambda r: ("".join(r.choices("abcdefghij " + c * 3, k=r.randint(0, 20))),), c)


def _rotate(rng):
    k = rng.randint(1, 20)
    return (f"returns the list xs rotated left by {k} positions (wrapping around; [] stays [])",
            f"def rotate(xs):\n    k = {k} % len(xs) if xs else 0\n    return xs[k:] + xs[:k]",
            lambda r: (_ints(r, size=(0, 8)),), k)


def _clamp(rng):
    lo = rng.randint(-20, 20)
    hi = lo + rng.randint(1, 30)
    return (f"returns the list xs with every element below {lo} replaced by {lo} and every element "
            f"above {hi} replaced by {hi}",
            f"def clamp(xs):\n    return [min(max(x, {lo}), {hi}) for x in xs]",
            lambda r: (_ints(r, lo - 15, hi + 15),), (lo, hi))


def _digit_sum(rng):
    b = rng.randint(2, 16)
    return (f"returns the sum of the digits of the non-negative integer n written in base {b}",
            f"def digit_sum(n):\n    total = 0\n    while n:\n        n, d = divmod(n, {b})\n"
            "        total += d\n"
            "    return total", lambda r: (r.randint(0, 10**6),), b)


def _long_words(rng):
    k = rng.randint(1, 12)
    return (f"returns how many of the space-separated words of the string s have more than {k} "
            "letters",
            f"def long_words(s):\n    return sum(len(w) > {k} for w in s.split())",
            lambda r: (" ".join("x" * r.randint(1, 12) for _ in range(r.randint(0, 8))),), k)


def _mark_multiples(rng):
    a = rng.randint(2, 40)
    return (f"returns the list of the numbers 1 to n, each multiple of {a} replaced by the string "
            "'X'",
            "def mark_multiples(n):\n"
            f"    return ['X' if i % {a} == 0 else i for i in range(1, n + 1)]",
            lambda r: (r.randint(0, 30),), a)


KINDS = [_kth_largest, _sum_multiples, _count_letter, _rotate, _clamp, _digit_sum, _long_words,
         _mark_multiples]
TESTS_PER_PROBLEM = 5


def problems(split, n, seed):
    def make(rng):
        kind = rng.choice(KINDS)
        task, solution, draw_args, params = kind(rng)
        key = f"code:{kind.__name__.lstrip('_')}:{params}"
        scope = {}
        # our own reference source, never a completion (those run in the sandbox)
        exec(solution, scope)
        name = solution[4 : solution.index("(")]
        test_rng = random.Random(key)  # a problem's tests depend on the problem only
        tests = []
        for _ in range(TESTS_PER_PROBLEM):
            args = draw_args(test_rng)
            tests.append({"call": f"{name}({', '.join(json.dumps(a) for a in args)})",
                          "expected": scope[name](*args)})
        signature = solution[4 : solution.index(":")]
        return key, key, {"prompt": PROMPT.format(signature=signature, task=task), "tests": tests,
                          "solution": solution}

    return draw_distinct(split, n, seed, make)


def prompt(problem):
    return [{"role": "user", "content": problem["prompt"]}]


def tests_and_setup(problem):
    """(tests, setup) of a row: its "tests" and MBPP's test_imports + test_setup_code, or a
    HumanEval row's test then check(entry_point)."""
    if "tests" not in problem and "entry_point" in problem:  # HumanEval
        return [f"{problem['test']}\ncheck({problem['entry_point']})"], ""
    setup = "\n".join([*problem.get("test_imports", []), problem.get("test_setup_code", "")])
    return problem["tests"], setup


def reward(completion, problem):
    tests, setup = tests_and_setup(problem)
    return code_reward(completion, tests, setup=setup)


def reference(problem):
    """The reference solution ("solution"; MBPP's rows keep theirs as "code", HumanEval's the body
    after its prompt), else None."""
    solution = problem.get("solution") or problem.get("code")
    if "canonical_solution" in problem:
        solution = problem["prompt"] + problem["canonical_solution"]
    if not solution:
        return None
    return f"<think>Write it.</think><answer>```python\n{solution}\n```</answer>"


SHAPES = ({"call", "expected"}, {"stdin", "stdout"})  # the dict tests run_tests takes


def check(problem):
    """A dataset row: a non-empty "prompt" and a non-empty list of "tests" (assert strings,
    {call, expected} or {stdin, stdout}); MBPP's test_imports (strings) and test_setup_code; or
    HumanEval's test and entry_point."""
    if not isinstance(problem.get("prompt"), str) or not problem["prompt"].strip():
        raise ValueError('needs a non-empty string "prompt"')
    if "tests" not in problem and "entry_point" in problem:
        entry = str(problem["entry_point"])
        if not isinstance(problem.get("test"), str) or not entry.isidentifier():
            raise ValueError('a HumanEval row needs a string "test" and an "entry_point" name')
        return
    tests = problem.get("tests")
    if (not isinstance(tests, list) or not tests
            or not all(isinstance(t, str) or isinstance(t, dict) and set(t) in SHAPES
                       for t in tests)):
        raise ValueError('"tests" must be a non-empty list of assert strings, {call, expected} '
                         'or {stdin, stdout} objects')
    imports = problem.get("test_imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise ValueError('"test_imports" must be a list of import statements (strings)')
    if not isinstance(problem.get("test_setup_code", ""), str):
        raise ValueError('"test_setup_code" must be a string')
