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
# the generator's difficulty: settings of this task, set by name (--countdown_numbers=4)
OPTIONS = {
    "countdown_numbers": (3, 4),  # how many numbers a problem has, drawn per problem
    "countdown_max_number": 99,  # numbers are drawn from 1..countdown_max_number
    "countdown_max_target": 100,  # targets are whole numbers in 1..countdown_max_target
}
SETTINGS = {}  # the generator's keyword arguments, from the run's options (configure)


def configure(cfg):
    # the defaults for what the run's task file leaves out (one that borrows this configure)
    options = {**OPTIONS, **cfg.task_options}
    numbers, max_number, max_target = (options[k] for k in OPTIONS)
    if not numbers or not set(numbers) <= {2, 3, 4, 5, 6}:
        raise ConfigError(f"countdown_numbers={numbers}: use counts from 2 to 6, e.g. (3, 4)")
    if min(max_number, max_target) < 1:
        raise ConfigError(f"countdown_max_number={max_number} and countdown_max_target="
                          f"{max_target} must be >= 1")
    SETTINGS.update(num_counts=numbers, max_number=max_number, max_target=max_target)


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
