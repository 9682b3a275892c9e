"""Math word problems with exact answers (D1): the default run's task.   --task=math

Generated locally (data/arith.py: addition by default, math_kinds for more); the answer is judged by
rewards.math_reward: the last \\boxed{} or <answer>, or with math_last_number the text's last
number; with tools on, looked for only in what the model wrote after the last tool output. Plain
numbers are compared exactly, anything else by math-verify under the project's guards
(rewards.math_equal). A dataset row works too (tasks/dataset.py): "question" gets this prompt's
instructions, "prompt" is used as it is, and a GSM8K answer ("... #### 72") is judged by what
follows ####.
"""

from config import ConfigError
from data.arith import KINDS, math_problems
from rewards import math_answer, math_reward, warm_math_verify

# One worked example as a first chat turn: after it SmolLM2-135M-Instruct boxes every greedy answer
# and ~80% of those sampled at temperature 1.0 (README), ~1% without it, whatever the instruction
# says. Its operands lie outside the default ones (1..math_max_number = 25), so it answers no
# problem of the default run.
INSTRUCTION = "Put your final answer within \\boxed{}."
EXAMPLE = [{"role": "user", "content": "What is 31 + 42? " + INSTRUCTION},
           {"role": "assistant", "content": "31 + 42 = 73. The answer is \\boxed{73}."}]
# settings of this task, set by name (--math_kinds=add,sub)
OPTIONS = {
    "math_kinds": ("add",),  # generated kinds (data/arith.py): add sub order_of_ops linear ...
    "math_max_number": 25,  # largest operand of the generated problems
    "math_last_number": True,  # W1: untagged answers: judge the last number; False = tags only
}
SETTINGS = {}


def configure(cfg):
    # the defaults for what the run's task file leaves out (tasks/dataset.py: all but one)
    options = {**OPTIONS, **cfg.task_options}
    kinds, max_number, last_number = (options[k] for k in OPTIONS)
    if not kinds or set(kinds) - set(KINDS):
        raise ConfigError(f"math_kinds={kinds}: choose from {tuple(KINDS)}")
    if max_number < 1:
        raise ConfigError(f"math_max_number={max_number} must be >= 1")
    SETTINGS.update(kinds=kinds, max_number=max_number, last_number=last_number, tools=cfg.tools)
    try:
        warm_math_verify()  # here, once: the reward workers forked for every batch inherit it
    except ImportError as e:
        raise ConfigError(f"task={cfg.task}: the math verifier needs math-verify ({e}); pip "
                          "install 'math-verify[antlr4_13_2]==0.9.0' (requirements.txt)") from None


def problems(split, n, seed):
    return math_problems(split, n, seed, SETTINGS["kinds"], SETTINGS["max_number"])


def prompt(problem):
    if "prompt" in problem:  # a dataset's own prompt, as written
        return [{"role": "user", "content": problem["prompt"]}]
    return EXAMPLE + [{"role": "user", "content": f"{problem['question']} {INSTRUCTION}"}]


def reward(completion, problem):
    # a GSM8K answer is judged by what follows ####; with tools on, only the model's own text after
    # the last tool output can answer. The question copied is no answer, though its last number may
    # be the answer ("What is 1 * 3?"), and an expression copied from it earns nothing.
    question = problem.get("question", problem.get("prompt", ""))
    if question:
        completion = completion.replace(question, " ")
    return math_reward(completion, problem["answer"], SETTINGS.get("last_number", True),
                       SETTINGS.get("tools", False), question)


def reference(problem):
    answer = str(problem["answer"]).split("####")[-1].strip()
    return f"<think>Work it out.</think><answer>\\boxed{{{answer}}}</answer>"


def answer(completion, problem):
    """The final answer the reward judges, for maj@n: a number as its value ("0.5" = "1/2")."""
    return math_answer(completion, SETTINGS.get("last_number", True), SETTINGS.get("tools", False))


def check(problem):
    """A dataset row: a non-empty "prompt" or "question" string and an "answer"
    (a string or a number)."""
    text = problem.get("prompt", problem.get("question"))
    if not isinstance(text, str) or not text.strip():
        raise ValueError('needs a non-empty string "prompt" (or "question")')
    answer = problem.get("answer")
    final = str(answer).split("####")[-1].strip()
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not final:
        raise ValueError('needs an "answer" (a string or number)')
