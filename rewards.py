"""Rule-based verifiers (W1-W6): Countdown, math and code, and the shaping every task's reward gets.

A policy finds every hole in a reward, so every verifier here assumes adversarial input: answers
are found with str.rfind (no regex that can backtrack for minutes on 100 KB of tags), Countdown
expressions are parsed with `ast` and evaluated by our own 15-line tree walk (never `eval`),
sympy runs in a child process with a deadline, and code runs in the sandbox (sandbox.py), which
never sees a test's expected values.

Per completion, each verifier returns a dict of components, all floats:
    format   1.0 if the text is exactly <think>...</think><answer>...</answer> with a non-empty answer (W2)
    parsed   1.0 if an answer was found and is well-formed for the task
    correct  1.0 / 0.0 (code: the fraction of tests passed)
The task files in tasks/ call these verifiers (task.py loads them); `score_batch` turns a batch's
components into one shaped reward per completion (W2-W3), whatever the task.

    python task.py --replay out/run/samples.jsonl   # re-score saved rollouts, print disagreements (W5)
"""

import ast
import builtins
import json
import math
import multiprocessing
import re
from fractions import Fraction

import torch

from sandbox import run_tests

MAX_ANSWER_CHARS = 256  # longer answers are not parsed at all: no real answer here is that long


# ---------------------------------------------------------------- extraction and format (W2, W4)


def extract_answer(text):
    """The content of the last <answer>...</answer> that is not inside a think block, stripped; else None.

    Nested or repeated tags cannot score twice: only the last closing tag and the nearest opening
    tag before it count, so '<answer><answer>1</answer></answer>' yields '1</answer>', which no
    verifier accepts (W4).
    """
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    if text.rfind("<think>", 0, start) > text.rfind("</think>", 0, start):
        return None  # an answer inside an unclosed think block is thinking, not answering
    return text[start + len("<answer>") : end].strip()


def has_format(text):
    """W2: exactly one <think>...</think> then exactly one non-empty <answer>...</answer>, nothing after."""
    t = text.strip()
    if not (t.startswith("<think>") and t.endswith("</answer>")):
        return False
    if any(t.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return False
    think_end, answer_start = t.index("</think>") + len("</think>"), t.index("<answer>")
    if think_end > answer_start or t[think_end:answer_start].strip():
        return False
    return extract_answer(t) not in (None, "")  # W4: empty answer, no credit


# ---------------------------------------------------------------- Countdown (W1)

COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/() ]+")  # ASCII only: \d would also match unicode digits
COUNTDOWN_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
                 ast.Div: Fraction.__truediv__}


def _countdown_eval(node, numbers):
    """Exact value of an ast of integer literals and binary + - * /; appends each literal to `numbers`.

    Returns None if the tree divides by zero anywhere (after visiting every literal, so the numbers
    are still checked). Raises ValueError on anything else (names, calls, **, //, unary minus, floats).
    """
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in COUNTDOWN_OPS:
        left, right = _countdown_eval(node.left, numbers), _countdown_eval(node.right, numbers)
        if left is None or right is None or (type(node.op) is ast.Div and right == 0):
            return None
        return COUNTDOWN_OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in Countdown: {type(node).__name__}")


def countdown_reward(text, numbers, target):
    """Countdown: the answer uses each given number exactly once with + - * / ( ), and equals target.

    Example: countdown_reward("<think>..</think><answer>(6 - 2) * 5</answer>", [2, 5, 6], 20)
    -> {"format": 1.0, "parsed": 1.0, "numbers_valid": 1.0, "correct": 1.0}
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "numbers_valid": 0.0, "correct": 0.0}
    answer = extract_answer(text)
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return out
    answer = " ".join(answer.split())  # newlines and tabs inside the tag are just spaces
    if not COUNTDOWN_CHARS.fullmatch(answer):
        return out
    used = []
    try:
        value = _countdown_eval(ast.parse(answer, mode="eval").body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return out  # malformed, or an operation Countdown does not allow
    out["parsed"] = 1.0  # a well-formed equation; one that divides by zero (value None) cannot be correct
    out["numbers_valid"] = float(sorted(used) == sorted(numbers))
    if out["numbers_valid"] and value is not None:
        out["correct"] = float(abs(value - target) < Fraction(1, 100000))  # within 1e-5 (W1)
    return out


# ---------------------------------------------------------------- math (W1)


def last_boxed(text):
    """Content of the last \\boxed{...} with balanced braces, or None (unbalanced counts as none)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


