"""TRL-style reward functions in a task file, reasoning-gym tasks, the reward audit (run/audit.py).

    pytest tests/test_task_extras.py
"""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from config import ConfigError, load_config
from episodes.task import load_problems, load_task, score
from run import audit as audit_module
from run.audit import audit, check_task_output, replay
from scoring import runner
from scoring.runner import task_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "config", "tiny.py")


def setup(*overrides):
    cfg = load_config(None, list(overrides))
    return cfg, load_task(cfg)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_run(out_dir, *args):
    """grpo.py on the tiny config for 3 steps (the HF engine: no vLLM start-up); its metrics."""
    command = [sys.executable, os.path.join(ROOT, "grpo.py"), "--config", TINY,
               f"--out_dir={out_dir}", "--max_steps=3", "--engine=hf", "--eval_every=0",
               "--test_size=4", *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_jsonl(os.path.join(out_dir, "metrics.jsonl"))


# ---------------------------------------------------------------- TRL-style reward functions

# Written as TRL users write them; each checks it is called as TRL calls it (or raises, and fails).
TRL_TASK = '''
CHAT = {chat}
PROBLEMS = [{{"id": "a", "answer": "4", "kind": "math"}},
            {{"id": "b", "answer": "7", "kind": "math"}},
            {{"id": "c", "answer": None, "kind": "chat"}}]


def problems(split, n, seed):
    return [{{**p, "id": split + p["id"]}} for p in PROBLEMS]


def prompt(problem):
    text = "What is " + problem["id"] + "?"
    return [{{"role": "user", "content": text}}] if CHAT else text


def text(completion):
    """A chat prompt's completion comes as the assistant's message, a raw prompt's as a string."""
    if CHAT:
        assert completion[0]["role"] == "assistant"
        return completion[0]["content"]
    assert isinstance(completion, str)
    return completion


def accuracy_reward(prompts, completions, answer, **kwargs):
    assert prompts == [prompt({{"id": i}}) for i in kwargs["id"]]  # prompt()'s value, in order
    return [None if a is None else float(text(c) == a) for c, a in zip(completions, answer)]


async def brevity(completions, completion_ids, kind, **kwargs):  # TRL allows async functions
    return [None if k == "chat" else -0.01 * len(ids) for ids, k in zip(completion_ids, kind)]
{extra}
reward_funcs = [accuracy_reward, brevity{more}]
reward_weights = [2.0, 1.0{more_weights}]
'''


def trl_task(tmp_path, chat=True, extra="", more="", more_weights="", name="trl_task.py"):
    path = tmp_path / name
    path.write_text(TRL_TASK.format(chat=chat, extra=extra, more=more, more_weights=more_weights))
    return str(path)


@pytest.mark.parametrize("chat,timeout,workers", [(True, 10, 0), (False, 10, 2), (True, 0, 0)])
def test_trl_reward_functions_weighed_as_trl_weighs_them(tmp_path, capsys, monkeypatch, chat,
                                                         timeout, workers):
    """TRL's sum: weights times scores, a None left out; all None scores 0 and is counted."""
    monkeypatch.setattr(runner, "_REPORTED", set())  # its warnings are printed once a process
    cfg, task = setup(f"--task={trl_task(tmp_path, chat)}", f"--reward_timeout={timeout}",
                      f"--reward_workers={workers}")
    assert task.reward_names == ["accuracy_reward", "brevity"] and task.correct == "accuracy_reward"
    problems = load_problems(cfg, task, "train")
    check_task_output(task, problems, cfg)
    texts, ids = ["4", "5", "hello"], [[5, 6], [1, 2, 3], [9]]
    rewards, comps = score(task, texts, problems, [2, 3, 1], cfg, ids)
    # a: 2 * 1 - 0.01 * 2; b: 2 * 0 - 0.01 * 3; c: both None: NaN, left out of its group (TRL's)
    assert rewards.tolist()[:2] == pytest.approx([1.98, -0.03]) and math.isnan(rewards[2])
    assert comps["accuracy_reward"].tolist() == [1.0, 0.0, 0.0]
    assert comps["brevity"].tolist() == pytest.approx([-0.02, -0.03, 0.0])
    assert comps["correct"].tolist() == [1.0, 0.0, 0.0]  # accuracy_reward's: acc and pass@k
    assert comps["unscored"].tolist() == [0.0, 0.0, 1.0]
    assert comps["errors"].tolist() == [0.0, 0.0, 0.0]
    assert "every reward function returned None" in capsys.readouterr().err
    # reward_weights by function name overrides the file's
    cfg.component_weights = {"brevity": 0.0}
    rewards = score(task, texts, problems, [2, 3, 1], cfg, ids)[0]
    assert rewards.tolist()[:2] == pytest.approx([2.0, 0.0])


def test_unscored_completions_and_array_scores_as_trls_own_trainer_treats_them(tmp_path):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions on the tiny model, two reward
    functions with fixed scores per row, against this project on the same scores: a completion
    every function leaves out (None, or NaN) is out of its group's baseline and gets advantage 0
    ([1, None, None, 0] -> [0.707, 0, 0, -0.707], where this project gave [1.5, -0.5, -0.5, -0.5]);
    numpy and torch scores count as numbers. (TRL adds 1e-4 to the std where this floors it: 1e-4
    apart.)"""
    pytest.importorskip("trl")
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from advantage import group_advantages
    from infra.model_files import build_tiny
    from rewards import score_batch

    first = [1.0, None, None, 0.0, np.float32(0.5), float("nan"), 2, torch.tensor(1.0)]
    second = np.array([None, None, None, None, 0.25, None, np.float64(0.5), None], dtype=object)

    def accuracy_reward(completions, **kwargs):
        return list(first)

    def other(completions, **kwargs):
        return second

    folder = build_tiny(str(tmp_path / "tiny"))
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=4, report_to="none", use_cpu=True,
                      scale_rewards="group", save_strategy="no")
    trainer = GRPOTrainer(model=folder, reward_funcs=[accuracy_reward, other], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
                          processing_class=AutoTokenizer.from_pretrained(folder))
    trl = trainer._generate_and_score_completions([{"prompt": "a"}] * 4 + [{"prompt": "b"}] * 4)
    task = SimpleNamespace(correct="accuracy_reward")
    rows = runner.reward_rows(task, (8, {"accuracy_reward": first, "other": second}))
    assert [r["unscored"] for r in rows] == [0, 1, 1, 0, 0, 1, 0, 0]
    rewards, _ = score_batch(rows, [1] * 8, {"unscored": 0.0, "correct": 0.0})
    ours = group_advantages(rewards, 4)
    assert ours.tolist() == pytest.approx(trl["advantages"].tolist(), abs=1e-3)
    assert ours[:4].tolist() == pytest.approx([0.7071, 0, 0, -0.7071], abs=1e-4)
    assert [ours[i].item() for i in (1, 2, 5)] == [0.0] * 3


def test_a_nan_or_inf_score_leaves_out_one_completion_not_the_batch(tmp_path):
    """One function's NaN (or inf) on 2 of 16 completions: those two are left out of that function's
    sum as a None would be, the batch scores, nothing is counted an error (it zeroed all 16)."""
    extra = """
import math


def shaky(completions, **kwargs):
    return [math.nan if i == 3 else math.inf if i == 9 else 0.5 for i in range(len(completions))]
"""
    path = trl_task(tmp_path, chat=False, extra=extra, more=", shaky", more_weights=", 1.0")
    cfg, task = setup(f"--task={path}")
    problems = load_problems(cfg, task, "train")[:2] * 8
    rewards, comps = score(task, ["4"] * 16, problems, [1] * 16, cfg, [[1]] * 16)
    assert comps["errors"].tolist() == [0.0] * 16 and comps["unscored"].sum() == 0
    assert comps["shaky"].tolist() == [0.0 if i in (3, 9) else 0.5 for i in range(16)]
    want = [2 * (p["answer"] == "4") - 0.01 + 0.5 * (i not in (3, 9))
            for i, p in enumerate(problems)]
    assert rewards.tolist() == pytest.approx(want)


def test_a_failing_reward_function_fails_its_share(tmp_path):
    """A raise, a hang, a wrong type: each completion of its share scores 0, in reward/errors."""
    extra = '''
import time


def fragile(completions, **kwargs):
    said = [text(c) for c in completions]
    if "boom" in said:
        raise ValueError("boom")
    if "hang" in said:
        time.sleep(60)
    return ["one"] * len(said) if "str" in said else [1.0] * len(said)
'''
    path = trl_task(tmp_path, extra=extra, more=", fragile", more_weights=", 0.5")
    cfg, task = setup(f"--task={path}", "--reward_workers=2", "--reward_timeout=0.5")
    problems = load_problems(cfg, task, "train")
    p = [problems[0]] * 4
    for bad, failure in (("boom", "error"), ("hang", "timeout"), ("str", "error")):
        # shares of 2: the one holding `bad` fails, the other scores
        rewards, comps = score(task, ["4", "x", bad, "4"], p, [1] * 4, cfg, [[1]] * 4)
        assert rewards.tolist() == pytest.approx([2.49, 0.49, 0.0, 0.0]), bad
        assert comps["errors"].tolist() == [0.0, 0.0, 1.0, 1.0], bad
        assert comps["timeouts"].tolist() == [0.0, 0.0] + [float(failure == "timeout")] * 2
    cfg.reward_workers = 0  # one share, the whole batch
    rewards, comps = score(task, ["4", "x", "boom", "4"], p, [1] * 4, cfg, [[1]] * 4)
    assert rewards.tolist() == [0.0] * 4 and comps["errors"].tolist() == [1.0] * 4


def test_reward_functions_checked_before_the_run(tmp_path):
    """Every misuse fails in pre-flight, naming the file and what to change."""
    path = trl_task(tmp_path)
    both = "reward_funcs replace reward\\(\\) and WEIGHTS"
    bad_files = {
        "def reward(completion, problem):\n    return 1.0\n": both,
        "WEIGHTS = {'brevity': 2}\n": both,
        "reward_weights = [1.0]\n": "reward_weights must be 2 numbers",
        "def format(completions, **kwargs):\n    return [1.0] * len(completions)\n"
        "reward_funcs = [accuracy_reward, format]\n": "names \\['format'\\] are taken",
        "reward_funcs = [accuracy_reward, accuracy_reward]\n": "\\['accuracy_reward'\\] are taken",
        "CORRECT = 'accuracy'\n": "CORRECT='accuracy' names none of the reward functions",
        "reward_funcs = []\n": "reward_funcs must be a non-empty list",
    }
    for i, (tail, message) in enumerate(bad_files.items()):
        bad = tmp_path / f"bad{i}.py"
        bad.write_text(open(path).read() + tail)
        with pytest.raises(ConfigError, match=message):
            setup(f"--task={bad}")
    with pytest.raises(ConfigError, match="names \\['brevty'\\], not reward functions"):
        setup(f"--task={path}", "--reward_weights=brevty:2")
    with pytest.raises(ConfigError, match="names \\['correct'\\], not reward functions.*; "
                       "correct is accuracy_reward's score, weigh that function"):
        setup(f"--task={path}", "--reward_weights=correct:2")
    # CORRECT picks another function; "" none
    for value, correct in (("'brevity'", "brevity"), ("''", "")):
        named = tmp_path / f"correct_{correct}.py"
        named.write_text(open(path).read() + f"CORRECT = {value}\n")
        assert setup(f"--task={named}")[1].correct == correct
    # a function that cannot take TRL's keywords, or gives the wrong type: known before any model
    calls = {
        "def narrow(completions, answer):\n    return [0.0] * len(completions)\n":
            "narrow\\(completions, answer\\) cannot be called as TRL calls it.*"
            "\\['answer', 'id', 'kind'\\].*\\*\\*kwargs",
        "def short(completions, **kwargs):\n    return []\n":
            "reward function short returned \\[\\]; expected a list of 1 floats",
        "def word(completions, **kwargs):\n    return ['one']\n":  # a NaN is left out (TRL's)
            "reward function word returned 'one'; expected a float or None",
    }
    for i, (function, message) in enumerate(calls.items()):
        name = function.split()[1].split("(")[0]
        bad = tmp_path / f"call{i}.py"
        bad.write_text(open(path).read() + function + f"reward_funcs = [accuracy_reward, {name}]\n"
                       "reward_weights = [1.0, 1.0]\n")
        cfg, task = setup(f"--task={bad}")
        with pytest.raises(ConfigError, match=message):
            check_task_output(task, load_problems(cfg, task, "train"), cfg)


DIGITS_TRL = '''"""The digits task with TRL reward functions: a random model climbs them."""
import itertools

from data.split import in_split


def problems(split, n, seed):
    keys = (f"d:{i}" for i in itertools.count() if in_split(f"d:{i}", split))
    return [{"id": key, "example": key[2:]} for key in itertools.islice(keys, n)]


def prompt(problem):
    return [{"role": "user", "content": "Write only digits, like " + problem["example"] + ":"}]


def accuracy_reward(completions, **kwargs):
    texts = [c[0]["content"].replace(" ", "") for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]


def short_reward(completions, completion_ids, **kwargs):
    return [None if len(ids) > 16 else 0.1 for ids in completion_ids]


reward_funcs = [accuracy_reward, short_reward]
'''


def test_a_run_with_reward_functions_logs_each(tmp_path):
    """grpo.py --task=FILE with reward_funcs: reward/<name> each, acc from accuracy_reward."""
    path = tmp_path / "digits_trl.py"
    path.write_text(DIGITS_TRL)
    out = tmp_path / "run"
    metrics = tiny_run(out, f"--task={path}", "--sample_every=1")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        accuracy, short = m["reward/accuracy_reward"], m["reward/short_reward"]
        assert 0 <= accuracy <= 1 and m["reward/correct"] == accuracy and m["acc"] == accuracy
        assert 0 <= short <= 0.1 and m["reward/errors"] == 0 and m["reward/unscored"] == 0
        # the logged reward is the weighted sum (weights 1): both functions' means
        assert m["reward"] == pytest.approx(accuracy + short, abs=1e-6)
    assert "eval/pass@4" in metrics[-1]
    assert replay(str(out / "samples.jsonl")) == 0  # the dumps re-score to what the run logged


# ---------------------------------------------------------------- reasoning-gym


@pytest.mark.parametrize("name,wrong", [("countdown", 0.05), ("leg_counting", 0.0)])
def test_reasoning_gym_problems_are_fixed_disjoint_and_scored_by_the_dataset(name, wrong):
    """Two fixed streams, split by the question; the dataset's own scorer on the answer tag, through
    the run's path (forked workers), on problems gone through JSON as samples.jsonl has them."""
    args = ["--task=reasoning_gym", f"--rg_dataset={name}", "--train_size=12", "--test_size=3"]
    cfg, task = setup(*args)
    train, test = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    assert len(train) == 12 and len(test) == 3
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    assert len({p["question"] for p in train}) == 12
    cfg, task = setup(*args)  # again, in the same process: the same problems
    assert load_problems(cfg, task, "train") == train and load_problems(cfg, task, "test") == test
    other = setup(*args, "--data_seed=1")
    questions = {p["question"] for p in load_problems(other[0], other[1], "train")}
    assert not questions & {p["question"] for p in train}
    problems = [json.loads(json.dumps(p)) for p in train[:3] + test[:1]]
    right = [task.reference(p) for p in problems]
    assert all(p["answer"] in r for p, r in zip(problems, right))
    texts = right + ["<think>hm</think><answer>-7</answer>", "no answer"]
    rewards, comps = score(task, texts, problems + problems[:2], [1] * 6, cfg)
    task.close()
    # the dataset's scorer: 1 for its answer, `wrong` for a wrong one (its choice); format 0.1; no
    # tag -0.2.
    # (leg_counting's is reasoning-gym's default: an answer that holds the right one scores a share)
    assert comps["correct"].tolist()[:5] == [1.0] * 4 + [pytest.approx(wrong)]
    assert rewards.tolist()[:5] == pytest.approx([1.1] * 4 + [wrong + 0.1])
    assert comps["parsed"].tolist() == [1.0] * 5 + [0.0] and comps["errors"].tolist() == [0.0] * 6


def test_reasoning_gym_entries_come_back_from_json_whole():
    """score_answer compares grids as tuples: JSON's lists become tuples again (else 0.05)."""
    cfg, task = setup("--task=reasoning_gym", "--rg_dataset=arc_agi", "--train_size=2",
                      "--test_size=1")
    problem = json.loads(json.dumps(load_problems(cfg, task, "train")[0]))
    assert isinstance(problem["metadata"]["output"], list) and problem["rg"]["tuples"]
    assert task.reward(task.reference(problem), problem)["correct"] == 1.0
    task.close()


def test_reasoning_gym_settings_fail_clearly():
    with pytest.raises(ConfigError, match="rg_dataset='countdwn': name one of reasoning-gym's "
                       "datasets, e.g. --rg_dataset=countdown; closest: countdown"):
        setup("--task=reasoning_gym", "--rg_dataset=countdwn")
    with pytest.raises(ConfigError, match="rg_dataset='': name one of"):
        setup("--task=reasoning_gym")
    with pytest.raises(ConfigError, match="'graph_color': its entries do not come back from JSON"):
        cfg, task = setup("--task=reasoning_gym", "--rg_dataset=graph_color", "--train_size=2")
        load_problems(cfg, task, "train")


def test_three_steps_on_a_reasoning_gym_task(tmp_path):
    metrics = tiny_run(tmp_path, "--task=reasoning_gym", "--rg_dataset=leg_counting",
                       "--train_size=16", "--max_prompt_len=992", "--micro_batch_tokens=1200")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["reward/errors"] == 0 and m["acc"] is not None for m in metrics)
    assert metrics[-1]["eval/pass@4"] is not None


