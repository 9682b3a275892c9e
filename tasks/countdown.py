"""Countdown (D1): reach the target with + - * / and each given number once.   --task=countdown

The problems are generated (data/countdown.py: 3-4 numbers in 1..99, every one solvable); the prompt
is a chat message for an instruct model; the reward is rewards.countdown_reward.
"""

from config import ConfigError
from data.countdown import countdown_problems
from rewards import countdown_reward

PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and parentheses, and each number must be used exactly "
    "once. Think step by step inside <think> </think> tags, then give only the equation inside "
    "<answer> </answer> tags, for example <think> ... </think><answer>(1 + 2) / 3</answer>."
)
# logged, not rewarded: a wrong equation that uses the right numbers is still wrong
WEIGHTS = {"numbers_valid": 0.0}
SETTINGS = {}  # the generator's difficulty, from the run's config (configure)


def configure(cfg):
    if not cfg.countdown_numbers or not set(cfg.countdown_numbers) <= {2, 3, 4, 5, 6}:
        raise ConfigError(f"countdown_numbers={cfg.countdown_numbers}: use counts from 2 to 6, "
                          "e.g. (3, 4)")
    SETTINGS.update(num_counts=cfg.countdown_numbers, max_number=cfg.countdown_max_number,
                    max_target=cfg.countdown_max_target)


def problems(split, n, seed):
    return countdown_problems(split, n, seed, **SETTINGS)


def prompt(problem):
    content = PROMPT.format(numbers=problem["numbers"], target=problem["target"])
    return [{"role": "user", "content": content}]


def reward(completion, problem):
    return countdown_reward(completion, problem["numbers"], problem["target"])


def reference(problem):
    """The generator's own solution (data/countdown.py keeps one for every problem)."""
    return f"<think>Combine the numbers.</think><answer>{problem['solution']}</answer>"
