"""Evaluation (M2): pass@k, avg@n, maj@n, eval_tasks, eval_only's table.   pytest tests/test_eval.py

The estimators against hand-worked numbers and brute force; evaluate() on scripted completions with
numbers worked by hand; eval_tasks on the tiny model, in eval_only and in a short training run.
"""

import collections
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest

import grpo
from config import ConfigError, load_config
from episodes.task import load_task
from rollout import Completion
from run import evals, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", os.path.join(ROOT, "config", "tiny.py")]


# ---------------------------------------------------------------- the estimators


def test_pass_at_k_hand_worked():
    """n = 5, c = 2: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; 1 once k > n - c."""
    assert evals.pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)
    assert evals.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    assert evals.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10, abs=1e-12)  # 1 - C(3,3)/C(5,3)
    assert evals.pass_at_k(5, 2, 4) == 1.0 and evals.pass_at_k(5, 2, 5) == 1.0
    for n in (1, 4, 5, 16):
        for k in range(1, n + 1):
            assert evals.pass_at_k(n, 0, k) == 0.0  # nothing correct: no k can hold one
            assert evals.pass_at_k(n, n, k) == 1.0  # everything correct


def test_pass_at_k_is_the_chance_that_k_drawn_without_replacement_hold_a_correct_one():
    """Every (n, c, k) up to n = 7 against brute force: the share of the k-subsets of n samples, c
    of them correct, that hold a correct one; and at n = 2000 against the exact binomials."""
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert evals.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    exact = 1 - Fraction(math.comb(1990, 64), math.comb(2000, 64))  # binomials far past a float
    assert evals.pass_at_k(2000, 10, 64) == pytest.approx(float(exact), rel=1e-12)