LATEX_REPLACEMENTS = [
    (r"\\[dt]frac", r"\\frac"), (r"\\left|\\right|\\!|\\,|\\;|\$", ""), (r"\\text\{[^{}]*\}", ""),
    (r"\\cdot|\\times", "*"), (r"\\pi", "pi"), (r"\^", "**"), (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
]


def normalize_math(s):
    """LaTeX-ish answer -> a plain expression string: '\\frac{1}{2}' -> '(1)/(2)', '1,000' -> '1000'."""
    s = s.strip().rstrip(".")
    for pattern, repl in LATEX_REPLACEMENTS:
        s = re.sub(pattern, repl, s)
    while "\\frac{" in s:  # innermost first: \frac{a}{b} with brace-free a and b
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
        if new == s:
            break
        s = new
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    return re.sub(r"(?<=[\d)])(?=[a-z(])", "*", s)  # implicit products: 2x -> 2*x, (a)(b) -> (a)*(b)


def as_fraction(s):
    """'3', '-0.25', '(1)/(2)', '-(9)/(4)', '7/2' -> Fraction, else None: a plain number, exactly."""
    m = re.fullmatch(r"(-?)\(?(-?\d+(?:\.\d+)?)\)?(?:/\(?(-?\d+(?:\.\d+)?)\)?)?", s)
    if not m:
        return None
    num, den = Fraction(m.group(2)), Fraction(m.group(3) or 1)
    return (-1 if m.group(1) else 1) * num / den if den else None


def in_lowest_terms(s):
    """False for a normalised fraction of whole numbers that can be reduced ('(4)/(6)', '8/4', '3/1'); else True."""
    m = re.fullmatch(r"-?\(?(-?\d+)\)?/\(?(-?\d+)\)?", s)
    if not m:
        return True  # a whole number or a decimal
    num, den = int(m.group(1)), int(m.group(2))
    return math.gcd(num, den) == 1 and abs(den) != 1


def before_unclosed_think(text):
    """The text before a <think> that is never closed: what follows it is thinking, not answering (W4)."""
    start = text.rfind("<think>")
    return text[:start] if start >= 0 and text.find("</think>", start) < 0 else text


def after_tool_outputs(text, tags=("<output>", "</output>")):
    """The model's own text after the last tool output (rollout.TOOL_OUTPUT's tags): the only place a tool task's
    answer is judged, so what a tool printed never counts as the model's answer. Text without an output is
    returned whole; an output never closed leaves nothing (all after its opening tag is the tool's). A <think>
    open where the last output ends stays open ("<think>" put in front), so an answer inside it is still
    thinking (W4).
    """
    end = text.rfind(tags[1])
    cut = end + len(tags[1]) if end >= 0 else 0
    own = text[cut:]
    if tags[0] in own:
        return ""
    thinking = text.rfind("<think>", 0, cut) > text.rfind("</think>", 0, cut)
    return "<think>" + own if thinking else own


# a number, with thousands separators read whole ("1,234" is 1234, not 234)
LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")

SYMPY_NAMES = {"sqrt", "pi", "x", "y", "z", "n", "a", "b", "c", "k"}


def _sympy_equal(a, b, conn):
    """Child process: send whether a - b simplifies to 0."""
    import sympy

    try:
        diff = sympy.sympify(a, locals={}) - sympy.sympify(b, locals={})
        conn.send(bool(sympy.simplify(diff) == 0))
    except Exception:
        conn.send(False)


def symbolic_equal(a, b, timeout=2.0):
    """a == b by sympy, in a forked child killed after `timeout` s (sympy can hang on adversarial input)."""
    for s in (a, b):  # sympify evaluates Python: admit only arithmetic and a few known names
        if len(s) > 100 or not re.fullmatch(r"[0-9a-z+\-*/().]*", s) or "__" in s or not re.search(r"[0-9a-z]", s):
            return False  # not arithmetic over known names (e.g. a copied "...")
        if set(re.findall(r"[a-z]+", s)) - SYMPY_NAMES:
            return False
    import sympy  # noqa: F401  (imported before the fork, so the child never imports under a lock)

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sympy_equal, args=(a, b, child), daemon=True)
    proc.start()
    result = parent.recv() if parent.poll(timeout) else False
    proc.kill()
    proc.join()
    return result


