"""Verifiers on hand-written and adversarial input (W1-W6).   pytest tests/test_rewards.py"""

import os
import socket
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards import (
    after_tool_outputs,
    code_reward,
    countdown_reward,
    extract_answer,
    has_format,
    last_boxed,
    length_rewards,
    math_reward,
    reward_terms,
    score_batch,
    shape_reward,
)
from scoring import sandbox


def A(answer):
    """A well-formatted completion with this answer."""
    return f"<think>Let me try a few combinations.</think>\n<answer>{answer}</answer>"


N, T = [3, 5, 7], 22  # 3 * 5 + 7 = 22
OK = (1, 1, 1, 1)  # (format, parsed, numbers_valid, correct)
WRONG_NUMBERS = (1, 1, 0, 0)
WRONG_VALUE = (1, 1, 1, 0)
REJECTED = (1, 0, 0, 0)  # well formatted, but not a Countdown equation
NOTHING = (0, 0, 0, 0)

COUNTDOWN_CASES = [
    # correct answers in many spellings
    ("plain", A("3*5+7"), N, T, OK),
    ("spaces", A("3 * 5 + 7"), N, T, OK),
    ("reordered", A("7 + 5 * 3"), N, T, OK),
    ("parens", A("(3 * 5) + 7"), N, T, OK),
    ("double parens", A("((3 * 5) + 7)"), N, T, OK),
    ("padded", A("   3*5+7   "), N, T, OK),
    ("newline inside", A("3*5\n+ 7"), N, T, OK),
    ("tabs and newlines", A("\n\t7+3*5\t\n"), N, T, OK),
    ("non-breaking space", A("3\u00a0*\u00a05 + 7"), N, T, OK),
    ("ten parens", A("(" * 10 + "3*5+7" + ")" * 10), N, T, OK),
    ("division", A("8 / 4 * 6"), [4, 6, 8], 12, OK),
    ("fractional intermediate", A("6 / (4 / 8)"), [4, 6, 8], 12, OK),
    ("four numbers", A("1*2*3*4"), [1, 2, 3, 4], 24, OK),
    ("four numbers grouped", A("(1+2+3)*4"), [4, 3, 2, 1], 24, OK),
    ("subtraction order", A("90 - (13 + 19)"), [13, 19, 90], 58, OK),
    ("repeated given number", A("2*2+5"), [2, 2, 5], 9, OK),
    ("empty think", "<think></think><answer>3*5+7</answer>", N, T, OK),
    ("whitespace between blocks", "<think>a</think>\n\n<answer>3*5+7</answer>\n", N, T, OK),
    # the right layout is needed for the format component only
    ("no think block", "<answer>3*5+7</answer>", N, T, (0, 1, 1, 1)),
    ("text after answer", A("3*5+7") + " Hope this helps!", N, T, (0, 1, 1, 1)),
    ("text between blocks", "<think>a</think> So: <answer>3*5+7</answer>", N, T, (0, 1, 1, 1)),
    ("two answer tags, last right", A("3+5+7") + "<answer>3*5+7</answer>", N, T, (0, 1, 1, 1)),
    ("two answer tags, last wrong", "<think>a</think><answer>3*5+7</answer><answer>3+5+7</answer>",
     N, T, (0, 1, 1, 0)),
    ("answer in think and after", "<think><answer>3+5+7</answer></think><answer>3*5+7</answer>",
     N, T, (0, 1, 1, 1)),
    # wrong values with the right numbers
    ("sum", A("3+5+7"), N, T, WRONG_VALUE),
    ("difference", A("3*5-7"), N, T, WRONG_VALUE),
    ("product", A("(3+5)*7"), N, T, WRONG_VALUE),
    ("fraction result", A("(3+5)/7"), N, T, WRONG_VALUE),
    ("division by zero", A("5/(2-2)"), [2, 2, 5], 1, WRONG_VALUE),
    ("integer division by zero", A("5/(2-2)*0"), [2, 2, 5, 0], 0, WRONG_VALUE),
    # wrong, reused, missing or extra numbers
    ("other number", A("2*11"), N, T, WRONG_NUMBERS),
    ("number not given", A("3*5+8-1"), N, T, WRONG_NUMBERS),
    ("reused number", A("3*5+7+3-3"), N, T, WRONG_NUMBERS),
    ("reused instead of another", A("5*5-3"), N, T, WRONG_NUMBERS),
    ("missing numbers", A("15+7"), N, T, WRONG_NUMBERS),
    ("missing one of four", A("4*3*2"), [1, 2, 3, 4], 24, WRONG_NUMBERS),
    ("extra zero", A("3*5+7+0"), N, T, WRONG_NUMBERS),
    ("extra one", A("3*5+7*1"), N, T, WRONG_NUMBERS),
    ("digits glued", A("35+7-20"), N, T, WRONG_NUMBERS),
    ("duplicate given once", A("2*5"), [2, 2, 5], 10, WRONG_NUMBERS),
    ("many numbers", A("*".join(["3"] * 100)), N, T, WRONG_NUMBERS),
    # not a Countdown equation: forbidden characters or operations
    ("decimal", A("3*5+7.0"), N, T, REJECTED),
    ("decimal operand", A("2.5*4"), [2, 4], 10, REJECTED),
    ("unary minus", A("-(-3*5)+7"), N, T, REJECTED),
    ("unary plus", A("+3*5+7"), N, T, REJECTED),
    ("double minus", A("7*3--5"), N, 26, REJECTED),
    ("power", A("5**2-3"), N, T, REJECTED),
    ("huge power tower", A("9**9**9**9"), [9, 9, 9, 9], 1, REJECTED),
    ("floor division", A("7//5+3*7"), N, T, REJECTED),
    ("modulo", A("3%5+7"), N, T, REJECTED),
    ("xor", A("3^5+7"), N, T, REJECTED),
    ("shift", A("3<<5"), N, T, REJECTED),
    ("name", A("x+3"), N, T, REJECTED),
    ("call", A("abs(3)*5+7"), N, T, REJECTED),
    ("attribute access", A("(3).real*5+7"), N, T, REJECTED),
    ("import", A("__import__('os').system('true')"), N, T, REJECTED),
    ("lambda", A("(lambda: 22)()"), N, T, REJECTED),
    ("boolean", A("True*22"), N, T, REJECTED),
    ("equals sign", A("3*5+7 = 22"), N, T, REJECTED),
    ("equation reversed", A("22 = 3*5+7"), N, T, REJECTED),
    ("times sign", A("3×5+7"), N, T, REJECTED),
    ("letter x as times", A("3x5+7"), N, T, REJECTED),
    ("brackets", A("[3*5]+7"), N, T, REJECTED),
    ("commas", A("3,5,7"), N, T, REJECTED),
    ("tuple", A("(3, 5)"), N, T, REJECTED),
    ("empty parens", A("()"), N, T, REJECTED),
    ("leading zero", A("03*5+7"), N, T, REJECTED),
    ("unbalanced open", A("(3*5+7"), N, T, REJECTED),
    ("unbalanced close", A("3*5+7)"), N, T, REJECTED),
    ("no operators", A("3 5 7"), N, T, REJECTED),
    ("operator only", A("+"), N, T, REJECTED),
    ("fullwidth digit", A("３*5+7"), N, T, REJECTED),
    ("arabic-indic digit", A("٣*5+7"), N, T, REJECTED),
    ("superscript digit", A("3*5+7²"), N, T, REJECTED),
    ("deep nesting", A("(" * 300 + "3*5+7" + ")" * 300), N, T, REJECTED),
    ("100 KB answer", A("1+" * 50_000 + "1"), N, T, REJECTED),
    ("prose answer", A("The answer is 3*5+7"), N, T, REJECTED),
    ("nested answer tags", "<think>a</think><answer><answer>3*5+7</answer></answer>",
     N, T, (0, 0, 0, 0)),
    ("html entity", A("3*5&#43;7"), N, T, REJECTED),
    # no answer at all
    ("no tags", "3*5+7", N, T, NOTHING),
    ("empty completion", "", N, T, NOTHING),
    ("empty answer", "<think>a</think><answer></answer>", N, T, NOTHING),
    ("blank answer", "<think>a</think><answer>  \n </answer>", N, T, NOTHING),
    ("answer inside think only", "<think>maybe <answer>3*5+7</answer></think>", N, T, NOTHING),
    ("unclosed think", "<think>so <answer>3*5+7</answer>", N, T, NOTHING),
    ("unclosed answer", "<think>a</think><answer>3*5+7", N, T, NOTHING),
    ("tags reversed", "<think>a</think></answer>3*5+7<answer>", N, T, NOTHING),
    ("uppercase tags", "<think>a</think><ANSWER>3*5+7</ANSWER>", N, T, NOTHING),
    ("spaced tags", "<think>a</think>< answer >3*5+7</ answer >", N, T, NOTHING),
    ("answer before think end", "<think>a <answer>3*5+7</answer> b</think>", N, T, NOTHING),
    ("100 KB of open tags", "<answer>" * 12_500, N, T, NOTHING),
    ("100 KB of think tags", "<think>" * 7_000 + "<answer>3*5+7</answer>", N, T, NOTHING),
]


