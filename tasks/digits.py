"""The smoke-test task (config/tiny.py): any prompt, scored by the share of digits it writes.

    python grpo.py --task=digits

A randomly initialised 2-layer model can climb this reward within 20 steps; nothing else is
learnable for it, so this is the task the tests train on.
"""

import itertools

from data.split import in_split
from rewards import digits_reward


def problems(split, n, seed):
    keys = (f"digits:{i}" for i in itertools.count() if in_split(f"digits:{i}", split))
    return [{"id": key} for key in itertools.islice(keys, n)]


def prompt(problem):
    return [{"role": "user", "content": f"Write only digits, like {problem['id'].split(':')[1]}:"}]


def reward(completion, problem):
    return digits_reward(completion)


def reference(problem):
    return problem["id"].split(":")[1]  # the prompt's example: digits only
