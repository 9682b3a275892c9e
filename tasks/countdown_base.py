"""Countdown for a base model, R1-Zero style: TinyZero's raw template, no chat template.

    python grpo.py --config config/countdown_3b_base.py

The prompt is a plain string that ends by opening the assistant's answer ("Let me solve this step
by step.\\n<think>"); COMPLETION_PREFIX puts that "<think>" in front of the completion the reward
sees, so the format check (rewards.has_format) judges the answer as the model's whole turn.
Problems and reward are the instruct task's (tasks/countdown.py).
"""

import os

from episodes.task import import_file

countdown = import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "countdown.py"))

# TinyZero's "base" template (examples/data_preprocess/countdown.py),
# the think tag moved to COMPLETION_PREFIX
TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer.\n"
    "User: Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n"
)
COMPLETION_PREFIX = "<think>"
STOP = ["</answer>"]  # a base model rarely stops after its answer: generation ends there, tag kept
WEIGHTS = countdown.WEIGHTS
configure, problems = countdown.configure, countdown.problems
# the problems' settings, tasks/countdown.py's (OPTIONS are read from each file's own text)
OPTIONS = {"countdown_numbers": (3, 4), "countdown_max_number": 99, "countdown_max_target": 100}


def prompt(problem):
    return TEMPLATE.format(numbers=problem["numbers"], target=problem["target"])


def reward(completion, problem):
    # up to the first </answer>: STOP ends the completion with the token that completes it, and that
    # token may carry a few characters past the tag
    end = completion.find("</answer>")
    return countdown.reward(completion[: end + len("</answer>")] if end >= 0 else completion,
                            problem)


def reference(problem):
    # the completion after the prompt's "<think>"
    return f" Combine the numbers.</think><answer>{problem['solution']}</answer>"
