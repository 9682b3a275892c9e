"""From a config to problems: the task's generator or loader for a split, and the chat form of a prompt."""

import itertools

from data.arith import math_problems
from data.countdown import countdown_problems
from data.jsonl import load_jsonl
from data.split import in_split


def load_problems(cfg, split):
    """The problems of `split` ("train" or "test") for cfg.task, fixed by cfg.data_seed (D1)."""
    n = cfg.train_size if split == "train" else cfg.test_size
    if cfg.task == "countdown":
        return countdown_problems(split, n, cfg.data_seed, cfg.countdown_numbers, cfg.countdown_max_number,
                                  cfg.countdown_max_target)
    if cfg.task == "math":
        return math_problems(split, n, cfg.data_seed, cfg.math_kinds, cfg.math_max_number)
    if cfg.task == "digits":
        return digits_problems(split, n)
    return load_jsonl(cfg.task, split)[:n]


def digits_problems(split, n):
    """The smoke-test task (rewards.digits_reward): any prompt, and digits score."""
    keys = (f"digits:{i}" for i in itertools.count() if in_split(f"digits:{i}", split))
    return [{"id": key, "task": "digits", "prompt": f"Write only digits, like {key.split(':')[1]}:"}
            for key in itertools.islice(keys, n)]


def chat_messages(problem):
    """The prompt in chat form, for an instruct model's chat template."""
    return [{"role": "user", "content": problem["prompt"]}]