# ---------------------------------------------------------------- the reward audit

PLANTED = '''
import re
import time

from rewards import extract_answer


def problems(split, n, seed):
    return [{{"id": f"{{split}}{{i}}", "answer": str(17 + 3 * i)}} for i in range(n)]


def prompt(problem):
    question = f"What is {{int(problem['answer']) - 5}} + 5? Answer in the tag."
    return [{{"role": "user", "content": question}}]


def reference(problem):
    return f"<answer>{{problem['answer']}}</answer>"


def reward(completion, problem):
    {flaw}
    return {{"correct": float(extract_answer(completion) == problem["answer"])}}
'''
FLAWS = {  # a planted flaw: what the audit must print
    "says_correct": ('if "correct" in completion.lower():\n        return 1.0',
                     "suspicious: says correct, problem"),
    "ascii_only": ('completion.encode("ascii")',
                   "crash: unicode junk, problem train0: UnicodeEncodeError"),
    "sleeps": ("if len(completion) > 500_000:\n        time.sleep(60)",
               "timeout: huge (1 MB), problem train0"),
    "any_tag": ('if problem["answer"] in re.findall("<answer>(.*?)</answer>", completion):\n'
                "        return 1.0", "suspicious: several answers, gold between, problem train0"),
    "contains": ('if problem["answer"] in completion:\n        return 1.0',
                 "suspicious: gold mentioned, another answer, problem train0"),
    "rounds": ("if re.fullmatch(r'<answer>[0-9.]+</answer>', completion):\n"
               "        said = round(float(extract_answer(completion)))\n"
               "        return float(said == int(problem['answer']))",
               "suspicious: rounds to the answer (17.4), problem train0: 1 >= the reference's 1"),
    "nan": ("if not completion.strip():\n        return float('nan')",
            "non-number: empty, problem train0"),
}


