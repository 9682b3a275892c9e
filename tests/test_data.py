"""Task data: generators, splits and the prompt samplers (D1-D3).   pytest tests/test_data.py

Dataset files (data/files.py) are tested with the tasks that read them, in tests/test_task.py.
"""

import collections
import json

import pytest

from data.arith import KINDS, math_problems
from data.countdown import countdown_problems, random_solution
from data.sampler import CurriculumSampler, PromptSampler
from data.split import in_split
from rewards import countdown_reward, math_reward


def solved(problem):
    return countdown_reward(f"<think>known</think><answer>{problem['solution']}</answer>",
                            problem["numbers"], problem["target"])


def test_every_generated_countdown_problem_is_solvable():
    problems = countdown_problems("train", 1000, seed=0)
    assert all(solved(p) == {"format": 1.0, "parsed": 1.0, "numbers_valid": 1.0, "correct": 1.0}
               for p in problems)
    assert {len(p["numbers"]) for p in problems} == {3, 4}
    assert all(1 <= p["target"] <= 100
               and all(1 <= n <= 99 for n in p["numbers"]) for p in problems)
    assert len({p["id"] for p in problems}) == 1000


def test_countdown_difficulty_knobs():
    small = countdown_problems("train", 200, seed=1, num_counts=(3,), max_number=10, max_target=20)
    assert all(len(p["numbers"]) == 3 and max(p["numbers"]) <= 10
               and p["target"] <= 20 for p in small)
    assert all(solved(p)["correct"] == 1.0 for p in small)


def test_countdown_is_deterministic_and_seeded():
    assert countdown_problems("train", 50, seed=3) == countdown_problems("train", 50, seed=3)
    assert countdown_problems("train", 50, seed=3) != countdown_problems("train", 50, seed=4)


def test_random_solution_value_matches_its_expression():
    import ast
    import random

    from rewards import _countdown_eval

    for seed in range(50):
        made = random_solution([2, 3, 4, 5], random.Random(seed))
        if made is None:  # a division by zero was drawn
            continue
        used = []
        assert _countdown_eval(ast.parse(made[1], mode="eval").body, used) == made[0]
        assert sorted(used) == [2, 3, 4, 5]


def test_train_and_test_splits_are_disjoint_and_fixed():
    train = {p["id"] for p in countdown_problems("train", 3000, seed=0)}
    test = countdown_problems("test", 200, seed=0)
    assert not train & {p["id"] for p in test}
    assert all(in_split(p["id"], "test") and not in_split(p["id"], "train") for p in test)
    # a different generator seed finds other test problems, never a train one
    assert not train & {p["id"] for p in countdown_problems("test", 200, seed=9)}
    with pytest.raises(ValueError, match="split"):
        in_split("x", "validation")


def test_math_problems_have_exact_answers_that_verify():
    problems = math_problems("train", 300, seed=0)
    assert {p["id"].split(":")[0] for p in problems} == {"math"}
    for p in problems:
        answer = f"<think>w</think><answer>\\boxed{{{p['answer']}}}</answer>"
        assert math_reward(answer, p["answer"])["correct"] == 1.0
    linear = math_problems("test", 20, seed=0, kinds=("linear",))
    assert all(p["question"].startswith("Solve for x") for p in linear)
    with pytest.raises(ValueError, match="unknown math kinds"):
        math_problems("train", 1, kinds=("calculus",))
    assert set(KINDS) >= {"add", "linear", "fractions"}


def test_a_commuted_twin_never_crosses_the_split():
    """a + b and b + a are one problem: keyed by the question text, 44 of the default run's 60 test
    sums had their twin in train. Keyed by the sorted operands, none does (a test pair may appear in
    both orders)."""
    import re

    def pair(p):
        return tuple(sorted(int(x) for x in re.findall(r"\d+", p["id"])))

    train = math_problems("train", 500, seed=0, kinds=("add",), max_number=25)
    # the default run's splits
    test = math_problems("test", 60, seed=0, kinds=("add",), max_number=25)
    train_pairs = {pair(p) for p in train}
    assert not [p["id"] for p in test if pair(p) in train_pairs]
    assert len({p["id"] for p in test}) == 60  # enough distinct test questions remain
    # the split key: both orders of a commuting kind share one; other kinds keep the question (None)
    assert KINDS["add"](Draws(3, 5), 99)[2] == KINDS["add"](Draws(5, 3), 99)[2]
    assert KINDS["area"](Draws(3, 7), 99)[2] == KINDS["area"](Draws(7, 3), 99)[2]
    order, fractions = KINDS["order_of_ops"], KINDS["fractions"]
    assert order(Draws(5, 3, 7), 99)[2] == order(Draws(5, 7, 3), 99)[2]
    assert order(Draws(3, 5, 7), 99)[2] != order(Draws(5, 3, 7), 99)[2]
    assert fractions(Draws(1, 2, 1, 3), 99)[2] == fractions(Draws(1, 3, 1, 2), 99)[2]
    assert KINDS["sub"](Draws(10, 25), 99)[2] is None


