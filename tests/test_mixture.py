"""Weighted task mixtures (D4): `task=math:0.7,countdown:0.3`.

    pytest tests/test_mixture.py

The weights by quota (data.sampler.MixtureSampler) against a brute-force check of every prefix;
each task's own prompts, STOP and reward against the task alone; a tiny run that logs each task
and resumes exactly.
"""

import json
import math
import subprocess

import pytest
from test_grpo import ROOT, command, read_jsonl, run, run_until

from config import ConfigError, load_config, task_parts
from data.sampler import CurriculumSampler, MixtureSampler, PromptSampler
from episodes.task import Mixture, by_task, generate, load_problems, load_task, score
from rollout import Completion
from run import prepare


def test_task_parts_reads_weights_and_refuses_bad_ones():
    assert task_parts("math") == {"math": 1.0}
    assert task_parts("math:0.7, countdown:0.3") == {"math": 0.7, "countdown": 0.3}
    assert task_parts("data/x.jsonl:2,larger:1") == {"data/x.jsonl": 2.0, "larger": 1.0}
    for bad in ("math:0", "math:-1,larger:1", "math:x", "math:nan", "math:inf", "math:"):
        with pytest.raises(ConfigError, match="task="):
            task_parts(bad)


def test_a_run_file_may_give_the_mixture_as_a_dict(tmp_path):
    path = tmp_path / "mix.py"
    path.write_text('task = {"digits": 0.7, "larger": 0.3}\nmodel = "tiny"\n')
    cfg = load_config(str(path))
    assert cfg.task == "digits:0.7,larger:0.3" and task_parts(cfg.task) == {"digits": 0.7,
                                                                          "larger": 0.3}


def test_a_mixture_refuses_data_path_and_per_component_advantages():
    for extra in ("--data_path=data/x.jsonl", "--adv_per_component=true"):
        with pytest.raises(ConfigError, match="mixture"):
            load_config(None, ["--task=digits:1,larger:1", extra])


def test_every_prefix_holds_each_task_within_one_prompt_of_its_weight():
    weights = [0.7, 0.2, 0.1]
    s = MixtureSampler([PromptSampler(n, seed=i) for i, n in enumerate((40, 30, 20))],
                       [40, 30, 20], weights)
    owner = [0] * 40 + [1] * 30 + [2] * 20
    seen = [0, 0, 0]
    for step in range(60):
        for i in s.sample(8, step):
            seen[owner[i]] += 1
            slots = sum(seen)
            # brute force: after every single prompt, each task has its share within one
            assert all(abs(c - slots * w) < 1 for c, w in zip(seen, weights)), (step, seen)
    assert seen == [336, 96, 48]  # 480 prompts: exactly 0.7, 0.2, 0.1 of them


def test_each_task_draws_what_its_own_sampler_would():
    """A task's prompts are its own shuffled epochs, whatever the other tasks draw."""
    s = MixtureSampler([PromptSampler(5, seed="1:a"), PromptSampler(7, seed="1:b")], [5, 7],
                       [1.0, 1.0])
    drawn = [i for step in range(10) for i in s.sample(6, step)]
    alone_a, alone_b = PromptSampler(5, seed="1:a"), PromptSampler(7, seed="1:b")
    assert [i for i in drawn if i < 5] == alone_a.sample(30)
    assert [i - 5 for i in drawn if i >= 5] == alone_b.sample(30)


def test_a_mixture_sampler_resumes_exactly_and_routes_the_curriculum():
    def make():
        return MixtureSampler([CurriculumSampler(6, seed=0), CurriculumSampler(9, seed=1)],
                              [6, 9], [0.3, 0.7])

    a = make()
    for step in range(3):
        ids = a.sample(5, step)
        a.update(ids, [0.0] * len(ids))
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as a checkpoint holds it
    assert [a.sample(5, 3 + k) for k in range(6)] == [b.sample(5, 3 + k) for k in range(6)]
    before = dict(a.samplers[1].pass_rate)
    a.update([2, 8], [0.9, 0.1])  # 2: the first task's prompt 2; 8: the second's prompt 2
    assert a.samplers[0].pass_rate[2] == pytest.approx(0.45 if 2 in before else 0.9)
    assert a.samplers[1].pass_rate[2] == pytest.approx(
        0.1 if 2 not in before else 0.5 * 0.1 + 0.5 * before[2])


def test_curriculum_samplers_of_a_mixture_draw_fewer_only_when_a_task_runs_out():
    s = MixtureSampler([CurriculumSampler(2, seed=0), PromptSampler(9, seed=1)], [2, 9], [1, 1])
    ids = s.sample(8, 0)  # four slots to a 2-prompt curriculum: it gives its 2 distinct prompts
    assert len(ids) == 6 and sorted(i for i in ids if i < 2) == [0, 1]


def mixture_cfg(*extra):
    return load_config(None, ["--model=tiny", "--task=digits:0.7,larger:0.3", "--train_size=12",
                              "--test_size=5", *extra])


def test_load_keeps_each_tasks_problems_prompts_and_settings():
    cfg = mixture_cfg()
    task = load_task(cfg)
    assert isinstance(task, Mixture) and [p.name for p in task.parts] == ["digits", "larger"]
    problems = load_problems(cfg, task, "train")
    alone = [load_problems(part.cfg, part.task, "train") for part in task.parts]
    assert problems == alone[0] + alone[1]  # the problems as each task makes them, ids and all
    assert [(own.where, len(at)) for own, at in by_task(task, problems)] == [
        (task.parts[0].task.where, 12), (task.parts[1].task.where, 12)]
    assert task.prompt(problems[0]) == task.parts[0].task.prompt(problems[0])
    assert task.prompt(problems[12]) == task.parts[1].task.prompt(problems[12])
    with pytest.raises(KeyError, match="no task's"):  # a copy is no problem of the mixture's
        task.part_of(dict(problems[0]))