def planted(tmp_path, name, flaw="pass"):
    path = tmp_path / f"{name}.py"
    path.write_text(PLANTED.format(flaw=flaw))
    return str(path)


@pytest.mark.parametrize("name", FLAWS)
def test_the_audit_finds_each_planted_flaw(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(audit_module, "AUDIT_PROBLEMS", 1)
    flaw, finding = FLAWS[name]
    assert audit(planted(tmp_path, name, flaw), ["--reward_timeout=1"]) > 0
    out = capsys.readouterr().out
    assert finding in out and out.rstrip().endswith("FAIL"), out


def test_the_audit_passes_an_honest_reward_and_reports_a_slow_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(audit_module, "AUDIT_PROBLEMS", 1)
    assert audit(planted(tmp_path, "honest")) == 0
    out = capsys.readouterr().out
    assert "reference scores 1; 19 cases, 12 fuzzed references" in out, out
    assert out.rstrip().endswith("PASS"), out
    slow = planted(tmp_path, "slow", "if len(completion) > 500_000:\n        time.sleep(1.2)")
    assert audit(slow) == 0  # slow calls are reported, not failures
    out = capsys.readouterr().out
    assert "slow: huge (1 MB), problem train0: 1." in out, out
    assert "0 failures, 2 slow calls: PASS" in out, out


def test_the_audit_command_exits_non_zero_on_a_finding(tmp_path):
    def command(*args):
        return subprocess.run([sys.executable, "-m", "episodes.task", "--audit", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)

    honest = command(planted(tmp_path, "honest"))
    bad = command(planted(tmp_path, "bad", FLAWS["says_correct"][0]))
    assert honest.returncode == 0 and "PASS" in honest.stdout, honest.stdout + honest.stderr
    assert bad.returncode == 1 and "suspicious: says correct" in bad.stdout, bad.stdout + bad.stderr
    missing = command("nosuch")
    assert missing.returncode == 1
    assert "error: task='nosuch': choose a built-in task" in missing.stderr


def data_files(tmp_path):
    """A GSM8K-style file, and a file of math and code rows: for the tasks that take a dataset."""
    gsm8k, mixed = tmp_path / "gsm8k.jsonl", tmp_path / "mixed.jsonl"
    questions = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many?",
                  "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"} for i in range(1, 30)]
    gsm8k.write_text("".join(json.dumps(q) + "\n" for q in questions))
    math = [{"prompt": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(1, 4)]
    code = [{"prompt": f"Write add{i}(a) that returns a + {i}.",
             "tests": [f"assert add{i}(1) == {1 + i}"],
             "solution": f"def add{i}(a):\n    return a + {i}"} for i in range(1, 4)]
    # the first three (the audited): two code rows, each the other's wrong answer
    rows = [code[0], math[0], code[1], math[1], code[2], math[2]]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"gsm8k": [f"--data_path={gsm8k}"], "dataset": [f"--data_path={mixed}"]}