def test_pass_ks_every_k_up_to_8_then_powers_of_2_and_n():
    assert evals.pass_ks(1) == [1]
    assert evals.pass_ks(4) == [1, 2, 3, 4]
    assert evals.pass_ks(8) == list(range(1, 9))
    assert evals.pass_ks(9) == [1, 2, 4, 8, 9]
    assert evals.pass_ks(16) == [1, 2, 4, 8, 16]
    assert evals.pass_ks(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_majority_vote_ties_and_missing_answers():
    assert evals.majority_correct(["7", "7", "3", None], [1, 1, 0, 0]) == 1.0
    # a wrong majority
    assert evals.majority_correct(["3", "5", "5", "3", "5"], [1, 0, 0, 1, 0]) == 0.0
    # None casts no vote: one "7" beats no answer three times over
    assert evals.majority_correct([None, None, "7", None], [0, 0, 1, 0]) == 1.0
    assert evals.majority_correct([None, None], [0, 0]) == 0.0  # no vote at all
    # a tie scores the share of the tied answers that are correct (a random tie-break's expectation)
    assert evals.majority_correct(["7", "3", "3", "7"], [1, 0, 0, 1]) == 0.5
    assert evals.majority_correct(["1", "2", "3", "4"], [0, 1, 0, 0]) == 0.25
    assert evals.majority_correct(["1", "2", "2", "1", "9"], [1, 0, 0, 1, 0]) == 0.5  # "9" not tied
    # an answer is as correct as the first completion that gave it
    assert evals.majority_correct(["7", "7", "3"], [1, 0, 0]) == 1.0
    assert evals.majority_correct(["7", "7", "3"], [0, 1, 0]) == 0.0


def test_the_tasks_answers_vote_on_the_final_answer_their_reward_judges():
    """math: a number by its value, "0.5" and "\\frac{1}{2}" alike; a fraction not in lowest terms
    (which the reward rejects) apart. gsm8k, larger, multiply: the last number (multiply: the
    model's own, after the tool's output). Countdown: none (two right equations differ)."""
    def answers(name, *texts):
        task = load_task(load_config(overrides=[f"--task={name}", "--data_path=rows.jsonl"]))
        return [task.answer(t, {}) for t in texts]

    assert answers("math", "<answer>\\boxed{\\frac{1}{2}}</answer>", "<answer>0.50</answer>",
                   "<answer>4/6</answer>", "<think>so 7</think><answer></answer>",
                   "it is 1,234") == ["1/2", "1/2", "4/6", None, "1234"]
    assert answers("gsm8k", "<answer>18</answer>", "so 1,000 eggs", "none") == ["18", "1000", None]
    assert answers("larger", "412 or 077", "no") == ["77", None]
    tool_said = "```python\nprint(2*3)\n```\n<output>\n6\n</output>\n"
    assert answers("multiply", tool_said, tool_said + "The answer is 6.") == [None, "6"]
    assert load_task(load_config(overrides=["--task=countdown"])).answer is None


# ---------------------------------------------------------------- evaluate(), scripted completions

TOY = '''
STOP = ["."]

def problems(split, n, seed):
    return [{"id": f"toy{i}", "answer": a} for i, a in enumerate(["7", "3", "5"])]

def prompt(problem):
    return "Say a digit: "

def reward(completion, problem):
    return {"correct": float(completion.strip() == problem["answer"])}

def answer(completion, problem):
    return completion.strip() if completion.strip().isdigit() else None
'''
GREEDY = ["7", "x", "5"]
SAMPLED = [["7", "7", "3", ""], ["3", "5", "5", "x"], ["5", "1", "1", "5"]]


class Scripted:
    """An engine answering problem i (prompt [i]) with its scripted texts, a token a character."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled, self.calls = greedy, sampled, []

    def generate(self, prompts, n, *, seeds, temperature, stop=None, **kwargs):
        self.calls.append({"n": n, "temperature": temperature, "stop": stop, "seeds": seeds})
        texts = [[self.greedy[p[0]]] if temperature == 0 else self.sampled[p[0]] for p in prompts]
        return [[Completion(p, [1] * len(t), t, [], False) for t in group]
                for p, group in zip(prompts, texts)]


def toy_split(tmp_path, source=TOY, name="toy"):
    path = tmp_path / "toy.py"
    path.write_text(source)
    cfg = load_config(overrides=[f"--task={path}", "--eval_n=4", "--reward_timeout=0",
                                 f"--out_dir={tmp_path}"])
    task = load_task(cfg)
    return cfg, prepare.Split(task, task.problems("test", 3, 0), [[0], [1], [2]], name)


def test_evaluate_reports_avg_pass_and_maj_worked_by_hand(tmp_path):
    """c = 2, 1, 2 correct of 4: avg@4 = 5/12; pass@2 = mean(5/6, 1/2, 5/6) = 13/18; pass@3 =
    mean(1, 3/4, 1) = 11/12; pass@4 = 1. Majorities: "7" right, "5" wrong, "5"/"1" tied -> 1/2."""
    cfg, toy = toy_split(tmp_path)
    engine = Scripted(GREEDY, SAMPLED)
    metrics, texts = evals.evaluate(engine, toy, cfg, seed=1)
    assert texts == GREEDY
    want = {"reward": 2 / 3, "pass@1_greedy": 2 / 3, "avg@4": 5 / 12,
            "mean_correct_sampled": 5 / 12, "pass@1": 5 / 12, "pass@2": 13 / 18, "pass@3": 11 / 12,
            "pass@4": 1.0, "maj@4": 0.5, "response_length": 1.0}
    assert metrics.keys() == {f"eval/toy/{k}" for k in want}
    for k, v in want.items():
        assert metrics[f"eval/toy/{k}"] == pytest.approx(v, abs=1e-6), k
    # both calls stop at the task's STOP; the set has seeds of its own, apart from the test split's
    calls = [(c["n"], c["temperature"], c["stop"]) for c in engine.calls]
    assert calls == [(1, 0.0, ["."]), (4, cfg.temperature, ["."])]
    plain = Scripted(GREEDY, SAMPLED)  # as the training task's own test split: eval/...
    unnamed = prepare.Split(toy.task, toy.problems, toy.prompt_ids)
    unnamed = evals.evaluate(plain, unnamed, cfg, seed=1)[0]
    assert unnamed == {"eval/" + k[len("eval/toy/") :]: v for k, v in metrics.items()}
    assert set(plain.calls[1]["seeds"]).isdisjoint(engine.calls[1]["seeds"])


def test_an_in_run_eval_is_greedy_only_unless_asked(tmp_path):
    """sampled=False (the in-run evals' default, eval_in_run_sampled=False): one greedy call, the
    greedy metrics as the full eval gives them, no sampled ones."""
    cfg, toy = toy_split(tmp_path)
    engine = Scripted(GREEDY, SAMPLED)
    metrics = evals.evaluate(engine, toy, cfg, seed=1, sampled=False)[0]
    full = evals.evaluate(Scripted(GREEDY, SAMPLED), toy, cfg, seed=1)[0]
    greedy = ("reward", "pass@1_greedy", "response_length")
    assert metrics == {f"eval/toy/{k}": full[f"eval/toy/{k}"] for k in greedy}
    assert [c["temperature"] for c in engine.calls] == [0.0]


def test_evaluate_without_answer_or_correct_logs_what_it_can(tmp_path, recwarn):
    """No answer(): no maj@n. An answer() that raises casts no vote (and warns). No "correct": no
    accuracy."""
    cfg, toy = toy_split(tmp_path, TOY.replace("def answer", "def _answer"))
    metrics = evals.evaluate(Scripted(GREEDY, SAMPLED), toy, cfg, seed=1)[0]
    assert "eval/toy/maj@4" not in metrics and metrics["eval/toy/pass@2"] == pytest.approx(13 / 18)
    cfg, toy = toy_split(tmp_path, TOY.replace("return completion.strip() if", "return 1 // 0 if"))
    assert evals.evaluate(Scripted(GREEDY, SAMPLED), toy, cfg, seed=1)[0]["eval/toy/maj@4"] == 0.0
    assert "answer() raised ZeroDivisionError" in str(recwarn.pop(UserWarning).message)
    cfg, toy = toy_split(tmp_path, TOY.replace('{"correct": float(', '{"close": float('))
    metrics = evals.evaluate(Scripted(GREEDY, SAMPLED), toy, cfg, seed=1)[0]
    assert sorted(metrics) == ["eval/toy/response_length", "eval/toy/reward"]


def test_eval_table_has_a_row_per_set_and_a_column_per_metric(tmp_path):
    _, toy = toy_split(tmp_path)
    main = prepare.Split(toy.task, toy.problems[:2], toy.prompt_ids[:2])
    metrics = {"eval/reward": 0.5, "eval/pass@1_greedy": 0.25, "eval/response_length": 12.345,
               "eval/toy/reward": 1.0, "eval/toy/pass@1_greedy": 0.5, "eval/toy/avg@4": 0.4166667,
               "eval/toy/mean_correct_sampled": 0.4166667, "eval/toy/maj@4": 0.5,
               "eval/toy/response_length": 1.0, "eval/updates": 3}
    assert evals.eval_table([main, toy], metrics, "larger").splitlines() == [
        "eval set             problems  reward  pass@1_greedy  avg@4  maj@4  response_length",
        "larger (test split)         2   0.500          0.250      -      -             12.3",
        "toy                         3   1.000          0.500  0.417  0.500              1.0"]


# ---------------------------------------------------------------- settings and pre-flight


def test_eval_k_is_now_eval_n(tmp_path):
    with pytest.raises(ConfigError, match="command line: 'eval_k' is now 'eval_n'"):
        load_config(overrides=["--eval_k=8"])
    run_file = tmp_path / "run.py"
    run_file.write_text("eval_k = 8\n")
    with pytest.raises(ConfigError, match=r"run.py: 'eval_k' is now 'eval_n' \(samples per eval"):
        load_config(str(run_file))
    assert load_config(overrides=["--eval_n=8"]).eval_n == 8
    with pytest.raises(ConfigError, match="eval_n=0 must be >= 1"):
        load_config(overrides=["--eval_n=0"])


def write_rows(path, count):
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n")
    return path


def test_eval_tasks_load_before_any_model_and_fail_clearly(tmp_path):
    """A data file's set is every row (its own test split where it has one), a task's its test
    split; each set is named by its file. A missing file, a task that reads a dataset, a bad row,
    two sets of one name: a ConfigError from prepare_run, naming the set, before any model loads."""
    rows = write_rows(tmp_path / "rows.jsonl", 30)
    out = f"--out_dir={tmp_path / 'out'}"
    sets = prepare.prepare_run([*TINY, out, f"--eval_tasks={rows}, larger", "--test_size=5"])[6]
    assert [(name, len(problems)) for name, _, problems in sets] == [("rows", 30), ("larger", 5)]
    assert sets[0][1].answer is not None and sets[0][2][0]["id"] == "rows.jsonl:1"
    bad = [(f"--eval_tasks={tmp_path / 'none.jsonl'}",
            r"eval_tasks: .*none.jsonl: data_path=.* not found"),
           ("--eval_tasks=nosuchtask",
            "eval_tasks: nosuchtask: task='nosuchtask': choose a built-in task"),
           ("--eval_tasks=gsm8k",
            r"eval_tasks: gsm8k has no problems\(\) of its own .* name the data file"),
           (f"--eval_tasks={rows},{tmp_path / 'x' / 'rows.jsonl'}", "two sets named 'rows'")]
    for arg, message in bad:
        with pytest.raises(ConfigError, match=message):
            prepare.prepare_run([*TINY, out, arg])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"eval_tasks: .*broken.jsonl: .*, line 2: needs a non"):
        prepare.prepare_run([*TINY, out, f"--eval_tasks={broken}"])


# ---------------------------------------------------------------- on the tiny model

DIGIT = '''
def problems(split, n, seed):
    return [{"id": f"digit:{i}", "digit": str(i % 10)} for i in range(n)]

def prompt(problem):
    return [{"role": "user", "content": f"Write the digit {problem['digit']}:"}]

def reward(completion, problem):
    return {"correct": float(problem["digit"] in completion)}

def answer(completion, problem):
    digits = [c for c in completion if c.isdigit()]
    return digits[-1] if digits else None
'''


class Spy:
    """The run's engine, with every generate call's arguments and completions kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, **kwargs):
        groups = self.engine.generate(prompts, n, **kwargs)
        self.calls.append((kwargs, groups))
        return groups


def naive(problems, groups):
    """avg@n, pass@k and maj@n of DIGIT's completions, computed the long way."""
    n = len(groups[0])
    right = [[float(p["digit"] in c.text) for c in g] for p, g in zip(problems, groups)]
    out = {f"avg@{n}": sum(map(sum, right)) / (n * len(right))}
    for k in range(1, n + 1):  # the share of k-subsets holding a correct completion, per problem
        out[f"pass@{k}"] = sum(sum(map(any, itertools.combinations(r, k))) / math.comb(n, k)
                               for r in right) / len(right)
    maj = []
    for g, r in zip(groups, right):
        said = [[ch for ch in c.text if ch.isdigit()][-1:] for c in g]
        votes = collections.Counter(s[0] for s in said if s)
        top = [a for a, v in votes.items() if v == max(votes.values(), default=0)]
        first = {a: next(ok for s, ok in zip(said, r) if s == [a]) for a in top}
        maj.append(sum(first.values()) / len(top) if top else 0.0)
    out[f"maj@{n}"] = sum(maj) / len(maj)
    return out


def test_eval_only_with_eval_tasks_on_the_tiny_model(tmp_path, capsys):
    """eval_only with a task file and a data file as eval sets: every set's metrics under its name,
    equal to the long way's on the completions the engine gave; the table has a row per set;
    eval.jsonl has it all."""
    (tmp_path / "digit.py").write_text(DIGIT)
    rows = write_rows(tmp_path / "sums.jsonl", 3)
    spies = []
    grpo.main([*TINY, f"--out_dir={tmp_path / 'out'}", "--engine=hf", "--eval_only=true",
               "--test_size=3", "--eval_n=4", f"--eval_tasks={tmp_path / 'digit.py'},{rows}",
               "--max_prompt_len=128", "--micro_batch_tokens=256"],
              wrap_engine=lambda e: spies.append(Spy(e)) or spies[0])
    calls = spies[0].calls
    assert len(calls) == 6  # greedy and sampled for the test split, digit and sums, in that order
    assert all(kwargs["stop"] is None for kwargs, _ in calls)  # no STOP in these tasks
    results = json.loads((tmp_path / "out" / "eval.jsonl").read_text())
    problems = [{"id": f"digit:{i}", "digit": str(i)} for i in range(3)]
    for k, v in naive(problems, calls[3][1]).items():
        assert results[f"eval/digit/{k}"] == pytest.approx(v, abs=1e-6), k
    assert 0 < results["eval/digit/avg@4"] < 1  # the test means something: some right, some wrong
    greedy = [g[0].text for g in calls[2][1]]
    assert results["eval/digit/pass@1_greedy"] == pytest.approx(
        sum(str(i) in t for i, t in enumerate(greedy)) / 3)
    assert [e["completion"] for e in results["examples/digit"]] == greedy
    assert results["eval/sums/maj@4"] == 0.0 and "eval/sums/parsed" in results
    assert "eval/digit/parsed" not in results  # the task reports none
    assert "eval/pass@4" in results and "eval/maj@4" not in results  # digits has no answer()
    table = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("eval set"))
    header = table[start].split()
    assert header[:6] == ["eval", "set", "problems", "reward", "pass@1_greedy", "avg@4"]
    assert [line.split()[0] for line in table[start + 1 : start + 4]] == ["digits", "digit", "sums"]
    assert table[start + 3].split()[1] == "3"  # every row of the file
    assert f"{results['eval/digit/maj@4']:.3f}" in table[start + 2].split()