class Draws:
    """A stand-in rng whose randint returns fixed values, to hand-check a kind."""

    def __init__(self, *values):
        self.values = list(values)

    def randint(self, lo, hi):
        return self.values.pop(0)


def test_hand_checked_math_answers():
    from fractions import Fraction

    assert KINDS["linear"](Draws(4, 3, 6), 99)[:2] == ("Solve for x: 4x + 3 = 6.", Fraction(3, 4))
    assert KINDS["fractions"](Draws(1, 2, 1, 3), 99)[1] == Fraction(5, 6)
    assert KINDS["order_of_ops"](Draws(2, 3, 4), 99)[:2] == ("What is 2 + 3 * 4?", 14)
    assert KINDS["sub"](Draws(10, 25), 99)[:2] == ("What is 25 - 10?", 15)
    assert KINDS["cookies"](Draws(3, 12, 5), 99)[1] == 31


# ---------------------------------------------------------------- samplers (D2, D3)


def test_prompt_sampler_covers_every_prompt_once_per_epoch():
    s = PromptSampler(10, seed=0)
    first, second = s.sample(6) + s.sample(4), s.sample(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # a new shuffle each epoch
    assert PromptSampler(10, seed=0).sample(10) == first


def test_prompt_sampler_resumes_exactly():
    a = PromptSampler(7, seed=3)
    a.sample(5)
    state = json.loads(json.dumps(a.state_dict()))  # it must survive a checkpoint as JSON
    b = PromptSampler(7, seed=3)
    b.load_state_dict(state)
    assert [a.sample(4) for _ in range(5)] == [b.sample(4) for _ in range(5)]


def curriculum_with_history():
    s = CurriculumSampler(30, seed=0, ramp_steps=10)
    s.update(range(10), [1.0] * 10)  # 0-9 easy
    s.update(range(10, 20), [0.5] * 10)  # 10-19 medium
    s.update(range(20, 30), [0.0] * 10)  # 20-29 hard
    return s


def test_curriculum_buckets_and_moving_average():
    s = curriculum_with_history()
    assert [s.bucket(0), s.bucket(15), s.bucket(25)] == [0, 1, 2]
    s.update([25], [1.0])  # EMA with alpha 0.5: 0.5 * 1 + 0.5 * 0 = 0.5 -> medium
    assert s.pass_rate[25] == 0.5 and s.bucket(25) == 1
    assert CurriculumSampler(5, seed=0).bucket(3) == 1  # never seen: medium


def test_curriculum_ramps_hard_share_then_samples_1_2_3():
    s = curriculum_with_history()
    first = s.sample(6, step=0)
    assert not [i for i in first if i >= 20]  # hard weight is 0 at the start of the ramp
    counts = collections.Counter()
    for _ in range(2000):  # past the ramp (10 steps): each draw picks a bucket 1:2:3
        counts.update(s.bucket(i) for i in s.sample(1, step=10))
    total = sum(counts.values())
    assert counts[0] / total == pytest.approx(1 / 6, abs=0.03)
    assert counts[1] / total == pytest.approx(2 / 6, abs=0.03)
    assert counts[2] / total == pytest.approx(3 / 6, abs=0.03)


def test_curriculum_is_deterministic_and_resumable():
    a, b = curriculum_with_history(), curriculum_with_history()
    assert [a.sample(5, step) for step in range(3)] == [b.sample(5, step) for step in range(3)]
    c = CurriculumSampler(30, seed=0, ramp_steps=10)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    steps = range(3, 8)
    assert [a.sample(5, step) for step in steps] == [c.sample(5, step) for step in steps]
    batch = a.sample(30, step=8)
    assert sorted(batch) == list(range(30))  # distinct within a call


def test_curriculum_ramp_counts_training_steps_not_refill_draws():
    """ramp_steps=10: one step that drew four times (three R7 refills) is still one step of the
    ramp: the hard share of step 1's draws is that of a hard weight 3 * 0.1 against medium's 2
    (13%), not 3 * 0.4's (38%). A refill draws other prompts than the step's first draw; a resumed
    sampler draws the same ones."""
    s = CurriculumSampler(2000, seed=0, ramp_steps=10)
    s.update(range(1000, 2000), [0.0] * 1000)  # 0-999 never seen (medium), 1000-1999 hard
    step0 = [s.sample(8, step=0) for _ in range(4)]
    assert all(i < 1000 for draw in step0 for i in draw)  # the ramp starts at 0
    assert len({i for draw in step0 for i in draw}) > 8  # each refill draws afresh
    resumed = CurriculumSampler(2000, seed=0, ramp_steps=10)
    resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))
    draw = s.sample(400, step=1)
    assert resumed.sample(400, step=1) == draw
    assert 0.08 < sum(i >= 1000 for i in draw) / 400 < 0.2


def test_an_exhausted_problem_space_fails_clearly():
    with pytest.raises(ValueError, match=r"only \d+ distinct train problems exist"):
        math_problems("train", 500, kinds=("add",), max_number=5)  # 25 sums in all
    with pytest.raises(ValueError, match="distinct test problems"):
        countdown_problems("test", 50, num_counts=(3,), max_number=2, max_target=3)