BUILTIN_AUDITS = {"countdown": [], "countdown_base": [], "digits": [], "larger": [], "multiply": [],
                  "math": [], "code": [], "gsm8k": None, "dataset": None,
                  "reasoning_gym": ["--rg_dataset=leg_counting"], "guess": [], "calculator": [],
                  "multiply_call": []}


@pytest.mark.parametrize("name", BUILTIN_AUDITS)
def test_every_builtin_task_passes_the_audit(tmp_path, capsys, name):
    from episodes.task import builtin_tasks
    from scoring import sandbox

    # openenv's audit needs its server: tests/test_openenv.py
    assert set(BUILTIN_AUDITS) | {"openenv"} == set(builtin_tasks())
    args = BUILTIN_AUDITS[name] if BUILTIN_AUDITS[name] is not None else data_files(tmp_path)[name]
    # a deadline far past any call's time: the machine running the tests may be busy
    args = [*args, f"--sandbox={sandbox.best()[0]}", "--reward_timeout=120"]
    assert audit(name, args) == 0
    out = capsys.readouterr().out
    if name in ("guess", "calculator"):  # an environment's reward: its turns are audited
        assert "environment turns; 0 failures: PASS" in out, out
        return
    assert out.count("reference scores") == 3 and "no wrong answer" not in out, out


