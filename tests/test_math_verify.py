"""The math verifier on real answers (W1, W4): math-verify under this project's guards, in the
reward workers a run uses, in time, in any thread.   pytest tests/test_math_verify.py"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from config import ConfigError, load_config
from episodes.task import load_task, score
from rewards import MATH_TIMEOUT, math_equal, math_reward
from scoring.runner import OutOfTime, run_rewards, within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIGHT = {"format": 1.0, "parsed": 1.0, "correct": 1.0}
NOTHING = {"format": 0.0, "parsed": 0.0, "correct": 0.0}


def M(boxed):
    """A well-formatted completion whose answer is \\boxed{boxed}."""
    return f"<think>work</think><answer>\\boxed{{{boxed}}}</answer>"


def mv(given, gold):
    """math-verify's own verdict, as TRL's accuracy_reward reaches it."""
    return verify(parse(f"${gold}$"), parse(f"\\boxed{{{given}}}"))


# (answer in the box, gold as a dataset writes it): answers people write every day, all right
PERSON_SAYS_RIGHT = [
    ("\\$18", "18"),  # the GSM8K habit
    ("18 dollars", "18"),
    ("18 \\text{ dollars}", "18"),
    ("2^{10}", "1024"),
    ("10^3", "1000"),
    ("3\\frac{1}{2}", "3.5"),  # a mixed number
    ("x=3", "3"),
    ("0.5", "\\frac12"),
    ("14{,}916", "14916"),  # thousands separators in LaTeX
    ("32,\\! 349", "32349"),
    ("1,000", "#### 1,000"),  # a GSM8K gold
    ("1000", "1,000"),
    ("50\\%", "50"),  # a percent is the number asked for in percent ...
    ("50\\%", "0.5"),  # ... and that number over 100
    ("\\frac94\\pi", "\\frac{9}{4}\\pi"),
    ("\\sqrt 2", "\\sqrt{2}"),
    ("\\text{(C)}", "C"),  # a multiple-choice letter
    ("[1,2) \\cup (3,4]", "[1,2)\\cup(3,4]"),  # intervals and unions
    ("x \\in [1,2]", "[1,2]"),
    ("\\{3,1,2\\}", "\\{1,2,3\\}"),  # a set, in any order
    ("2, 1", "1, 2"),  # a list of solutions, in any order
    ("x = 1, x = 2", "1, 2"),
    ("(p,q)=(3,2)", "(3,2)"),
    ("(3,2)", "(p,q)=(3,2)"),
    ("1+x", "x+1"),  # the answer the old sympy child scored 0 in every reward worker
    ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{\\pi}{2}", "pi/2"),  # a plain-text gold
    ("\\textbf{27}", "27"),
    ("1.5 \\times 10^{3}", "1500"),  # scientific notation
]

# wrong: math-verify says the three after the pair are right (by value, not as asked)
PERSON_SAYS_WRONG = [
    ("(2,3)", "(3,2)"),  # an ordered pair: order is its meaning
    ("4/6", "2/3"),  # not in lowest terms (the gold is, and the generated questions ask for them)
    ("\\frac{8}{4}", "2"),
    ("0.333333", "\\frac13"),  # a decimal is the number only exactly
    ("18 or 19", "18"),
    ("x+2", "x+1"),
    ("26", "27"),
]


@pytest.mark.parametrize("given, gold", PERSON_SAYS_RIGHT)
def test_right_answers_score_as_a_person_would(given, gold):
    assert math_reward(M(given), gold) == RIGHT


@pytest.mark.parametrize("given, gold", PERSON_SAYS_WRONG)
def test_wrong_answers_score_as_a_person_would(given, gold):
    assert math_reward(M(given), gold) == {"format": 1.0, "parsed": 1.0, "correct": 0.0}


def test_the_guards_on_fractions_and_decimals_overrule_math_verify():
    assert [mv(given, gold) for given, gold in PERSON_SAYS_WRONG[1:4]] == [True, True, True]


def test_the_examples_score_the_same_inside_a_runs_reward_workers(tmp_path):
    # the path a run takes: the task file's reward, in forked workers, the default reward_timeout
    cfg = load_config(overrides=["--task=math", "--reward_workers=2"])
    assert cfg.reward_timeout > 0
    task = load_task(cfg)
    cases = PERSON_SAYS_RIGHT + PERSON_SAYS_WRONG + [("13 + 14", "27")]
    problems = [{"question": "What is it?", "answer": gold} for _, gold in cases]
    texts = [M(given) for given, _ in cases]
    rewards_, components = score(task, texts, problems, [20] * len(cases), cfg)
    want = [1.0] * len(PERSON_SAYS_RIGHT) + [0.0] * (len(PERSON_SAYS_WRONG) + 1)
    assert components["correct"].tolist() == want
    assert components["errors"].tolist() == [0.0] * len(cases)  # none failed, none timed out
    assert components["parsed"].tolist() == [1.0] * (len(cases) - 1) + [0.0]  # the restated sum


def test_a_symbolic_answer_is_right_in_a_daemonic_reward_worker():
    # the old verifier started a sympy child from the reward: in a run's (daemonic) worker that
    # raised "daemonic processes are not allowed to have children": 1+x for x+1 scored 0, an error
    cfg = load_config(overrides=["--task=math"])
    task = load_task(cfg)
    problem = {"question": "Simplify (x^2 - 1)/(x - 1).", "answer": "x+1"}
    texts = [M("1+x"), M("x+2"), M("9^{9^{9^{9}}}")]
    want = [RIGHT] + [{"format": 1.0, "parsed": 1.0, "correct": 0.0}] * 2
    assert run_rewards(task.reward, texts, [problem] * 3, cfg.reward_timeout) == want
    assert run_rewards(task.reward, texts, [problem] * 3, 0) == want  # in-process: reward_timeout=0


def test_gsm8k_judges_with_the_same_verifier_and_after_the_last_tool_output(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    problem = {"question": "How much?", "answer": "9 * 2 = 18\n#### 1,018"}
    path.write_text(json.dumps(problem) + "\n")
    cfg = load_config(overrides=["--task=gsm8k", f"--data_path={path}"])
    task = load_task(cfg)
    texts = [M("\\$1,018"), M("1018 dollars"), "<think>w</think><answer>1018</answer>",
             "so it is 1,018", M("1,017"), M("1000 + 18")]
    got = [c["correct"] for c in run_rewards(task.reward, texts, [problem] * 6, cfg.reward_timeout)]
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    from episodes.tools import TOOL_OUTPUT

    # the tool printed the box; the model wrote no answer of its own after it
    tool_text = "<think>let me run" + TOOL_OUTPUT.format("\\boxed{1018}") + "</think> as printed."
    # tools off: all the text is the model's
    assert run_rewards(task.reward, [tool_text], [problem], 0)[0]["correct"] == 1.0
    cfg = load_config(overrides=["--task=gsm8k", f"--data_path={path}", "--tools=True"])
    task = load_task(cfg)
    assert run_rewards(task.reward, [tool_text], [problem], 0)[0]["correct"] == 0.0


@pytest.mark.parametrize("task", ["math", "gsm8k"])
def test_without_math_verify_the_task_fails_before_a_model_loads(tmp_path, monkeypatch, task):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    data = [f"--data_path={tmp_path}"] if task == "gsm8k" else []  # gsm8k's problems: a dataset's
    cfg = load_config(overrides=[f"--task={task}", *data])
    with pytest.raises(ConfigError, match=r"pip install 'math-verify\[antlr4_13_2\]==0.9.0'"):
        load_task(cfg)


# ---------------------------------------------------------------- a public regression suite

SUITE = json.load(open(os.path.join(ROOT, "tests", "math_verify_cases.json")))["cases"]


def test_the_suite_agrees_with_math_verify_but_where_the_last_box_decides():
    differ = [c for c in SUITE if c["ours"] != c["math_verify"]]
    assert len(SUITE) == 95 and len(differ) == 13
    assert all(c["why"].startswith("the last \\boxed{} is the answer") for c in differ)


@pytest.mark.parametrize("case", SUITE, ids=[f"{i}" for i in range(len(SUITE))])
def test_the_suite_case(case):
    assert math_reward(case["completion"], case["gold"])["correct"] == case["ours"]


# ---------------------------------------------------------------- the guards win over math-verify


def test_a_restated_operation_earns_nothing():
    # W4: "13 + 14" restates "What is 13 + 14?"; math-verify finds it equal to 27
    assert mv("13 + 14", "27") and mv("\\sqrt{4}", "2") and mv("27=13+14", "27")
    for restated in ["13 + 14", "14+13", "30 - 3", "3 \\cdot 9", "\\sqrt{729}", "27=13+14",
                     "3!+21"]:
        assert math_reward(M(restated), "27") == NOTHING, restated
    assert math_reward(M("13 + 14 = 27"), "27") == RIGHT  # worked, then answered
    assert math_reward(M("x"), "27") == NOTHING  # a numeric gold needs a number
    assert math_reward(M("..."), "27") == NOTHING  # the prompt's placeholder, copied


def test_an_expression_copied_from_the_question_earns_nothing():
    question = "Simplify $\\sqrt{50}$."
    assert mv("\\sqrt{50}", "5\\sqrt{2}")
    assert math_reward(M("\\sqrt{50}"), "5\\sqrt{2}", question=question) == NOTHING
    assert math_reward(M("5\\sqrt{2}"), "5\\sqrt{2}", question=question) == RIGHT
    assert math_reward(M("\\sqrt{50}"), "5\\sqrt{2}") == RIGHT  # no question given: nothing to copy
    # a plain number or a letter is never a copy, though the question holds it
    assert math_reward(M("5"), "5", question="Add 5 and 0.") == RIGHT
    assert math_reward(M("(C)"), "C", question="Pick (A), (B) or (C).") == RIGHT


def test_the_last_box_is_the_answer():
    # math-verify joins boxes listed with "and"; here the answer is the last box, as it always was
    two = "<think>w</think><answer>\\boxed{1} and \\boxed{2}</answer>"
    assert verify(parse("${1,2}$"), parse(two))
    assert math_reward(two, "\\{1,2\\}")["correct"] == 0.0
    assert math_reward(two, "2")["correct"] == 1.0
    assert math_reward("\\boxed{26} no, \\boxed{27}", "27")["correct"] == 1.0


def test_an_answer_past_the_length_cap_earns_nothing():
    assert mv("0" * 300 + "27", "27")
    assert math_reward(M("0" * 300 + "27"), "27") == NOTHING
    assert math_reward(M("0" * 200 + "27"), "27") == RIGHT


def test_huge_numbers_are_wrong_at_once():
    # 9^{9^{9^9}} needs a C-level integer power no deadline can stop: refused before sympy sees it
    for huge in ["9^{9^{9^{9}}}", "10^{10^{10}}", "(10^{100})!", "\\binom{10^{9}}{10^{5}}",
                 "2^{2^{2^{2^{2^{2}}}}}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}^{100000}"]:
        start = time.perf_counter()
        assert math_reward(M(huge), "x")["correct"] == 0.0, huge
        assert time.perf_counter() - start < 2.0, huge
    assert math_reward(M("2^{2023}"), "2^{2023}") == RIGHT  # a big answer still counts


# ---------------------------------------------------------------- time: in process, in threads

NESTED = "{" * 100 + "1" + "}" * 100  # ~10 s of parsing without a deadline


def test_the_deadline_stops_a_slow_check_in_the_main_thread():
    start = time.perf_counter()
    assert math_equal(NESTED, "x", timeout=0.5) is False
    assert time.perf_counter() - start < 1.5
    assert math_equal("1+x", "x+1") is True  # and the next check is sound


def test_the_deadline_works_off_the_main_thread():
    results = {}

    def check():
        start = time.perf_counter()
        results["slow"] = math_equal(NESTED, "x", timeout=0.5)
        results["seconds"] = time.perf_counter() - start
        results["right"] = math_reward(M("1+x"), "x+1")
        results["restated"] = math_reward(M("13+14"), "27")

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(30)
    assert results == {"slow": False, "seconds": pytest.approx(0.5, abs=1.0), "right": RIGHT,
                       "restated": NOTHING}


def test_the_callers_own_alarm_survives_a_check():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert math_equal("1+x", "x+1") is True
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left < 30.0  # still set, less the time the check took
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert math_equal(NESTED, "x", timeout=0.3) is False
        time.sleep(0.1)
        assert fired == [1]  # the caller's handler is back, and its alarm went off
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def first_deadline_lost_in_a_finalizer(first_seconds=0.5, total_seconds=5.0):
    """A check whose deadline first lands in a __del__, where Python prints and drops the raise
    (as it does in a generator closed on collection), then runs plain Python calls."""

    def step():
        pass

    class Dropped:
        def __del__(self):
            end = time.monotonic() + first_seconds
            while time.monotonic() < end:  # the alarm lands here
                pass
            step()  # the trace's first call past the deadline

    Dropped()  # collected at once, and its __del__ run
    end = time.monotonic() + total_seconds
    while time.monotonic() < end:
        step()
    return "ran to the end"


def in_thread(thread, fn):
    """fn() in the main thread or another; its result, and the trace, profile, SIGALRM handler and
    timer it leaves behind in that thread."""
    results = {}

    def run():
        try:
            results["returned"] = fn()
        except OutOfTime:
            results["returned"] = "out of time"
        results["left"] = (sys.gettrace(), sys.getprofile())
        if thread == "main":
            results["left"] += (signal.getsignal(signal.SIGALRM),
                                signal.getitimer(signal.ITIMER_REAL))

    if thread == "main":
        run()
    else:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join(30)
    return results


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_deadline_lost_in_a_finalizer_fires_again(thread):
    before = (sys.gettrace(), sys.getprofile())
    if thread == "main":
        before += (signal.getsignal(signal.SIGALRM), (0.0, 0.0))
    start = time.perf_counter()
    results = in_thread(thread, lambda: within(0.2, first_deadline_lost_in_a_finalizer))
    assert results == {"returned": "out of time", "left": before}  # and nothing left behind
    assert time.perf_counter() - start < 3.0  # the check alone runs 5 s: the deadline fired again


@pytest.mark.parametrize("thread", ["main", "other"])
def test_the_with_blocks_a_deadline_unwinds_run_whole(thread):
    """Past the deadline the check unwinds through its with and finally blocks (sympy's `with
    workprec` puts mpmath's process-wide precision back): those must run whole."""
    state = []

    class Precision:
        def __enter__(self):
            state.append("set")

        def __exit__(self, *exc):
            time.sleep(0.01)  # the refire (REFIRE, 50 ms after a raise) must not land here
            state.append(step("restored"))  # a Python call: the trace's chance to raise

    def step(x=None):
        return x

    def check():
        with Precision():
            while True:
                step()

    assert in_thread(thread, lambda: within(0.1, check))["returned"] == "out of time"
    assert state == ["set", "restored"]


@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_deadline_inside_another_keeps_the_sooner(thread):
    def inner():
        while True:
            (lambda: None)()

    start = time.perf_counter()
    assert in_thread(thread, lambda: within(0.2, within, 5.0, inner))["returned"] == "out of time"
    assert time.perf_counter() - start < 2.0


def test_the_first_check_in_a_fresh_process_is_right_under_a_short_deadline():
    # the first check imports math-verify and sympy's parts (seconds); under the deadline that
    # import would be cut short and the answer scored wrong (and the next few with it)
    code = "import rewards; print(rewards.math_equal('1+x', 'x+1', timeout=0.5))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True"], out.stderr


# ---------------------------------------------------------------- nothing raises or hangs

# the pieces of LaTeX and of the layout that answers are made of, and a space
TOKENS = [" "] + r"""\boxed{ { } ( ) [ ] ^ _ ! - + * / = , \frac \sqrt \pi \infty \cup \in
\{ \} \% \$ x \text{ \sum_{ \int \lim \binom \\ & \begin{pmatrix} \end{pmatrix} 10^{ 9^ 99999999
0 1 7 . e i \left( \right) \cdot < \le | ; __import__ </answer> <think> ９""".split()
GOLDS = ["27", "x+1", "(1,2)", "\\frac12", "[0,1)", "\\{1,2\\}", "C", "2\\pi", "#### 1,000"]


def test_random_answers_off_the_main_thread_never_raise_or_hang():
    rng = random.Random(0)
    answers = ["".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 40))) for _ in range(40)]
    results = []

    def check():
        for answer in answers:
            start = time.perf_counter()
            got = math_reward(M(answer), rng.choice(GOLDS))
            in_time = time.perf_counter() - start < MATH_TIMEOUT + 2
            results.append((set(got.values()) <= {0.0, 1.0}, in_time))

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(300)
    assert results == [(True, True)] * len(answers)


ANSWERS = st.lists(st.sampled_from(TOKENS), max_size=60).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), ANSWERS), st.sampled_from(GOLDS))
def test_random_answers_never_raise_or_hang(answer, gold):
    start = time.perf_counter()
    got = math_reward(M(answer), gold, question="What is 13 + 14?")
    assert set(got) == {"format", "parsed", "correct"}
    assert all(v in (0.0, 1.0) for v in got.values())
    assert time.perf_counter() - start < MATH_TIMEOUT + 2.0
