"""Your own prompts, no code: each row of a data file is a math problem or a code problem.

    python grpo.py --task=mine.jsonl

    {"prompt": "How many ...?", "answer": "42"}                         # math (tasks/math.py)
    {"question": "...", "answer": "Natalia sold ... #### 72"}           # GSM8K: answer after ####
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}  # code (tasks/code.py)

The file is .jsonl, .parquet or .csv, or a datasets folder (data/files.py); --task=FILE is shorthand
for --task=dataset --data_path=FILE. A row with "tests" (or HumanEval's "entry_point") is scored as
code, any other as math.
"""

import os

from episodes.task import import_file

HERE = os.path.dirname(os.path.abspath(__file__))
math_task, code_task = (import_file(os.path.join(HERE, "math.py")),
                        import_file(os.path.join(HERE, "code.py")))
configure = math_task.configure
# a math row's setting, tasks/math.py's (its others make problems; OPTIONS are read from each
# file's own text)
OPTIONS = {"math_last_number": True}  # W1: untagged answers: judge the last number; False = tags


def _task(problem):
    return code_task if "tests" in problem or "entry_point" in problem else math_task


def RUNS_CODE(problem):  # a code row runs the model's code, in the sandbox (audit.check_sandbox)
    return _task(problem) is code_task


def prompt(problem):
    return _task(problem).prompt(problem)


def reward(completion, problem):
    return _task(problem).reward(completion, problem)


def reference(problem):
    return _task(problem).reference(problem)


def answer(completion, problem):  # maj@n: a math row's final answer; a code row casts no vote
    return math_task.answer(completion, problem) if _task(problem) is math_task else None


def check(problem):
    _task(problem).check(problem)