def test_holes_the_audit_found_are_closed():
    """A copied question answers nothing; nor does a reasoning-gym answer too long to be one."""
    _, larger = setup("--task=larger")
    p = {"id": "x", "a": 37, "b": 52}
    assert larger.reward("Which is larger, 37 or 52? Answer with the number.", p)["correct"] == 0.0
    assert larger.reward("It is 52", p)["correct"] == 1.0
    _, math = setup("--task=math")
    for key in ("question", "prompt"):
        q = {"id": "y", key: "What is 1 * 3?", "answer": "3"}
        assert math.reward(q[key], q)["correct"] == 0.0  # its last number is the answer
        assert math.reward(q[key] + " 1 * 3 = 3", q)["correct"] == 1.0
    _, gsm8k = setup("--task=gsm8k", "--data_path=unused.jsonl")
    q = {"question": "Ann had 2 apples and ate none. How many has she? 2", "answer": "#### 2"}
    assert gsm8k.reward(q["question"], q)["correct"] == 0.0
    cfg, rg = setup("--task=reasoning_gym", "--rg_dataset=countdown", "--train_size=1",
                    "--test_size=1")
    problem = load_problems(cfg, rg, "train")[0]
    long = f"<answer>{problem['answer']}{' ' * 20_000}+ 0</answer>"
    assert rg.reward(long, problem)["parsed"] == 0.0
    rg.close()


