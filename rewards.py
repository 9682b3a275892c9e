"""Rule-based verifiers (W1-W6): Countdown, math and code.

A policy finds every hole in a reward, so every verifier here assumes adversarial input: answers
are found with str.rfind (no regex that can backtrack for minutes on 100 KB of tags), Countdown
expressions are parsed with `ast` and evaluated by our own 15-line tree walk (never `eval`),
math answers are judged by math-verify (LaTeX to sympy, no `eval`) under a deadline and this
project's guards, in-process, and code runs in the sandbox (scoring/sandbox.py), which never sees a
test's expected values.

Per completion, each verifier returns a dict of components, all floats:
    format   1.0 if the text is exactly <think>...</think><answer>...</answer>, the answer not empty
             (W2)
    parsed   1.0 if an answer was found and is well-formed for the task
    correct  1.0 / 0.0 (code: the fraction of tests passed)
The task files in tasks/ call these verifiers (episodes/task.py loads them); score_batch (at the
end) turns a batch's components into one shaped reward per completion (W2-W3), whatever the task.

    python -m episodes.task --replay out/run/samples.jsonl  # re-score saved rollouts (W5)
"""

import ast
import logging
import math
import re
import sys
from fractions import Fraction

import torch

from scoring.execute import run_tests
from scoring.runner import OutOfTime, within

MAX_ANSWER_CHARS = 256  # longer answers are not parsed at all: no real answer here is that long


# ---------------------------------------------------------------- extraction and format (W2, W4)


def extract_answer(text):
    """The content of the last <answer>...</answer> that is not inside a think block, stripped;
    else None.

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
    """W2: exactly one <think>...</think> then exactly one non-empty <answer>...</answer>,
    nothing after."""
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
    """Exact value of an ast of integer literals and binary + - * /;
    appends each literal to `numbers`.

    Returns None if the tree divides by zero anywhere (after visiting every literal, so the numbers
    are still checked). Raises ValueError on anything else (names, calls, **, //, unary minus,
    floats).
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
    """Countdown: the answer uses each given number exactly once with + - * / ( ),
    and equals target.

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
    # a well-formed equation; one that divides by zero (value None) cannot be correct
    out["parsed"] = 1.0
    out["numbers_valid"] = float(sorted(used) == sorted(numbers))
    if out["numbers_valid"] and value is not None:
        out["correct"] = float(abs(value - target) < Fraction(1, 100000))  # within 1e-5 (W1)
    return out


# ---------------------------------------------------------------- math (W1)

# math-verify warns, once per process, that its own (signal.alarm) timeouts are off; a reward worker
# is a new process every batch, and `within` bounds each check instead
logging.getLogger("math_verify").setLevel(logging.ERROR)

MATH_TIMEOUT = 5.0  # s for one answer's whole check (both parses, the comparison); past it, wrong
MAX_BITS = 1 << 16  # an answer whose numbers may grow past 2**MAX_BITS is wrong, uncompared


def last_boxed(text):
    """Content of the last \\boxed{...} with balanced braces, or None
    (unbalanced counts as none)."""
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


# A plain number: 27, -0.25, 1,000 (commas only in threes), 7/2, \frac{7}{2}, \dfrac72
DECIMAL = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
FRACTION = re.compile(r"(-?)(?:(-?\d+)/(-?\d+)"
                      r"|\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}|\\[dt]?frac(\d)(\d))")


def _plain(s):
    """s without what never changes a plain number: $, \\text{}, spaces, \\! and \\, (LaTeX's thin
    spaces, as in 32,\\!349), {,} (a grouped comma: 14{,}916) and a full stop at the end. A space
    after a comma stays: "32, 349" is a list of two numbers."""
    s = re.sub(r"\\(?:text|textbf|mathbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)  # \textbf{27}
    s = re.sub(r"\\[!,;]\s*|\\?\$", "", s.replace("{,}", ","))
    return re.sub(r"(?<!,)\s+", "", s).rstrip(".")


def _fraction_parts(s):
    """(numerator, denominator) of a plain fraction ('7/2', '\\frac{9}{4}', '\\frac12'), or None."""
    m = FRACTION.fullmatch(_plain(s))
    if not m:
        return None
    num, den = (int(g) for g in m.groups()[1:] if g is not None)
    return (-num if m.group(1) else num), den


def as_fraction(s):
    """A plain number as written ('27', '-0.25', '1,000', '7/2', '\\frac{1}{2}', '$5$', '5.') ->
    Fraction, exactly; else None."""
    if DECIMAL.fullmatch(_plain(s)):
        return Fraction(_plain(s).replace(",", ""))
    parts = _fraction_parts(s)
    return Fraction(*parts) if parts and parts[1] else None


def in_lowest_terms(s):
    """False for a plain fraction that can be reduced ('4/6', '\\frac{8}{4}', '3/1'); else True."""
    parts = _fraction_parts(s)
    return parts is None or (math.gcd(*parts) == 1 and abs(parts[1]) != 1)


def before_unclosed_think(text):
    """The text before a <think> that is never closed: what follows it is thinking, not answering
    (W4)."""
    start = text.rfind("<think>")
    return text[:start] if start >= 0 and text.find("</think>", start) < 0 else text


def after_tool_outputs(text, tags=("<output>", "</output>")):
    """The model's own text after the last tool output (episodes.tools.TOOL_OUTPUT's tags): the only
    place a tool task's answer is judged, so what a tool printed never counts as the model's answer.
    Text without an output is returned whole; an output never closed leaves nothing (all after its
    opening tag is the tool's). A <think> open where the last output ends stays open ("<think>" put
    in front), so an answer inside it is still thinking (W4).
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