def test_at_least_sixty_countdown_cases():
    assert len(COUNTDOWN_CASES) >= 60
    assert len({name for name, *_ in COUNTDOWN_CASES}) == len(COUNTDOWN_CASES)


@pytest.mark.parametrize("name, text, numbers, target, want", COUNTDOWN_CASES,
                         ids=[c[0] for c in COUNTDOWN_CASES])
def test_countdown(name, text, numbers, target, want):
    start = time.perf_counter()
    got = countdown_reward(text, numbers, target)
    assert time.perf_counter() - start < 1.0  # generous: the whole table runs in milliseconds
    assert (got["format"], got["parsed"], got["numbers_valid"], got["correct"]) == want


def test_countdown_tolerance_is_1e5():
    # targets are whole numbers, so exact fractions decide; a value 1/3 off is wrong
    assert countdown_reward(A("7/3"), [7, 3], 2)["correct"] == 0.0
    assert countdown_reward(A("(7+2)/3"), [7, 2, 3], 3)["correct"] == 1.0


# ---------------------------------------------------------------- extraction helpers


def test_extract_answer_and_format():
    assert extract_answer("x <answer> 1 </answer> y <answer>\n2\n</answer>") == "2"
    assert extract_answer("<think>a</think> no tags") is None
    assert has_format("<think>a</think><answer>1</answer>")
    # W4: empty answers get no format credit
    assert not has_format("<think>a</think><answer></answer>")
    assert not has_format("<think>a <answer>1</answer></think>")