# a task file that calls reasoning-gym's scorers in the trainer's process, as this project did
# before EXECUTES_TEXT: what the audit must catch
UNFIXED = """from episodes import task as _task
_rg = _task.import_file({path!r})
configure, problems, prompt, reward, reference = (_rg.configure, _rg.problems, _rg.prompt,
                                                   _rg.reward, _rg.reference)
OPTIONS = {{"rg_dataset": ""}}  # configure's setting
"""


@pytest.mark.parametrize("name", ["countdown", "string_insertion", "n_queens",
                                  "simple_integration"])
def test_reasoning_gym_answers_that_are_python_neither_run_nor_read_the_gold(name, tmp_path):
    """EXECUTES_TEXT: the scorers run in the sandbox under the text guard. Their own answers still
    score 1; an answer that is Python runs nowhere (it would make a folder here) and scores no more
    than nonsense; the names of the scorer's frame (the gold) are out of its reach."""
    cfg, task = setup("--task=reasoning_gym", f"--rg_dataset={name}", "--train_size=2")
    assert task.executes_text
    problem = json.loads(json.dumps(load_problems(cfg, task, "train")[0]))
    marker = tmp_path / "ran"
    mkdir = f"__import__('os').mkdir({str(marker)!r})"
    attacks = [mkdir, f"[{mkdir}]",
               "oracle_answer", "[r.split() for r in valid_solutions[0].split(chr(10))]",
               "globals()", "(lambda: oracle_answer)()", "entry['answer']"]
    texts = [task.reference(problem), "<answer>nonsense</answer>",
             *(f"<answer>{a}</answer>" for a in attacks)]
    try:
        got = task_rewards(task, texts, [problem] * len(texts), cfg.reward_timeout)
    finally:
        task.close()  # its sandboxed scorer, which would live as long as this process
    correct = [g["correct"] for g in got]
    assert correct[0] == 1.0 and not marker.exists()
    assert max(correct[2:]) <= correct[1], dict(zip(attacks, correct[2:]))