def test_a_task_that_fails_to_load_names_itself(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def prompt(problem):\n    return 'x'\n")
    with pytest.raises(ConfigError, match=r"its task .*broken.py: .*defines no function reward"):
        load_task(load_config(None, ["--model=tiny", f"--task=digits:1,{broken}:1"]))
    with pytest.raises(ConfigError, match="two tasks named 'digits'"):
        load_task(load_config(None, ["--model=tiny", "--task=digits:1,tasks/digits.py:1"]))


class StopRecorder:
    """An engine that records each call's prompts, seeds and stop strings; completions 'n'."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, *, seeds, stop=None, task=None, problems=None, **sampling):
        self.calls.append((list(map(tuple, prompts)), list(seeds), stop, task))
        return [[Completion(list(p), [5], f"{seeds[i * n + j]}", [-1.0], False)
                 for j in range(n)] for i, p in enumerate(prompts)]


def test_generate_calls_each_task_with_its_own_stop_strings_and_every_rows_seed(tmp_path):
    stopper = tmp_path / "stopper.py"
    stopper.write_text("STOP = ['</answer>']\n"
                       "def problems(split, n, seed):\n    return [{'id': f'{split}{i}'} for i in "
                       "range(n)]\n"
                       "def prompt(problem):\n    return 'Say:'\n"
                       "def reward(completion, problem):\n    return 1.0\n")
    cfg = load_config(None, ["--model=tiny", f"--task=digits:1,{stopper}:1", "--train_size=3"])
    task = load_task(cfg)
    problems = load_problems(cfg, task, "train")
    pick = [4, 0, 3, 1]  # stopper, digits, stopper, digits
    engine, G = StopRecorder(), 2
    seeds = [100 + r for r in range(len(pick) * G)]
    groups = generate(engine, task, [[i] for i in pick], [problems[i] for i in pick], G, seeds,
                      temperature=1.0)
    assert [(c[0], c[2]) for c in engine.calls] == [([(0,), (1,)], None),
                                                    ([(4,), (3,)], ["</answer>"])]
    # each row came back in its place, sampled with its own seed
    assert [[c.text for c in g] for g in groups] == [[str(s) for s in seeds[i * G:(i + 1) * G]]
                                                     for i in range(len(pick))]


def test_score_of_a_mixture_is_each_tasks_own_score():
    cfg = mixture_cfg()
    task = load_task(cfg)
    problems = load_problems(cfg, task, "train")
    rows = [problems[i] for i in (0, 13, 1, 12, 14)]
    texts = ["123", "<answer>7</answer>", "no digits", "\\boxed{3}", "4"]
    lengths = [3, 5, 2, 4, 1]
    rewards, comps = score(task, texts, rows, lengths, cfg)
    for r, (text, problem, length) in enumerate(zip(texts, rows, lengths)):
        own = task.part_of(problem).task
        alone_r, alone = score(own, [text], [problem], [length], cfg)
        assert rewards[r].item() == pytest.approx(alone_r.item())
        for k in comps:  # a component the row's task has not is 0 for it
            want = alone[k].item() if k in alone else 0.0
            assert comps[k][r].item() == pytest.approx(want), k


def test_the_sampler_of_a_mixture_run_is_built_by_weight():
    cfg = mixture_cfg()
    task = load_task(cfg)
    sampler = prepare.make_sampler(cfg, task, load_problems(cfg, task, "train"))
    assert isinstance(sampler, MixtureSampler) and sampler.weights == [0.7, 0.3]
    assert sampler.starts == [0, 12]


def test_a_tiny_mixture_run_logs_each_task_and_resumes_exactly(tmp_path):
    common = ["--task=digits:0.7,larger:0.3", "--max_steps=4", "--save_every=2",
              "--eval_every=2", "--sample_every=1", "--engine=hf"]
    out = run(tmp_path / "straight", *common)
    assert "final eval digits:" in out and "final eval larger:" in out
    metrics = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    # 4 prompts a step at 0.7 / 0.3: 3 + 1, 3 + 1, 2 + 2, 3 + 1 (11 + 5 of 16 = 0.69, 0.31)
    assert [(m["task/digits/prompts"], m["task/larger/prompts"]) for m in metrics] == [
        (3, 1), (3, 1), (2, 2), (3, 1)]
    last = metrics[-1]
    for key in ("pass@1_greedy", "response_length", "avg@4", "pass@4"):
        a, b = last[f"eval/digits/{key}"], last[f"eval/larger/{key}"]
        assert last[f"eval/{key}"] == pytest.approx((a * 5 + b * 5) / 10)  # 5 test problems each
    assert "eval/maj@4" not in last and "eval/larger/maj@4" in last  # digits has no answer()
    assert all(math.isfinite(m["task/digits/reward"]) for m in metrics)
    # killed after the step-2 checkpoint and resumed: the same prompts and figures
    run_until(tmp_path / "resumed", "ckpt_000002", *common)
    run(tmp_path / "resumed", *common, "--resume=true")
    from dev.compare_runs import compare

    noise = {"sampler_logprob_diff_mean", "sampler_logprob_diff_max"}
    assert compare(tmp_path / "straight", tmp_path / "resumed", rel=1e-5, ignore=noise) == {
        "metrics.jsonl": [], "samples.jsonl": []}


def test_a_mixture_with_an_unknown_task_fails_before_any_model_loads(tmp_path):
    proc = subprocess.run(command(tmp_path / "out", "--task=digits:0.5,nosuchtask:0.5"),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "its task nosuchtask" in proc.stderr
    assert "GRPO:" not in proc.stdout
