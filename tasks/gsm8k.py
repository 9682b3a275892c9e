"""GSM8K-style grade-school math from a dataset: "question", and "answer" ending in "#### 42".

    python grpo.py --task=gsm8k --data_path=openai/gsm8k --data_name=main  # the hub's (online)
    python grpo.py --task=gsm8k --data_path=data/gsm8k    # a folder of train/test parquet files
    python grpo.py --config config/gsm8k_3b.py

The problems are the dataset's rows (no problems() here: data_path supplies them); the reward judges
the completion's final answer (its \\boxed{} or <answer>, else its last number) against what follows
####, as tasks/math.py does (rewards.math_reward: "1,000", "\\$18", "18 dollars" are 1000 and 18);
with tools on, only what the model wrote after the last tool output can answer.
"""

from config import ConfigError
from rewards import math_answer, math_reward, warm_math_verify

PROMPT = (
    "{question}\nThink step by step inside <think> </think> tags, then give only the final number "
    "inside <answer> </answer> tags, for example <think> ... </think><answer>18</answer>."
)


SETTINGS = {}


def configure(cfg):
    SETTINGS.update(tools=cfg.tools)
    try:
        warm_math_verify()  # here, once: the reward workers forked for every batch inherit it
    except ImportError as e:
        raise ConfigError(f"task={cfg.task}: the math verifier needs math-verify ({e}); pip "
                          "install 'math-verify[antlr4_13_2]==0.9.0' (requirements.txt)") from None


def prompt(problem):
    return [{"role": "user", "content": PROMPT.format(question=problem["question"])}]


def reward(completion, problem):
    # math_reward reads the answer after ####; with tools on, only the model's own text after the
    # last tool output can answer (rewards.after_tool_outputs). The question copied is no answer,
    # though its last number may be the answer.
    question = problem["question"]
    if question:
        completion = completion.replace(question, " ")
    return math_reward(completion, problem["answer"], last_number=True,
                       tools=SETTINGS.get("tools", False), question=question)


def reference(problem):
    final = problem["answer"].split("####")[-1].strip()
    return f"<think>Work it out.</think><answer>{final}</answer>"


def answer(completion, problem):
    """The final number the reward judges, for maj@n."""
    return math_answer(completion, last_number=True)


def check(problem):
    if not isinstance(problem.get("question"), str) or "####" not in str(problem.get("answer", "")):
        raise ValueError('needs a "question" string and an "answer" with the final number after '
                         '####')
