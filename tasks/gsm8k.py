"""GSM8K-style grade-school math from a dataset: "question", and "answer" ending in "#### 42".   config/gsm8k.py

    python grpo.py --task=gsm8k --data_path=openai/gsm8k --data_name=main   # from the hub, when online
    python grpo.py --task=gsm8k --data_path=data/gsm8k                      # a folder of train/test parquet files

The problems are the dataset's rows (no problems() here: data_path supplies them); the reward compares
the completion's final answer with the number after ####, exactly (rewards.math_reward).
"""

from rewards import math_answer, math_reward

PROMPT = (
    "{question}\nThink step by step inside <think> </think> tags, then give only the final number inside "
    "<answer> </answer> tags, for example <think> ... </think><answer>18</answer>."
)


def prompt(problem):
    return [{"role": "user", "content": PROMPT.format(question=problem["question"])}]


def reward(completion, problem):
    final = problem["answer"].split("####")[-1].strip().replace(",", "")  # "#### 1,234" -> "1234"
    return math_reward(completion, final, last_number=True)


def answer(completion, problem):
    """The final number the reward judges, for maj@n."""
    return math_answer(completion, last_number=True)


def check(problem):
    if not isinstance(problem.get("question"), str) or "####" not in str(problem.get("answer", "")):
        raise ValueError('needs a "question" string and an "answer" with the final number after ####')