# An operation left undone, in what follows an answer's last "=": a sum, a difference, a product, a
# quotient sign, a root, a factorial, a sum or integral sign. Not a power (2^{10} and 10^3 are how
# people write numbers), nor x 10^k (scientific notation), nor a fraction (lowest terms decide).
RESTATED = re.compile(r"[+÷!]|(?<=[\w)}\]])\s*-|(?:\*|×|\\cdot|\\times)(?!\s*10\s*\^)"
                      r"|\\(?:div|sqrt|sum|prod|int|lim|binom|choose)")
LAST_EQUALS = re.compile(r"(?<![<>!\\])=")
# a unit or currency word after a number: "18 dollars", "12 square feet" (LaTeX's \text{cm} and the
# units math-verify knows it drops itself)
UNIT_WORDS = re.compile(r"(?<=[\d}%])\s+[A-Za-z]{2,}(?:\s+[A-Za-z]{2,}){0,2}\.?"
                        r"(?:\^\{?[23]\}?)?\s*$")


def _restated(given):
    """W4: True if what the answer ends on is an operation left undone: "13 + 14" restates "What is
    13 + 14?" (equal to 27, and no answer), "x = 13 + 14" too; "13 + 14 = 27" answers."""
    return bool(RESTATED.search(LAST_EQUALS.split(given)[-1]))


def _compact(s):
    """s as the copied-question check compares it: no spaces or $, one spelling of \\frac."""
    return re.sub(r"\s|\$|\\left|\\right|\\!|\\,|(?<=\\)[dt](?=frac)", "", s)


def _copied(given, question):
    """True if the answer is an expression (not a lone number or name) that the question holds word
    for word: 'Simplify $\\sqrt{50}$' is not answered by \\sqrt{50}, though the two are equal."""
    got = _compact(given)
    return bool(re.search(r"[-+*/^=<>\\]", got)) and got in _compact(question)