def test_a_run_with_eval_tasks_logs_each_set_and_plots(tmp_path):
    """2 steps with eval_every=1: the base model's eval at step 0 (greedy only, as in-run evals
    are by default) and the last at the end (full), each set's metrics under its name in
    metrics.jsonl; run/plot.py draws the run."""
    (tmp_path / "digit.py").write_text(DIGIT)
    rows = write_rows(tmp_path / "sums.jsonl", 2)
    out = tmp_path / "out"
    args = [*TINY, f"--out_dir={out}", "--engine=hf", "--max_steps=2", "--eval_every=1",
            "--test_size=3", "--eval_n=2", f"--eval_tasks={tmp_path / 'digit.py'},{rows}",
            "--max_prompt_len=128", "--micro_batch_tokens=256"]
    proc = subprocess.run([sys.executable, "grpo.py", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["eval/updates"] for m in metrics] == [0, 2]
    for name in ("eval/", "eval/digit/", "eval/sums/"):
        assert {name + "reward", name + "pass@1_greedy"} <= metrics[0].keys()
        assert {name + k for k in ("avg@2", "pass@1", "pass@2")}.isdisjoint(metrics[0])
        keys = ("reward", "pass@1_greedy", "avg@2", "pass@1", "pass@2")
        assert {name + k for k in keys} <= metrics[1].keys()
    m = metrics[1]
    assert m["eval/digit/pass@1"] == pytest.approx(m["eval/digit/avg@2"])  # a 1/0 "correct"
    assert m["eval/digit/pass@1"] <= m["eval/digit/pass@2"] and 0 <= m["eval/digit/maj@2"] <= 1
    plot = [sys.executable, "-m", "run.plot", str(out), "--out", str(tmp_path / "run.png")]
    proc = subprocess.run(plot, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.getsize(tmp_path / "run.png") > 10_000
    from run import plot

    assert plot.resolve(metrics, "eval/pass@n") == "eval/pass@2"
    # the test split's task (digits) has no answer(): no maj@n to plot
    assert plot.resolve(metrics, "eval/maj@n") == "eval/maj@n"