def test_the_audit_finds_python_answers_run_outside_a_sandbox(tmp_path, capsys):
    """The audit's probes, on reasoning-gym's string_insertion: the unfixed task file (its scorer
    evals the answer in this process) fails with both findings; the shipped one passes."""
    unfixed = tmp_path / "unfixed_rg.py"
    unfixed.write_text(UNFIXED.format(path=os.path.join(ROOT, "tasks", "reasoning_gym.py")))
    assert audit(str(unfixed), ["--rg_dataset=string_insertion"]) > 0
    out = capsys.readouterr().out
    assert "executes:" in out and "declare EXECUTES_TEXT = True" in out
    assert "reads the gold:" in out and "oracle_answer" in out
    assert audit("reasoning_gym", ["--rg_dataset=string_insertion"]) == 0
    out = capsys.readouterr().out
    assert "executes:" not in out and "reads the gold:" not in out


def test_an_audit_of_a_reference_that_is_not_a_string_says_so(tmp_path, capsys):
    """reference() returning a number is a finding, not a crash of the audit."""
    path = tmp_path / "number_reference.py"
    path.write_text("def problems(split, n, seed):\n    return [{'id': str(i)} for i in range(n)]\n"
                    "def prompt(p):\n    return 'Say 4.'\n"
                    "def reward(completion, problem):\n    return float('4' in completion)\n"
                    "def reference(problem):\n    return 4\n")
    assert audit(str(path)) > 0
    assert "bad reference: problem 0: reference() returned int 4; it must return a completion" \
        in capsys.readouterr().out


def test_length_reward_needs_a_correct_component_and_says_so_before_a_model_loads(tmp_path):
    """length_reward pays short right answers: a reward with no "correct" to say which are right
    fails pre-flight, naming the components it has; digits' reward (with correct) passes."""
    path = tmp_path / "styled.py"
    path.write_text(open(os.path.join(ROOT, "tasks", "larger.py")).read().replace(
        'return {"correct": float(right), "brief"', 'return {"right": float(right), "brief"'))
    cfg, task = setup(f"--task={path}", "--length_reward=0.2")
    with pytest.raises(ConfigError, match=r"length_reward pays short right answers, and the "
                                          r"reward's components \['brief', 'right'\]"):
        check_task_output(task, load_problems(cfg, task, "train"), cfg)
    check_task_output(task, load_problems(cfg, task, "train"), setup(f"--task={path}")[0])
    cfg, task = setup("--task=digits", "--length_reward=0.2")
    check_task_output(task, load_problems(cfg, task, "train"), cfg)