def _bits(x):
    """An upper bound on the bits of the numbers sympy may build evaluating x."""
    import sympy

    if x.is_Integer or x.is_Rational:
        return int(x.p).bit_length() + int(x.q).bit_length()
    if x.is_Float:
        return int(abs(x)).bit_length() + 53
    args = [_bits(a) for a in x.args if isinstance(a, sympy.Basic)] or [0]  # x, pi: no number
    if isinstance(x, (sympy.Pow, sympy.MatPow)) and not x.args[1].free_symbols:
        base, exponent = args
        if x.args[1].is_Number:
            return base * max(1, math.ceil(abs(x.args[1])))
        return base << exponent if exponent < 32 else MAX_BITS + 1  # 2**bits bounds the exponent
    combinatorial = (sympy.factorial, sympy.factorial2, sympy.binomial, sympy.gamma,
                     sympy.subfactorial, sympy.RisingFactorial, sympy.FallingFactorial)
    if isinstance(x, combinatorial) and not x.free_symbols:
        n = max(args)
        return n << n if n < 32 else MAX_BITS + 1  # n! has fewer than n * log2(n) bits
    return sum(args)


def _too_big(expr):
    """True where sympy could spend minutes in one C call (10^{10^{10}}, 1000000!), or on an
    operation a final answer does not hold (an unevaluated sum, product, integral, limit)."""
    import sympy

    if isinstance(expr, sympy.MatrixBase):  # a Matrix is no Basic: its entries are
        return any(_too_big(e) for e in expr)
    undone = (sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit, sympy.Derivative)
    return expr.has(*undone) or _bits(expr) > MAX_BITS


def _parse_gold(gold):
    """The gold answer as open-r1 and TRL read it: as written where it holds its own $...$ or
    \\boxed{}, else inside $...$, so a plain "x+1", "(2,3)", "\\frac12" or "1,000" parses as
    meant."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # plain text: "pi/2", "x**2" (math-verify reads sqrt(2) itself)
    if "\\" not in gold and "$" not in gold:
        gold = re.sub(r"\bpi\b", r"\\pi", gold).replace("**", "^")
    text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    # a gold that is a whole solution is read by its box first, as a completion is
    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(text, targets, extraction_mode="first_match", parsing_timeout=None)


def _value(expr):
    """What an answer states: the right side of its last relation ('x = 3' -> 3), else itself."""
    from math_verify.grader import is_relation, take_last_relation

    return take_last_relation(expr).rhs if is_relation(expr) else expr


def _judge(given, gold):
    """math_equal's comparison by math-verify (called under a deadline): True, False or None."""
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.grader import is_atomic_or_pct_atomic
    from sympy import Number

    golds = _parse_gold(gold)
    numeric = any(is_atomic_or_pct_atomic(g, Number) for g in golds)  # 27, 0.5, 50%
    if numeric and _restated(given):
        return None
    if numeric:
        given = UNIT_WORDS.sub("", given)
    # the answer is the box's content (or the tag's) already: math-verify reads it as a box
    answers = parse(f"\\boxed{{{given}}}", [LatexExtractionConfig(boxed_match_priority=0)],
                    parsing_timeout=None)
    exprs = [a for a in answers if not isinstance(a, str)]
    if not exprs or (numeric and all(_value(e).free_symbols for e in exprs)):
        return None  # no math in it, or a numeric reference answered by a name: no answer (W4)
    if any(_too_big(e) for e in exprs):
        return False
    return verify(golds, answers, timeout_seconds=None)