def test_last_boxed_balances_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed("no box") is None


# ---------------------------------------------------------------- math


def M(boxed):
    return f"<think>work</think><answer>\\boxed{{{boxed}}}</answer>"


MATH_EQUAL = [
    (r"\frac{1}{2}", "0.5"),
    ("1/2", r"\frac{1}{2}"),
    ("0.50", "1/2"),
    (r"\dfrac{3}{4}", "0.75"),
    ("2", "2.0"),
    ("-3", "-3"),
    ("1,000", "1000"),
    ("7/2", "3.5"),
    ("$5$", "5"),
    ("5.", "5"),
    (r"-\frac{9}{4}", "-9/4"),
    (r"\frac{-9}{4}", "-2.25"),
    (r"12 \text{ cm}", "12"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\frac{\pi}{2}", "pi/2"),
    (r"\left(x+1\right)", "1+x"),
]

MATH_NOT_EQUAL = [
    ("1/3", "0.33"),
    ("2", "3"),
    ("x+1", "x+2"),
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    ("1000", "1,001"),
    ("-2", "2"),
    ("__import__('os')", "0"),
    ("x**x", "1"),
    # W4: a numeric reference needs a number: restating the sum is not computing it
    ("13+14", "27"),
    (r"3 \cdot 4", "12"),
    (r"\sqrt{4}", "2"),
    ("...", "x"),
]


@pytest.mark.parametrize("given, answer", MATH_EQUAL)
def test_math_equal(given, answer):
    assert math_reward(M(given), answer) == {"format": 1.0, "parsed": 1.0, "correct": 1.0}


@pytest.mark.parametrize("given, answer", MATH_NOT_EQUAL)
def test_math_not_equal(given, answer):
    assert math_reward(M(given), answer)["correct"] == 0.0


def test_math_placeholders_and_restated_questions_earn_nothing():
    # W4: a numeric reference needs a number; "..." copied from the prompt's example is no answer
    assert math_reward(M("..."), "27") == {"format": 0.0, "parsed": 0.0, "correct": 0.0}
    assert math_reward(M("13+14"), "27") == {"format": 0.0, "parsed": 0.0, "correct": 0.0}
    assert math_reward(M("27"), "27") == {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    assert math_reward(M("26"), "27") == {"format": 1.0, "parsed": 1.0, "correct": 0.0}
    # with the last-number fallback, an untagged answer is judged but never counts as parsed
    assert math_reward("13 + 14 = 27", "27", last_number=True) == {
        "format": 0.0, "parsed": 0.0, "correct": 1.0}


def test_math_answer_sources_and_guards():
    # plain <answer>
    assert math_reward("<think>w</think><answer>42</answer>", "42")["correct"] == 1.0
    assert math_reward(r"so the result is \boxed{42}", "42") == {
        "format": 0.0, "parsed": 1.0, "correct": 1.0}
    # W4: an empty box scores nothing, not even format
    assert math_reward(M(""), "0") == {"format": 0.0, "parsed": 0.0, "correct": 0.0}
    assert math_reward("<think>w</think><answer></answer>", "0")["parsed"] == 0.0
    # unbalanced
    assert math_reward(r"<think>w</think><answer>\boxed{7</answer>", "7")["correct"] == 0.0


def test_math_time_bound_on_adversarial_input():
    start = time.perf_counter()
    got = math_reward(M("9^9^9^9^9"), "1")
    assert got["correct"] == 0.0
    assert time.perf_counter() - start < 4.0  # a power tower is refused before sympy evaluates it


# ---------------------------------------------------------------- code

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0",
             {"call": "add(2, 3)", "expected": 5}]


def C(code):
    return f"<think>easy</think><answer>```python\n{code}\n```</answer>"


def test_code_passing_and_failing():
    right = {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    assert code_reward(C("def add(a, b):\n    return a + b"), ADD_TESTS) == right
    assert code_reward(C("def add(a, b):\n    return abs(a) + b"),
                       ADD_TESTS)["correct"] == pytest.approx(2 / 3)
    # syntax error
    assert code_reward(C("def add(a, b):\n    return a +"), ADD_TESTS)["correct"] == 0.0
    assert code_reward("no code here", ADD_TESTS) == {"format": 0.0, "parsed": 0.0, "correct": 0.0}


def test_code_infinite_loop_times_out():
    start = time.perf_counter()
    assert code_reward(C("def add(a, b):\n    while True: pass"), ADD_TESTS,
                       timeout=2.0)["correct"] == 0.0
    assert time.perf_counter() - start < 5.0


def test_code_exiting_early_or_faking_results_scores_zero():
    fake = ('import json, sys\n'
            'for i in range(3): sys.__stdout__.write(json.dumps(["x", i, True]) + "\\n")\n')
    assert code_reward(C("import os\nos._exit(0)"), ADD_TESTS)["correct"] == 0.0
    assert code_reward(C("raise SystemExit(0)"), ADD_TESTS)["correct"] == 0.0
    assert code_reward(C(fake + "def add(a, b): return 99"), ADD_TESTS)["correct"] == 0.0


def test_always_equal_objects_do_not_pass_exact_tests():
    code = "class Yes:\n    def __eq__(self, other): return True\ndef add(a, b):\n    return Yes()"
    assert code_reward(C(code), [{"call": "add(2, 3)", "expected": 5}])["correct"] == 0.0
    int_subclass = ("class I(int):\n    def __eq__(self, o): return True\n"
                    "def add(a, b):\n    return I(0)")
    assert code_reward(C(int_subclass), [{"call": "add(2, 3)", "expected": 5}])["correct"] == 0.0


def test_code_fork_bomb_leaves_nothing_behind():
    bomb = ("import os\nfor _ in range(200):\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n"
            "def add(a, b): return a + b")
    # forks fail past the process limit
    assert code_reward(C(bomb), ADD_TESTS, timeout=10.0)["correct"] == 1.0
    # processes of a killed sandbox die asynchronously; none may outlive it
    deadline = time.time() + 5
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []


def sandbox_processes():
    """Processes running as a sandbox's uid (its own, from sandbox.UID_BASE up, as root)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{name}").st_uid >= sandbox.UID_BASE:
                found.append(int(name))
        except OSError:
            pass
    return found


def test_code_cannot_write_outside_or_read_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    target = tmp_path / "escaped.txt"
    code = (
        "import os\n"
        f"for path in [{str(target)!r}, '/tmp/grpo-escaped.txt', '../escaped.txt']:\n"
        "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass\n"
        "def secret(): return os.environ.get('GRPO_TEST_SECRET')"
    )
    got = code_reward(C(code), [{"call": "secret()", "expected": None}])
    assert got["correct"] == 1.0  # the secret is not in the sandbox's environment
    assert not target.exists() and not os.path.exists("/tmp/grpo-escaped.txt")


def test_code_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (
        "import socket\ndef reach():\n    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        "        return 'connected'\n"
        "    except OSError:\n        return 'blocked'"
    )
    try:
        assert code_reward(C(code), [{"call": "reach()", "expected": "blocked"}])["correct"] == 1.0
    finally:
        server.close()


def test_code_huge_output_is_harmless():
    code = ("print('x' * 50_000_000)\nimport sys\nsys.stderr.write('y' * 10_000_000)\n"
            "def add(a, b): return a + b")
    assert code_reward(C(code), ADD_TESTS)["correct"] == 1.0
    # RLIMIT_FSIZE: 1 MB
    big_file = "open('big', 'w').write('z' * 10_000_000)\ndef add(a, b): return a + b"
    assert code_reward(C(big_file), ADD_TESTS)["correct"] == 0.0


# ---------------------------------------------------------------- shaping and the batch scorer


def test_shape_reward_hand_worked():
    right = {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    wrong = {"format": 1.0, "parsed": 1.0, "correct": 0.0}
    unparsed = {"format": 0.0, "parsed": 0.0, "correct": 0.0}
    assert shape_reward(right, 100) == pytest.approx(1.1)
    assert shape_reward(wrong, 100, wrong_penalty=-0.1) == pytest.approx(0.0)
    assert shape_reward(unparsed, 100, wrong_penalty=-0.1,
                        unparsed_penalty=-0.5) == pytest.approx(-0.5)
    # W3: 65 tokens past a soft limit of 100 -> 3 started blocks of 32 -> -0.15
    assert shape_reward(right, 165, length_soft_limit=100) == pytest.approx(1.1 - 0.15)
    assert shape_reward(right, 100, length_soft_limit=100) == pytest.approx(1.1)
    assert shape_reward(right, 9, length_min=10) == 0.0
    assert shape_reward(right, 10, length_min=10) == pytest.approx(1.1)


def test_shape_reward_weighs_the_tasks_own_components():
    # TRL's reward_weights: every other component counts with weight 1 unless weighted otherwise
    c = {"correct": 1.0, "format": 0.0, "brief": 1.0, "style": 0.5}
    assert shape_reward(c, 10) == pytest.approx(1.0 + 1.0 + 0.5)
    assert shape_reward(c, 10, weights={"brief": 0.2, "style": 0.0}) == pytest.approx(1.2)
    # the verifiers' own components are weighed the same way (correct 1, format 0.1 by default)
    c = {"correct": 1.0, "format": 0.5, "parsed": 1.0}
    assert shape_reward(c, 10) == pytest.approx(1.05)
    assert shape_reward(c, 10, weights={"format": 0.5, "correct": 2.0}) == pytest.approx(2.25)
    # no "parsed": no penalty
    assert shape_reward({"score": 0.7}, 10, unparsed_penalty=-0.5) == pytest.approx(0.7)
    assert shape_reward({"score": 0.7}, 200, length_soft_limit=100,
                        length_penalty_tokens=100) == pytest.approx(0.65)


def test_score_batch():
    right = {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    wrong = {"format": 1.0, "parsed": 1.0, "correct": 0.0}
    results = [{**right, "numbers_valid": 1.0}, wrong, "error", "timeout", {"correct": 1.0}]
    rewards, comps = score_batch(results, [10] * 5, {"numbers_valid": 0.0, "format": 0.2},
                                 wrong_penalty=-0.1)
    # a failed reward scores exactly 0
    assert rewards.tolist() == pytest.approx([1.2, 0.1, 0.0, 0.0, 1.0])
    assert rewards.dtype == torch.float32
    assert comps["correct"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    # a component others lack: 0 for them
    assert comps["numbers_valid"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert (comps["errors"].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
            and comps["timeouts"].tolist() == [0, 0, 0, 1, 0])


# -------------------------------------------------------------- property: no input crashes or hangs

TOKENS = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "{", "}", "(",
                          ")", "*", "**", "/", "-", "+", " ", "\n", "3", "5", "7", "99999999", "x",
                          ".", "__import__", "９"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(TOKENS, max_size=80).map("".join)))
def test_random_strings_never_raise_or_hang(text):
    start = time.perf_counter()
    got = countdown_reward(text, N, T)
    assert set(got) == {"format", "parsed", "numbers_valid", "correct"}
    assert all(v in (0.0, 1.0) for v in got.values())
    last_boxed(text)
    assert time.perf_counter() - start < 0.5


# ------------------------------------------------------- review fixes: holes and a raising verifier


def test_fractions_count_only_in_lowest_terms():
    # the prompt asks for lowest terms, and the answer key is in them:
    # 4/6 is not an answer to 1/3 + 1/3
    assert math_reward(M("4/6"), "2/3")["correct"] == 0.0
    assert math_reward(M(r"\frac{4}{6}"), "2/3")["correct"] == 0.0
    assert (math_reward(M("8/4"), "2")["correct"] == 0.0
            and math_reward(M("3/1"), "3")["correct"] == 0.0)
    assert math_reward(M("2/3"), "2/3")["correct"] == 1.0
    assert math_reward(M(r"-\frac{9}{4}"), "-9/4")["correct"] == 1.0
    assert math_reward(M("0.5"), "1/2")["correct"] == 1.0  # an exact decimal is still the number
    # parsed, so wrong_penalty (not unparsed) applies
    assert math_reward(M("4/6"), "2/3")["parsed"] == 1.0


def test_a_box_inside_an_unclosed_think_does_not_score():
    assert math_reward(r"<think>maybe \boxed{5}", "5") == {
        "format": 0.0, "parsed": 0.0, "correct": 0.0}
    assert math_reward("<think>maybe 5", "5", last_number=True)["correct"] == 0.0
    # closed thinking, then the answer outside it: scores
    assert math_reward(r"<think>hmm</think> \boxed{5}", "5")["correct"] == 1.0
    assert math_reward("<think>hmm</think> it is 5", "5", last_number=True)["correct"] == 1.0
    # answered before thinking
    assert math_reward(r"\boxed{5} <think>on second thought", "5")["correct"] == 1.0


def test_last_number_reads_thousands_separators_whole():
    assert math_reward("The total is 1,234", "1234", last_number=True)["correct"] == 1.0
    assert math_reward("The total is 1,234", "234", last_number=True)["correct"] == 0.0
    assert math_reward("so 12,345,678.5 in all", "12345678.5", last_number=True)["correct"] == 1.0
    # a list is not a separator
    assert math_reward("pick 3, 4", "4", last_number=True)["correct"] == 1.0


def test_after_tool_outputs_keeps_only_the_models_text_after_the_last_output():
    from episodes.tools import TOOL_OUTPUT

    out = TOOL_OUTPUT.format("42")
    assert out.startswith("\n<output>\n") and out.endswith("\n</output>\n")  # the tags it looks for
    assert after_tool_outputs("no tool here: 7") == "no tool here: 7"
    assert (after_tool_outputs("a" + out + "b" + TOOL_OUTPUT.format("43") + "it is 43")
            == "\nit is 43")
    # the last output was cut: all the tool's
    assert after_tool_outputs("a" + out + "b\n<output>\n43") == ""
    assert after_tool_outputs("<output>\n43") == ""
    assert after_tool_outputs("<think>a" + out + "then 42") == "<think>\nthen 42"  # still thinking
    assert after_tool_outputs("<think>a</think>" + out + "42") == "\n42"
    assert math_reward("<think>" + out + "</think><answer>42</answer>", "42",
                       tools=True)["correct"] == 1.0
    assert math_reward("<think>" + out + "</think><answer>41</answer>", "42",
                       tools=True)["correct"] == 0.0
    assert math_reward("<answer>42</answer>" + out + "41", "42", True, tools=True)["correct"] == 0.0
    # tools off
    assert math_reward("<answer>42</answer>" + out + "41", "42", True)["correct"] == 1.0


# ---------------------------------------------------------------- group-level terms (W3, A6)


def naive_length_rewards(lengths, correct, G):
    """Kimi k1.5's length reward, one completion at a time."""
    out = []
    for start in range(0, len(lengths), G):
        group = lengths[start : start + G]
        lo, hi = min(group), max(group)
        for n, c in zip(group, correct[start : start + G]):
            lam = 0.0 if hi == lo else 0.5 - (n - lo) / (hi - lo)
            out.append(lam if c >= 1 else min(0.0, lam))
    return out


def test_length_rewards_hand_worked_and_against_a_naive_loop():
    lengths = torch.tensor([10, 20, 30])
    assert length_rewards(lengths, torch.tensor([1.0, 1, 0]), 3).tolist() == [0.5, 0.0, -0.5]
    # the short wrong ones are never paid: min(0, lambda)
    assert length_rewards(lengths, torch.tensor([0.0, 0, 1]), 3).tolist() == [0.0, 0.0, -0.5]
    assert length_rewards(torch.tensor([7, 7]), torch.tensor([1.0, 0]), 2).tolist() == [0.0, 0.0]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (40,), generator=gen)
    correct = torch.randint(0, 3, (40,), generator=gen) / 2  # 0, 0.5 (partial: not right), 1
    want = naive_length_rewards(lengths.tolist(), correct.tolist(), 8)
    assert length_rewards(lengths, correct, 8).tolist() == pytest.approx(want, abs=1e-6)


def test_reward_terms_add_up_to_the_reward():
    """The components, weighed as shape_reward weighs them, and "shaping" (penalties, length
    shaping) sum back to score_batch's rewards; a row with nothing added has shaping exactly 0."""
    results = [{"correct": 1.0, "format": 1.0, "parsed": 1.0},
               {"correct": 0.0, "format": 1.0, "parsed": 1.0, "style": 0.5},
               {"correct": 0.0, "format": 0.0, "parsed": 0.0}, "timeout"]
    shaping = {"wrong_penalty": -0.1, "unparsed_penalty": -0.5, "length_soft_limit": 50}
    rewards, components = score_batch(results, [10, 90, 10, 10], {"style": 2.0}, **shaping)
    terms, weights, names = reward_terms(rewards, components, {"style": 2.0})
    assert names == ["correct", "format", "style", "shaping"]
    assert weights.tolist() == pytest.approx([1.0, 0.1, 2.0, 1.0])
    assert (terms @ weights).tolist() == pytest.approx(rewards.tolist(), abs=1e-6)
    # -0.1 wrong, -0.05 x 2 past 50 tokens; -0.5 unparsed; the failed row: 0
    assert terms[:, 3].tolist() == pytest.approx([0.0, -0.2, -0.5, 0.0])
    assert terms[0, 3].item() == 0.0