def math_reward(text, answer, last_number=False, tools=False):
    """Math: the last \\boxed{} (else the <answer> content) equals `answer`, exactly or by sympy.

    last_number: with no box and no tag, judge the last number in the text instead (lm-eval's
    "flexible extract"); `parsed` stays 0 then, so unparsed_penalty still asks for a tagged answer.
    tools: the box, the tag and the last number are looked for only in the model's own text after the last
    tool output (after_tool_outputs); the format is still the whole completion's.

    Example: math_reward("<think>..</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5")
    -> {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    own = after_tool_outputs(text) if tools else text
    tagged = extract_answer(own)
    given = last_boxed(tagged if tagged is not None else before_unclosed_think(own))
    if given is None:
        given = tagged
    if given is None and last_number:
        numbers = LAST_NUMBER.findall(before_unclosed_think(own)[-2000:])
        fa = as_fraction(numbers[-1].replace(",", "")) if numbers else None
        return {**out, "correct": float(fa is not None and fa == as_fraction(normalize_math(str(answer))))}
    if not given or len(given) > MAX_ANSWER_CHARS:
        return {**out, "format": 0.0}  # W4: an empty \boxed{} or <answer> scores nothing, not even format
    got, want = normalize_math(given), normalize_math(str(answer))
    if as_fraction(want) is not None:
        # W4: a numeric reference needs a number, compared exactly. "13+14" restates "what is 13 + 14?",
        # and a copied "\boxed{...}" from the prompt is no answer: neither earns parsed or format credit.
        if as_fraction(got) is None:
            return {**out, "format": 0.0}
        # a fraction counts only in lowest terms, the form the prompt asks for: 4/6 is not 2/3's answer
        exact = as_fraction(got) == as_fraction(want) and in_lowest_terms(got)
        out["parsed"], out["correct"] = 1.0, float(exact)
    else:
        out["parsed"], out["correct"] = 1.0, float(got == want or symbolic_equal(got, want))
    return out


def math_answer(text, last_number=False, tools=False):
    """The answer math_reward judges, as a key for a majority vote (maj@n), or None: a number as
    its exact value ('0.50', '\\frac{1}{2}', '\\boxed{1/2}' -> '1/2'; a fraction not in lowest
    terms, which math_reward rejects, keeps its own key), anything else as normalize_math's text.
    """
    own = after_tool_outputs(text) if tools else text
    tagged = extract_answer(own)
    given = last_boxed(tagged if tagged is not None else before_unclosed_think(own))
    if given is None:
        given = tagged
    if given is None and last_number:
        numbers = LAST_NUMBER.findall(before_unclosed_think(own)[-2000:])
        given = numbers[-1].replace(",", "") if numbers else None
    if not given or len(given) > MAX_ANSWER_CHARS:
        return None
    got = normalize_math(given)
    value = as_fraction(got)
    return str(value) if value is not None and in_lowest_terms(got) else got


# ---------------------------------------------------------------- code (W1)


def last_code_block(text):
    """The last ```...``` block with its language line dropped, or None (rfind: linear on any input)."""
    end = text.rfind("```")
    start = text.rfind("```", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    first_line, _, body = text[start + 3 : end].partition("\n")
    return body if first_line.strip() in ("", "python", "py", "python3") else None


class _Inside(ast.NodeTransformer):
    """Replaces each largest part of an assert that only the sandbox can compute by a name, __v0...

    A part goes inside when it uses a name of the code's or the setup's (any name but a builtin,
    one the test imports, or a lambda's or comprehension's own) and holds no value of the test's
    outside a call of the code's: in `abs(f(x) - 1.5) < 1e-9` that is `f(x)`, so the code never
    sees 1.5 or 1e-9.
    """

    OPERATIONS = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List,
                  ast.Set, ast.Dict, ast.Starred)
    SPLIT = (*OPERATIONS, ast.Call, ast.Subscript)  # may be split into their parts
    PARTS = (ast.Starred, ast.Slice, ast.FormattedValue)  # no values of their own
    PLAIN = {"abs", "all", "any", "bool", "dict", "float", "int", "len", "list", "max", "min",
             "repr", "round", "set", "sorted", "str", "sum", "tuple"}  # builtins with plain values

    def __init__(self, trusted, steps):
        self.trusted, self.steps = trusted, steps

    def uses(self, node):
        return any(isinstance(n, ast.Name) and n.id not in self.trusted for n in ast.walk(node))

    def whole(self, node):
        """True if all of `node` (which uses the code's names) goes inside: a call, item or
        attribute of the code's (its arguments are inputs); an operation, or a builtin call, whose
        every operand does (a builtin with a plain value, or one given a comprehension or lambda
        over the code's names, which only the sandbox can compute); what cannot be split."""
        if isinstance(node, ast.Call) and not self.uses(node.func):
            parts = [*node.args, *(k.value for k in node.keywords)]
            named = isinstance(node.func, ast.Name) and node.func.id in self.PLAIN
            if not named and all(isinstance(p, (*self.SPLIT, ast.Attribute)) for p in parts):
                return False  # e.g. type(f(x)): computed here, from the value f returned
        elif isinstance(node, self.OPERATIONS):
            parts = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        else:
            return not isinstance(node, ast.Subscript) or self.uses(node.value)
        return all(self.uses(p) and self.whole(p) for p in parts)

    def visit(self, node):
        if not isinstance(node, ast.expr) or isinstance(node, self.PARTS):
            return self.generic_visit(node)
        if not self.uses(node):
            return node  # all the test's own: evaluated here
        if isinstance(node, self.SPLIT) and not self.whole(node):
            return self.generic_visit(node)
        name = f"__v{sum(kind == 'eval' for kind, _ in self.steps)}"
        self.steps.append(("eval", ast.unparse(node)))
        return ast.Name(name, ast.Load())


def _bound_locally(node):
    """The names a lambda or a comprehension in `node` binds for itself."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Lambda):
            a = n.args
            names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
            names |= {x.arg for x in (a.vararg, a.kwarg) if x}
        elif isinstance(n, ast.comprehension):
            names |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
    return names


def _as_json(x):
    """A value as a dataset's JSON holds it: tuples as lists; a set or a non-string key fails."""
    if type(x) in (list, tuple):
        return [_as_json(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _as_json(v) for k, v in x.items()}
    if type(x) in (dict, set):
        raise TypeError("not a JSON value")
    return x


def split_test(test):
    """A code test split at the sandbox's wall: (steps run inside, check(values) -> passed, here).

    The code under test never sees an expected value (W1): only inputs enter the sandbox.
    {"call": "add(1, 2)", "expected": 3}: the call is evaluated inside, its value compared here
    exactly (type and value; tuples as lists, as in JSON). An assert test, e.g.
    "x = [3, 1]\nassert f(x) == [1, 3]": its other statements run inside (inputs; its imports run
    here too) and each assert is split by _Inside: the parts that use the code's names are evaluated
    inside, the rest here, over their values. Raises SyntaxError on a test that does not parse.
    """
    if isinstance(test, dict):
        want = json.loads(json.dumps(test["expected"]))
        return [("eval", test["call"])], lambda values: _as_json(values[0]) == want
    steps, checks, scope = [], [], {}
    for statement in ast.parse(test).body:
        if isinstance(statement, ast.Assert):
            trusted = set(dir(builtins)) | set(scope) | _bound_locally(statement.test)
            checks.append(ast.unparse(_Inside(trusted, steps).visit(statement.test)))
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):  # the test's modules, here as there
            exec(compile(ast.Module([statement], []), "test", "exec"), scope)
        steps.append(("exec", ast.unparse(statement)))

    def check(values):
        names = {**scope, **{f"__v{i}": v for i, v in enumerate(values)}}
        return all(eval(c, names) for c in checks)  # the dataset's code: trusted, as the task file

    return steps, check


def code_reward(text, tests, timeout=5.0):
    """Code: run the last ```python block against `tests`; correct = fraction passed (W1).

    tests: a list of assert statements ("assert add(1, 2) == 3", setup lines allowed), or of
    {"call": "add(1, 2)", "expected": 3} checked exactly (type and value). Either way no expected
    value enters the sandbox (split_test); a test that does not parse, raises or fails scores 0.
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    code = last_code_block(extract_answer(text) or text)
    if not code or not tests:
        return out
    out["parsed"] = 1.0
    parts = []
    for test in tests:
        try:
            parts.append(split_test(test))
        except Exception:  # a malformed test, or an import it lacks here: it fails, as inside
            parts.append(([], None))
    passed = 0
    for (_, check), values in zip(parts, run_tests(code, [steps for steps, _ in parts], timeout)):
        try:
            passed += check is not None and values is not None and bool(check(values))
        except Exception:  # an assert that raises on the values the code returned
            pass
    out["correct"] = passed / len(tests)
    return out


# ---------------------------------------------------------------- the smoke-test task


def digits_reward(text):
    """A reward a random model can climb (config/tiny.py): the share of non-space characters that are digits."""
    chars = [c for c in text if not c.isspace()]
    share = sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
    return {"format": float(has_format(text)), "parsed": float(bool(chars)), "correct": share}


# ---------------------------------------------------------------- the shaping (W2, W3)

OWN_SETTINGS = ("correct", "format", "parsed")  # components weighed by their own settings, not by `weights`


def shape_reward(c, length, *, weights=None, format_weight=0.1, correct_weight=1.0, wrong_penalty=0.0,
                 unparsed_penalty=0.0, length_soft_limit=0, length_penalty=0.05, length_penalty_tokens=32,
                 length_min=0):
    """One scalar from a completion's components and its length in tokens.

    W2: correct_weight * correct + format_weight * format + the task's other components, each times its
        weight in `weights` (default 1, as TRL's reward_weights). With a "parsed" component, a parseable
        but wrong answer adds wrong_penalty (small, e.g. -0.1), an unparseable one unparsed_penalty
        (larger, e.g. -0.5). (A common blog reward gives 0.4 when the answer tag is missing, rewarding
        the missing answer; not here.)
    W3: past length_soft_limit tokens, -length_penalty per length_penalty_tokens started;
        below length_min tokens the reward is 0. Both 0 = off.
    Example: correct, well formatted, 100 tokens, defaults -> 1.1.
    """
    weights = weights or {}
    reward = correct_weight * c.get("correct", 0.0) + format_weight * c.get("format", 0.0)
    reward += sum(weights.get(k, 1.0) * v for k, v in c.items() if k not in OWN_SETTINGS)
    if "parsed" in c and c["parsed"] and c.get("correct", 0.0) < 1:
        reward += wrong_penalty
    if "parsed" in c and not c["parsed"]:
        reward += unparsed_penalty
    if length_soft_limit and length > length_soft_limit:
        reward -= length_penalty * math.ceil((length - length_soft_limit) / length_penalty_tokens)
    if length_min and length < length_min:
        reward = 0.0
    return reward


def score_batch(results, lengths, weights=None, **shaping):
    """Shape N scored completions. Returns (rewards (N,) float32, {component: (N,) float32}).

    results: per completion its components dict, or a string saying why the reward failed ("error",
    "timeout", ...; task.run_rewards). A failed completion scores exactly 0 (no shaping, no penalty) and is
    counted in components["errors"] (timeouts also in components["timeouts"]). A component some
    completions lack is 0 for them. lengths: N completion lengths in tokens; weights, shaping: shape_reward's.
    """
    failed = [isinstance(c, str) for c in results]
    rewards = [0.0 if f else shape_reward(c, n, weights=weights, **shaping)
               for c, f, n in zip(results, failed, lengths)]
    names = sorted({k for c, f in zip(results, failed) if not f for k in c})
    per_component = {k: torch.tensor([0.0 if f else c.get(k, 0.0) for c, f in zip(results, failed)]) for k in names}
    per_component["errors"] = torch.tensor([float(f) for f in failed])
    per_component["timeouts"] = torch.tensor([float(c == "timeout") for c in results])
    return torch.tensor(rewards, dtype=torch.float32), per_component