def math_equal(given, answer, question="", timeout=MATH_TIMEOUT):
    """Whether `given` (a box's or a tag's content) states `answer`: True, False, or None where it
    is no answer at all (parsed 0 in math_reward). `answer` is the gold as a dataset writes it
    ("27", "\\frac12", "x+1", "(2,3)", "#### 1,000": what follows ####).

    Plain numbers are compared exactly, here (the default run's answers: microseconds). Everything
    else is judged by math-verify (open-r1's and TRL's verifier), under this project's guards,
    which win where the two disagree:
    - a decimal is the number only exactly: 0.5 for 1/2, not 0.333333 for 1/3;
    - a fraction that could be reduced (4/6, \\frac{8}{4}, 3/1) is wrong where the gold is reduced:
      the gold is written in lowest terms, and the generated questions ask for them;
    - a numeric gold needs a number: a restated operation ("13 + 14" for 27, \\sqrt{4} for 2) or
      a name is no answer; a power (2^{10}), a mixed number (3\\frac12), x = 3, 50\\% (for 50 or
      0.5), a currency sign or a unit word ("\\$18", "18 dollars") are the number;
    - an expression copied from the question is no answer (_copied);
    - sets and lists of solutions are equal in any order; tuples, points and intervals are ordered;
    - the whole check stops after `timeout` s (wrong), in any thread; an answer that could grow
      numbers past 2**MAX_BITS or holds an unevaluated sum or integral is wrong, uncompared.
    """
    gold = str(answer).split("####")[-1].strip()
    want, got = as_fraction(gold), as_fraction(given)
    if want is not None and got is not None:
        return got == want and (in_lowest_terms(given) or not in_lowest_terms(gold))
    if want is not None and (not re.search(r"[\d\\]", given) or _restated(given)):
        return None  # at once: no number at all ("...", "x"), or an operation left undone
    if got is None and _copied(given, question):
        return None
    if "math_verify" not in sys.modules:
        warm_math_verify()
    try:
        # a plain number as math-verify reads it best: 11,\\!111 is 11111, not the set {11, 111}
        return within(timeout, _judge, given if got is None else str(got), gold)
    except (OutOfTime, Exception):  # math-verify catches its own errors; this, ours on odd parses
        return False


# one answer of each kind sympy builds lazily: a number, a polynomial, a tuple, an interval, a set,
# an equation, a percent, a power
WARM_UP = [("27", "27.0"), ("1+x", "x+1"), ("(1,2)", "(2,1)"), ("[1,2)", "[1,2)"),
           ("\\{1,2\\}", "\\{2,1\\}"), ("x=3", "3"), ("50\\%", "0.5"), ("2^{10}", "1024")]


def warm_math_verify():
    """Import math-verify and run one check of each kind, with no deadline (a few seconds, once per
    process): a first import cut short by the deadline would score right answers 0. A task's
    configure calls this, so the reward workers forked for every batch inherit it all; else each
    worker's first check pays it.
    """
    for given, gold in WARM_UP:
        _judge(given, gold)


def math_reward(text, answer, last_number=False, tools=False, question=""):
    """Math: the last \\boxed{} (else the <answer> content) states `answer` (math_equal).

    last_number: with no box and no tag, judge the last number in the text instead (lm-eval's
    "flexible extract"); `parsed` stays 0 then, so unparsed_penalty still asks for a tagged answer.
    tools: the box, the tag and the last number are looked for only in the model's own text after
    the last tool output (after_tool_outputs); the format is still the whole completion's.
    question: the problem's text, so an expression copied from it earns nothing.

    Example: math_reward("<think>..</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5")
    -> {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    own = after_tool_outputs(text) if tools else text
    tagged = extract_answer(own)
    given = last_boxed(tagged if tagged is not None else before_unclosed_think(own))
    if given is None and tagged is not None and "\\boxed" not in tagged:
        given = tagged  # a tag without a box (a box left open is no answer)
    if given is None and last_number:
        numbers = LAST_NUMBER.findall(before_unclosed_think(own)[-2000:])
        return {**out, "correct": float(bool(numbers) and bool(math_equal(numbers[-1], answer)))}
    if not given or len(given) > MAX_ANSWER_CHARS:
        # W4: an empty \boxed{} or <answer> scores nothing, not even format
        return {**out, "format": 0.0}
    verdict = math_equal(given, answer, question)
    if verdict is None:
        # W4: a copied "\boxed{...}", a restated question: neither earns parsed or format credit
        return {**out, "format": 0.0}
    return {**out, "parsed": 1.0, "correct": float(verdict)}


def math_answer(text, last_number=False, tools=False):
    """The answer math_reward judges, as a key for a majority vote (maj@n), or None: a number as
    its exact value ('0.50', '\\frac{1}{2}', '\\boxed{1/2}' -> '1/2'; a fraction not in lowest
    terms, which math_reward rejects, keeps its own key), anything else as its text without $,
    \\text{} and spaces (_plain). Quick and exact, no math-verify: it runs in the trainer, and two
    spellings of one expression ("x+1", "1+x") only split a vote.
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
    value = as_fraction(given)
    return str(value) if value is not None and in_lowest_terms(given) else _plain(given)


# ---------------------------------------------------------------- code (W1)


def last_code_block(text):
    """The last ```...``` block with its language line dropped, or None
    (rfind: linear on any input)."""
    end = text.rfind("```")
    start = text.rfind("```", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    first_line, _, body = text[start + 3 : end].partition("\n")
    return body if first_line.strip() in ("", "python", "py", "python3") else None


def code_reward(text, tests, timeout=5.0, setup=""):
    """Code: run the last ```python block against `tests`; correct = fraction passed (W1).

    tests: assert tests ("assert add(1, 2) == 3", setup lines, asserts in a function or a loop:
    HumanEval's `def check(candidate): ...` then `check(add)`), {"call": "add(1, 2)", "expected": 3}
    checked exactly (type and value), or {"stdin": "1 2", "stdout": "3"} for a program (APPS);
    `setup` (MBPP's test_imports and test_setup_code) runs before each assert test. No expected
    value enters the code's sandbox, and no test runs outside a sandbox (execute.run_tests); a test
    that does not parse, raises or fails scores 0.
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    code = last_code_block(extract_answer(text) or text)
    if not code or not tests:
        return out
    out["parsed"] = 1.0
    out["correct"] = sum(run_tests(code, tests, timeout, setup=setup)) / len(tests)
    return out


# ---------------------------------------------------------------- the smoke-test task


def digits_reward(text):
    """A reward a random model can climb (config/tiny.py):
    the share of non-space characters that are digits."""
    chars = [c for c in text if not c.isspace()]
    share = sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
    return {"format": float(has_format(text)), "parsed": float(bool(chars)), "correct": share}


# ---------------------------------------------------------------- shaping, every task (W2, W3)

# W2: the weights of the built-in verifiers' components; a task's WEIGHTS and reward_weights
# override them ("format:0.2"). "parsed" weighs nothing: it picks wrong_penalty or unparsed_penalty
WEIGHTS = {"correct": 1.0, "format": 0.1}


def shape_reward(c, length, *, weights=None, wrong_penalty=0.0, unparsed_penalty=0.0,
                 length_soft_limit=0, length_penalty=0.05, length_penalty_tokens=32, length_min=0):
    """One scalar from a completion's components and its length in tokens.

    W2: each component times its weight: `weights`, else WEIGHTS' (correct 1, format 0.1), else 1
        (as TRL's reward_weights). "format" is the <think>..</think><answer>..</answer> layout
        (rewards.has_format). "parsed" (the answer was in its box or tag) picks a penalty: a
        parsed, wrong answer adds wrong_penalty (small, e.g. -0.1), one with no box or tag
        unparsed_penalty (larger, e.g. -0.5), even where a last number was judged right (math's
        math_last_number). (A common blog reward gives 0.4 when the answer tag is missing,
        rewarding the missing answer; not here.)
    W3: past length_soft_limit tokens, -length_penalty per length_penalty_tokens started;
        below length_min tokens the reward is 0. Both 0 = off.
    Example: correct, well formatted, 100 tokens, defaults -> 1.1.
    """
    weights = {**WEIGHTS, **(weights or {})}
    # correct and format first, whatever order the task's dict has: the sum's float rounding is
    # the same in every task, and a fixed-seed run's rewards stay what they were
    reward = weights["correct"] * c.get("correct", 0.0) + weights["format"] * c.get("format", 0.0)
    reward += sum(weights.get(k, 1.0) * v for k, v in c.items()
                  if k not in ("correct", "format", "parsed"))
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
    "timeout", ...; scoring/runner.py run_rewards). A failed completion scores exactly 0 (no
    shaping, no penalty) and is counted in components["errors"] (timeouts also in
    components["timeouts"]). A completion every TRL reward function left out ("unscored") has reward
    NaN: group_advantages leaves it out of its group's baseline and gives it advantage 0, the logged
    means leave it out, as TRL does.
    A component some completions lack is 0 for them. lengths: N completion lengths in tokens;
    weights, shaping: shape_reward's.
    """
    failed = [isinstance(c, str) for c in results]
    rewards = [0.0 if f else math.nan if c.get("unscored") else
               shape_reward(c, n, weights=weights, **shaping)
               for c, f, n in zip(results, failed, lengths)]
    names = sorted({k for c, f in zip(results, failed) if not f for k in c})
    per_component = {k: torch.tensor([0.0 if f else c.get(k, 0.0) for c, f in zip(results, failed)])
                     for k in names}
    per_component["errors"] = torch.tensor([float(f) for f in failed])
    per_component["timeouts"] = torch.tensor([float(c == "timeout") for c in results])
    return torch.tensor(rewards, dtype=torch.float32), per_component



# ---------------------------------------------------------------- group-level terms

def length_rewards(lengths, correct, group_size):
    """Kimi k1.5's length reward (Kimi Team 2025, sec. 2.3.3): within each group, shorter is better
    for a right answer, and a wrong one is never paid for being short.

    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len) over the group (0 when all lengths are
    equal); a right answer (correct >= 1: full marks) gets lambda_i, a wrong one min(0, lambda_i).
    lengths, correct: (N,), groups contiguous. Returns (N,) float32 in [-0.5, 0.5]; the run adds
    it times length_reward, as the component "length_reward".

    Example, G = 3, lengths [10, 20, 30]: lambda [0.5, 0, -0.5]. Correct [1, 1, 0] -> [0.5, 0,
    -0.5]; correct [0, 0, 1] -> [0, 0, -0.5] (the short wrong ones get min(0, lambda) = 0).
    """
    n = lengths.float().view(-1, group_size)  # (P, G)
    shortest, longest = n.amin(dim=1, keepdim=True), n.amax(dim=1, keepdim=True)
    span = longest - shortest
    lam = torch.where(span > 0, 0.5 - (n - shortest) / span.where(span > 0, 1.0), 0.0)
    right = correct.view(-1, group_size) >= 1
    return torch.where(right, lam, lam.clamp(max=0.0)).reshape(-1)


NOT_TERMS = ("parsed", "errors", "timeouts", "unscored")  # components the reward does not sum


def reward_terms(rewards, components, weights):
    """The reward split into the terms it sums, for per-component advantages (GDPO):
    (terms (N, K), weights (K,), names). Each component but NOT_TERMS, unweighted, with its weight
    (weights, else WEIGHTS', else 1, as shape_reward weighs it), and "shaping": whatever the reward
    adds beyond them (the penalties, length shaping; weight 1). weights @ terms == rewards.
    A NaN (unscored) reward makes its row's "shaping" NaN."""
    weights = {**WEIGHTS, **weights}
    names = [k for k in components if k not in NOT_TERMS]
    values = torch.stack([components[k].float() for k in names], dim=1) if names else \
        torch.zeros(len(rewards), 0)
    w = torch.tensor([weights.get(k, 1.0) for k in names], dtype=torch.float32)
    # to 1e-6: float32's rounding of the sum leaves ~1e-8 where shaping added nothing, and a group
    # z-score would blow that up to ~1e-4
    shaping = torch.round(rewards.float() - values @ w, decimals=6)
    return (torch.cat([values, shaping[:, None]], dim=1), torch.cat([w, torch.ones(1)]),
            names + ["shaping"])
