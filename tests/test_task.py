"""Tasks as one file each (episodes/task.py, tasks/, data/files.py): loading, datasets, prompts,
the guarded reward.

    pytest tests/test_task.py
"""

import csv
import json
import os
import subprocess
import sys

import pytest

import grpo
from config import ConfigError, load_config
from data.files import DataError
from episodes import task as task_module
from episodes.task import load_problems, load_task, score
from infra import preflight
from run import prepare
from run.audit import check_task_output, replay
from scoring import runner
from scoring.runner import run_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "config", "tiny.py")


def setup(*overrides, path=None):
    cfg = load_config(path, list(overrides))
    return cfg, load_task(cfg)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from model import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(str(tmp_path_factory.mktemp("tiny"))))


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------- the README's example, and the built-in tasks


def test_the_example_task_file_scores_what_it_says():
    cfg, task = setup(f"--task={ROOT}/tasks/larger.py")
    train, test = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    assert len(train) == 500 and len(test) == 60

    def pairs(ps):  # a or b, b or a: one problem
        return {tuple(sorted((p["a"], p["b"]))) for p in ps}

    assert len(pairs(train)) == 500 and not pairs(train) & pairs(test)
    p = {"id": "x", "a": 37, "b": 52}
    texts = ["52", "37", "Comparing the hundreds, then the tens: it is 52"]
    rewards, comps = score(task, texts, [p] * 3, [1, 1, 12], cfg)
    # correct 1 + brief 0.1 (its weight 1); the task reports no "format" or "parsed":
    # no format credit, no penalty
    assert rewards.tolist() == pytest.approx([1.1, 0.1, 1.0])
    assert (comps["correct"].tolist() == [1.0, 0.0, 1.0]
            and comps["brief"].tolist() == pytest.approx([0.1, 0.1, 0.0]))
    cfg.component_weights = {"brief": 0.0}  # reward_weights=brief:0
    rewards = score(task, texts, [p] * 3, [1, 1, 12], cfg)[0]
    assert rewards.tolist() == pytest.approx([1.0, 0.0, 1.0])


def test_builtin_tasks_are_task_files(tokenizer):
    """Each built-in task loads like a user's file and scores its own known answers."""
    known = {
        "countdown": lambda p: f"<think>k</think><answer>{p['solution']}</answer>",
        # "<think>" is the prompt's
        "countdown_base": lambda p: f" k</think><answer>{p['solution']}</answer>",
        "math": lambda p: f"<think>k</think><answer>\\boxed{{{p['answer']}}}</answer>",
        "digits": lambda p: "1234",
        "code": lambda p: f"<think>k</think><answer>```python\n{p['solution']}\n```</answer>",
        "multiply": lambda p: f"```python\nprint(1)\n```\n\n<output>\n{p['answer']}\n</output>\nIt "
                              f"is {p['answer']}.",
    }
    # environments (episodes/turns.py): a known last turn of the model's
    episodes = {"guess": lambda p: str(p["secret"]),
                "calculator": lambda p: f"answer: {p['a'] * p['b']}"}
    # multiply_call (TOOLS): tests/test_tool_parsers.py; openenv (a server's): tests/test_openenv.py
    assert set(known) | set(episodes) | {"dataset", "gsm8k", "larger", "multiply_call", "openenv",
                                         "reasoning_gym"} == set(task_module.builtin_tasks())
    for name, answer in episodes.items():
        cfg, task = setup(f"--task={name}", "--train_size=12", "--test_size=4")
        problems = load_problems(cfg, task, "train")
        assert len(problems) == 12 and len({p["id"] for p in problems}) == 12
        assert isinstance(task_module.prompt_text(tokenizer, task, problems[0]), str)
        played = []
        for p in problems[:3]:
            env = task.environment(p)
            env.reset()
            played.append(env.step(answer(p))[1])
        texts = [answer(p) for p in problems[:3]]
        rewards, comps = score(task, texts, problems[:3], [10] * 3, cfg, None, played)
        assert comps["correct"].tolist() == [1.0] * 3, name
        assert comps["errors"].tolist() == [0.0] * 3
    for name, answer in known.items():
        cfg, task = setup(f"--task={name}", "--train_size=12", "--test_size=4")
        problems = load_problems(cfg, task, "train")
        assert len(problems) == 12 and len({p["id"] for p in problems}) == 12
        assert isinstance(task_module.prompt_text(tokenizer, task, problems[0]), str)
        rewards, comps = score(task, [answer(p) for p in problems[:3]], problems[:3], [10] * 3, cfg)
        assert comps["correct"].tolist() == [1.0] * 3, name
        assert comps["errors"].tolist() == [0.0] * 3


def test_a_1000_completion_batch_scores_each_completion():
    cfg, task = setup("--task=countdown")
    p = {"id": "c", "numbers": [3, 5, 7], "target": 22}
    texts = ["<think>a</think><answer>3*5+7</answer>", "<think>a</think><answer>(3+5)*7</answer>",
             "<think>hmm</think><answer>abs(3)</answer>", "x" * 2000] * 250
    rewards, comps = score(task, texts, [p] * 1000, [50] * 1000, cfg)
    assert comps["correct"].tolist() == [1.0, 0.0, 0.0, 0.0] * 250
    assert comps["parsed"].tolist() == [1.0, 1.0, 0.0, 0.0] * 250
    # numbers_valid: weight 0 (WEIGHTS)
    assert rewards.tolist()[:4] == pytest.approx([1.1, 0.1, -0.1, -0.2])


def test_code_problems_are_solvable_and_their_tests_are_exact():
    cfg, task = setup("--task=code", "--train_size=40")
    problems = load_problems(cfg, task, "train")
    assert len({p["id"].split(":")[1] for p in problems}) == 8  # every kind appears
    right = [f"<think>k</think><answer>```python\n{p['solution']}\n```</answer>" for p in problems]
    off_by_one = [t.replace("return ", "return 1 + ", 1) for t in right]
    cfg.reward_workers = 4
    rewards, comps = score(task, right + off_by_one, problems * 2, [10] * 80, cfg)
    assert comps["correct"].tolist()[:40] == [1.0] * 40
    # a reference shifted by one fails some test of its problem
    assert max(comps["correct"].tolist()[40:]) < 1.0


# -------------------------------------------------- datasets: JSONL, Parquet, CSV, datasets folders

MATH_ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(60)]
CODE_ROW = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"], "id": "add"}


def write_dataset(folder, kind, rows):
    """rows as a dataset of this kind; returns data_path."""
    import datasets
    import pyarrow
    import pyarrow.parquet

    os.makedirs(folder, exist_ok=True)
    if kind == "jsonl":
        path = os.path.join(folder, "mine.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif kind == "csv":
        path = os.path.join(folder, "mine.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()}
                             for r in rows)
    elif kind == "parquet":
        path = os.path.join(folder, "mine.parquet")
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    elif kind == "datasets_disk":  # save_to_disk of a DatasetDict with its own splits
        path = os.path.join(folder, "saved")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:50]),
                              "test": datasets.Dataset.from_list(rows[50:])}).save_to_disk(path)
    elif kind == "datasets_files":  # load_dataset's layout: train and test files in a folder
        path = os.path.join(folder, "hub_layout")
        os.makedirs(os.path.join(path, "data"))
        for split, part in (("train", rows[:50]), ("test", rows[50:])):
            name = os.path.join(path, "data", f"{split}-00000-of-00001.parquet")
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(part), name)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "datasets_disk", "datasets_files"])
def test_each_data_format_loads(tmp_path, kind):
    path = write_dataset(tmp_path, kind, MATH_ROWS)
    cfg, task = setup(f"--task={path}")  # shorthand for --task=dataset --data_path=PATH
    train, test = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    questions = lambda ps: [p["question"] for p in ps]  # noqa: E731
    if kind.startswith("datasets"):  # the dataset's own splits, in order
        assert (questions(train) == questions(MATH_ROWS[:50])
                and questions(test) == questions(MATH_ROWS[50:]))
    else:  # ~10% by a hash of each row's content: disjoint, and the same on every load
        assert (sorted(questions(train + test)) == sorted(questions(MATH_ROWS))
                and 0 < len(test) < 20)
        assert questions(load_problems(cfg, task, "test")) == questions(test)
    p = train[0]
    right = f"<think>k</think><answer>\\boxed{{{p['answer']}}}</answer>"
    assert score(task, [right, "no idea"], [p, p], [5, 5], cfg)[1]["correct"].tolist() == [1.0, 0.0]


def test_a_jsonl_file_mixes_math_and_code_rows(tmp_path):
    rows = ([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(30)] + [CODE_ROW]
            * 10)
    cfg, task = setup(f"--task={write_dataset(tmp_path, 'jsonl', rows)}", "--test_size=100")
    problems = load_problems(cfg, task, "train") + load_problems(cfg, task, "test")
    code = [p for p in problems if "tests" in p]
    assert code and code[0]["tests"] == CODE_ROW["tests"]
    solved = "<think>k</think><answer>```python\ndef add(a, b):\n    return a + b\n```</answer>"
    assert score(task, [solved], [code[0]], [9], cfg)[1]["correct"].tolist() == [1.0]
    want = [{"role": "user", "content": "What is 2?"}]
    assert task.prompt({"prompt": "What is 2?", "answer": "2"}) == want


def test_a_csv_code_dataset_reads_its_tests_as_lists(tmp_path):
    path = write_dataset(tmp_path, "csv", [{**CODE_ROW, "id": f"add{i}"} for i in range(30)])
    cfg, task = setup("--task=code", f"--data_path={path}")
    assert load_problems(cfg, task, "train")[0]["tests"] == CODE_ROW["tests"]


def test_columns_are_renamed_by_the_setting(tmp_path):
    rows = [{"problem": f"What is {i} + 2?", "solution": str(i + 2)} for i in range(40)]
    path = write_dataset(tmp_path, "jsonl", rows)
    cfg, task = setup("--task=math", f"--data_path={path}",
                      "--data_columns=problem:question,solution:answer")
    p = load_problems(cfg, task, "train")[0]
    assert set(p) == {"question", "answer", "id"} and p["id"].startswith("mine.jsonl:")
    # "question" gets the task's instructions, after its worked example
    want = f"{p['question']} Put your final answer within \\boxed{{}}."
    assert task.prompt(p)[-1]["content"] == want
    with pytest.raises(DataError, match="line 1: no column 'problem'"):
        cfg, task = setup("--task=math",
                          f"--data_path={write_dataset(tmp_path / 'b', 'jsonl', MATH_ROWS)}",
                          "--data_columns=problem:question")
        load_problems(cfg, task, "train")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "x", "answer": "1"', "line 2: not valid JSON"),
        ('["prompt", "answer"]', "line 2: expected a JSON object"),
        ('{"answer": "1"}', 'line 2: needs a non-empty string "prompt"'),
        ('{"prompt": "  ", "answer": "1"}', 'line 2: needs a non-empty string "prompt"'),
        ('{"prompt": "x"}', 'line 2: needs an "answer"'),
        ('{"prompt": "x", "answer": true}', 'line 2: needs an "answer"'),
        ('{"prompt": "x", "tests": []}', 'line 2: "tests" must be a non-empty list'),
    ],
)
def test_malformed_rows_name_their_line(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
    cfg, task = setup(f"--task={path}", "--test_size=5")
    with pytest.raises(DataError, match=message):
        load_problems(cfg, task, "train")
        load_problems(cfg, task, "test")


def test_missing_or_unreachable_datasets_fail_clearly(tmp_path, monkeypatch):
    cfg, task = setup("--task=gsm8k", f"--data_path={tmp_path}/nothing.parquet")
    with pytest.raises(DataError, match="not found"):
        load_problems(cfg, task, "train")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, task = setup("--task=gsm8k", "--data_path=openai/gsm8k")
    with pytest.raises(DataError, match="the hub cannot be reached"):
        load_problems(cfg, task, "train")
    with pytest.raises(ConfigError, match="defines no function problems"):
        setup("--task=gsm8k")  # no data_path, and the task has no generator


DEEP = b"[" * 50_000 + b"]" * 50_000  # json.loads: RecursionError (and under csv's cell limit)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bin.jsonl", b'{"prompt": "ok", "answer": "1"}\n\xf7\x00\x01\n',
         r"line 2: not UTF-8 text \(byte 0xf7"),
        ("latin1.csv", "prompt,answer\nok,1\ncaf\xe9,2\n".encode("latin-1"),
         r"line 3: not UTF-8 .*column 4"),
        ("extra.csv", b"prompt,answer\nok,1\nWhat is 1,2?,3\n",
         "line 3: the header names 2 columns, this row has 3"),
        ("big.csv", b'prompt,answer\nok,1\n"' + b"x" * 200_000 + b'",2\n',
         "line 3: field larger than field limit"),
        ("deep.jsonl", b'{"prompt": "ok", "answer": "1"}\n{"prompt": ' + DEEP + b"}\n",
         "line 2: JSON nested too deeply"),
        ("deep.csv", b"prompt,answer\nok," + DEEP + b"\n", "line 2: a cell's JSON is nested too"),
    ],
    ids=["binary", "latin-1", "extra field", "long cell", "deep jsonl", "deep csv"],
)
def test_unreadable_data_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    cfg, task = setup(f"--task={path}")
    with pytest.raises(DataError, match=f"{name}, {message}"):
        load_problems(cfg, task, "train")


def test_an_empty_or_truncated_datasets_folder_fails_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg, task = setup(f"--task={tmp_path / 'empty'}")
    with pytest.raises(DataError, match="empty': cannot read this folder as a dataset .*Empty"):
        load_problems(cfg, task, "train")
    path = write_dataset(tmp_path, "datasets_disk", MATH_ROWS)
    arrow = next(f for f in os.listdir(os.path.join(path, "train")) if f.endswith(".arrow"))
    os.truncate(os.path.join(path, "train", arrow), 100)  # a copy cut short
    cfg, task = setup(f"--task={path}")
    with pytest.raises(DataError, match="saved': cannot read this folder as a dataset"):
        load_problems(cfg, task, "train")


def test_gsm8k_task_and_run_file_on_a_local_parquet(tmp_path):
    rows = [{"question": f"Natalia sold {i} clips, then as many again. How many?",
             "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"} for i in range(500, 560)]
    path = write_dataset(tmp_path, "datasets_files", rows)
    cfg, task = setup(f"--data_path={path}", "--data_name=",
                      path=os.path.join(ROOT, "config", "gsm8k_3b.py"))
    preflight.preflight(load_config(os.path.join(ROOT, "config", "gsm8k_3b.py")), device_gb=80)
    train, test = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    # the dataset's own splits (train_size 7473 caps nothing here)
    assert len(train) == 50 and len(test) == 10
    p = train[0]  # 500 + 500 = 1000, written "#### 1,000"
    texts = ["<think>500 and 500</think><answer>1000</answer>",
             "<think>twice</think><answer>1,000</answer>",
             "so 500 + 500 = 1000", "<think>x</think><answer>999</answer>"]
    assert score(task, texts, [p] * 4, [9] * 4, cfg)[1]["correct"].tolist() == [1.0, 1.0, 1.0, 0.0]


# ----------------------------------------------------------- prompts: chat, raw (R1-Zero), a prefix


def test_a_raw_prompt_with_a_completion_prefix(tokenizer):
    cfg, task = setup("--task=countdown_base")
    p = {"id": "c", "numbers": [2, 5, 6], "target": 20}
    text = task_module.prompt_text(tokenizer, task, p)
    assert text.startswith("A conversation between User and Assistant.")
    # TinyZero's, no chat template
    assert text.endswith("Assistant: Let me solve this step by step.\n<think>")
    ids = task_module.tokenize_prompts(tokenizer, task, [p], 512)[0]
    assert tokenizer.decode(ids) == text
    # the reward sees "<think>" in front of what the model wrote, and the turn up to </answer>
    # (base models ramble)
    completion = " 6 - 2 = 4, 4 * 5 = 20.</think> <answer>(6 - 2) * 5</answer>\nUser: thanks"
    comps = score(task, [completion], [p], [20], cfg)[1]
    assert comps["correct"].tolist() == [1.0] and comps["format"].tolist() == [1.0]
    # the instruct task judges the completion as it stands
    cfg_i, instruct = setup("--task=countdown")
    assert score(instruct, [completion], [p], [20], cfg_i)[1]["format"].tolist() == [0.0]


def test_a_chat_prompt_with_a_completion_prefix_opens_the_assistant_turn(tokenizer, tmp_path):
    path = tmp_path / "prefilled.py"
    path.write_text('COMPLETION_PREFIX = "<think>"\n'
                    'def problems(split, n, seed):\n    return [{"id": str(i)} for i in range(n)]\n'
                    'def prompt(problem):\n    return [{"role": "user", "content": "Think."}]\n'
                    'def reward(completion, problem):\n    return '
                    'float(completion.startswith("<think>"))\n')
    cfg, task = setup(f"--task={path}")
    text = task_module.prompt_text(tokenizer, task, {"id": "0"})
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Think."}],
                                          add_generation_prompt=True, tokenize=False)
    # the assistant's turn begun, not closed
    assert text.startswith(plain) and text.endswith("<think>")
    assert score(task, ["ok</think>"], [{"id": "0"}], [3], cfg)[0].tolist() == [1.0]


# ---------------------------------------------------- a task file with faults, a reward with faults


def write_task(tmp_path, body, name="mytask.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


PROBLEMS = ('def problems(split, n, seed):\n    return [{"id": f"{split}{i}", "i": i} for i in '
            'range(n)]\n')
PROMPT = ('def prompt(problem):\n    return [{"role": "user", "content": f"Count to '
          '{problem[\'i\']}:"}]\n')


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--task=poetry"], "choose a built-in task"),
        (["--task=missing.py"], "task file missing.py not found"),
        (["--task=math", "--math_kinds=add,integrals"],
         r"math_kinds=\('add', 'integrals'\): choose from"),
        (["--task=math", "--math_kinds="], r"math_kinds=\(\): choose from"),
        (["--task=countdown", "--countdown_numbers=3,9"],
         r"countdown_numbers=\(3, 9\): use counts from 2 to 6"),
        (["--task=countdown", "--countdown_max_target=0"], "countdown_max_target=0 must be >= 1"),
        (["--task=math", "--math_max_number=0"], "math_max_number=0 must be >= 1"),
    ],
)
def test_a_task_and_its_settings_are_checked_when_it_loads(tmp_path, overrides, message):
    """config.py knows no task: an unknown task, and a built-in task's own settings (its OPTIONS),
    fail in load_task, which pre-flight runs before any model loads."""
    cfg = load_config(overrides=overrides)  # a config that loads
    with pytest.raises(ConfigError, match=message):
        load_task(cfg)
    with pytest.raises(ConfigError, match=message):
        prepare.prepare_run(["--config", TINY, f"--out_dir={tmp_path}/run", *overrides])
    assert not os.path.exists(tmp_path / "run")  # nothing built, nothing written


def test_a_faulty_task_file_fails_in_preflight_naming_the_file_and_the_function(tmp_path):
    path = write_task(tmp_path, PROBLEMS + PROMPT)
    with pytest.raises(ConfigError,
                       match=r"mytask.py defines no function reward\(completion, problem\)"):
        setup(f"--task={path}")
    for body, message in [
        (PROBLEMS + PROMPT + "def reward(completion, problem):\n    return 'yes'\n",
         r"reward\(\) wrong type"),
        (PROBLEMS + PROMPT + "def reward(completion, problem):\n    return float('nan')\n",
         "non-finite"),
        (PROBLEMS + "def prompt(problem):\n    return 42\n" + "def reward(c, p):\n    return 1.0\n",
         r"prompt\(\) returned 42 for problem train0"),
        ("def problems(split, n, seed):\n    return {}\n" + PROMPT
         + "def reward(c, p):\n    return 1.0\n", "must return a non-empty list of dicts"),
    ]:
        path = write_task(tmp_path, body)
        # grpo.main: before any model folder is built
        with pytest.raises(ConfigError, match=message):
            grpo.main(["--config", TINY, f"--out_dir={tmp_path}/run", f"--task={path}"])
        assert not os.path.exists(tmp_path / "run" / "tiny_model")


REWARD = "def reward(completion, problem):\n    return 1.0\n"


@pytest.mark.parametrize(
    "body, message",
    [
        # once failed late: the sample dump crashed; the model crashed; the run trained on zeros
        (PROBLEMS.replace('"i": i}', '"i": i, "seen": {i}}') + PROMPT + REWARD,
         r"mytask.py: problem train0 holds what JSON cannot write \(Object of type set"),
        (PROBLEMS + 'def prompt(problem):\n    return ""\n' + REWARD,
         r"mytask.py: prompt\(\) returned '' for problem train0: the model needs some text"),
        (PROBLEMS + PROMPT + "def reward(completion):\n    return 1.0\n",
         r"mytask.py: reward\(completion\) cannot be called as reward\(completion, problem\)"),
        ("def problems(split, n):\n    return []\n" + PROMPT + REWARD,
         r"problems\(split, n\) cannot be called as problems\(split, n, seed\)"),
    ],
    ids=["a set in a problem", "an empty prompt", "a reward of one argument", "problems of two"],
)
def test_a_task_file_that_failed_late_fails_before_a_model_loads(tmp_path, monkeypatch, body,
                                                                 message):
    def no_model(*args):
        raise AssertionError("a model would load")

    monkeypatch.setattr(prepare, "build_models", no_model)
    path = write_task(tmp_path, body)
    with pytest.raises(ConfigError, match=message):
        grpo.main(["--config", TINY, f"--out_dir={tmp_path}/run", f"--task={path}"])
    assert not os.path.exists(tmp_path / "run" / "tiny_model")


def test_an_int_reward_too_large_for_a_float_is_a_counted_wrong_type(monkeypatch):
    monkeypatch.setattr(runner, "_REPORTED", set())

    def reward(text, problem):
        huge = {"int": 10**400, "dict": {"big": 10**400, "score": 1.0}}
        return huge.get(text, 0.5)

    for timeout in (0, 5.0):  # in this process (OverflowError escaped), and in a child
        got = run_rewards(reward, ["int", "ok", "dict"], [{}] * 3, timeout=timeout)
        wrong = "wrong type: returned an integer too large for a float"
        assert got == [wrong, {"score": 0.5}, wrong], timeout


def test_a_huge_prompt_fails_before_it_is_tokenised(tokenizer, tmp_path):
    """A 1 MB prompt: a token covers at most 13 of the tiny tokenizer's characters, so it cannot fit
    in 64 tokens and is never tokenised (a 100 MB one took gigabytes to tokenise, then failed)."""
    huge = 'def prompt(problem):\n    return "7 " * problem.get("repeat", 500_000)\n'
    path = write_task(tmp_path, PROBLEMS + huge + REWARD)
    cfg, task = setup(f"--task={path}")
    seen = []

    class Spy:  # the tokenizer, noting the length of each text it tokenises
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return tokenizer(text, **kwargs)

    with pytest.raises(ConfigError, match="prompt train0 has 1000000 characters, more than max"):
        task_module.tokenize_prompts(Spy(), task, load_problems(cfg, task, "train")[:1], 64)
    assert seen == []
    short = {"id": "s", "repeat": 3}  # one that may fit is tokenised as before
    assert task_module.tokenize_prompts(Spy(), task, [short], 64) == [tokenizer("7 7 7 ").input_ids]
    assert seen == [len(task.prompt(short))]


def test_a_raising_hanging_dying_or_mistyped_reward_fails_only_its_completion(monkeypatch, capsys):
    monkeypatch.setattr(runner, "_REPORTED", set())

    def reward(text, problem):
        if text == "raise":
            raise KeyError("a bug in a user's reward")
        if text == "hang":
            while True:
                pass
        if text == "exit":
            os._exit(3)
        return "yes" if text == "type" else {"len": float(len(text))}

    texts = ["a", "raise", "bb", "hang", "ccc", "exit", "type", "dddd", "raise"]
    got = run_rewards(reward, texts, [{}] * 9, timeout=1.0, workers=2)
    assert got[:6] == [{"len": 1.0}, "error", {"len": 2.0}, "timeout", {"len": 3.0}, "error"]
    assert got[6].startswith("wrong type") and got[7:] == [{"len": 4.0}, "error"]
    err = capsys.readouterr().err
    # each kind printed once
    assert err.count("Traceback") == 1 and "a bug in a user's reward" in err
    assert "reward_timeout=1.0" in err and "returned the wrong type" in err
    # in-process
    assert run_rewards(reward, ["raise", "a"], [{}] * 2, timeout=0) == ["error", {"len": 1.0}]
    assert "Traceback" not in capsys.readouterr().err


def test_a_raising_and_a_hanging_reward_leave_the_run_going(tmp_path):
    """Problem 0's reward raises and problem 1's hangs, on every completion: both score 0, are
    counted in reward/errors (timeouts also in reward/timeouts), and the run trains on and saves its
    checkpoint."""
    path = write_task(tmp_path, "import time\n" + PROBLEMS + PROMPT + (
        "def reward(completion, problem):\n"
        "    if problem['i'] == 0:\n        raise ValueError('this reward has a bug')\n"
        "    if problem['i'] == 1:\n        time.sleep(60)\n"
        "    return {'correct': float(any(c.isdigit() for c in completion))}\n"))
    grpo.main(["--config", TINY, f"--out_dir={tmp_path}/run", f"--task={path}", "--engine=hf",
               "--train_size=4", "--test_size=3", "--max_steps=2", "--eval_every=0", "--eval_n=2",
               "--reward_timeout=0.5"])
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # 4 prompts x G=4
    assert [(m["reward/errors"], m["reward/timeouts"]) for m in metrics] == [(8, 4), (8, 4)]
    assert metrics[-1]["eval/pass@1_greedy"] in (0.0, 1 / 3)  # test problem 2 scores; 0 and 1 fail
    assert os.path.isdir(tmp_path / "run" / "ckpt_000002")


# ---------------------------------------------------------------- runs on the tiny model


@pytest.mark.slow
def test_three_steps_on_the_example_task_file(tmp_path):
    grpo.main(["--config", TINY, f"--out_dir={tmp_path}", f"--task={ROOT}/tasks/larger.py",
               "--engine=hf",
               "--max_steps=3", "--eval_every=0", "--test_size=8", "--sample_every=1"])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all("reward/correct" in m and "reward/brief" in m
               and m["reward/errors"] == 0 for m in metrics)
    # the task reports no format
    assert "eval/pass@4" in metrics[-1] and "eval/format" not in metrics[-1]
    # the saved rollouts re-score the same through the task
    assert replay(str(tmp_path / "samples.jsonl")) == 0


@pytest.mark.slow
def test_the_base_model_template_trains_on_the_tiny_model(tmp_path):
    grpo.main(["--config", TINY, f"--out_dir={tmp_path}", "--task=countdown_base", "--engine=hf",
               "--max_steps=2", "--eval_every=0", "--test_size=4", "--max_prompt_len=384",
               "--micro_batch_tokens=512"])
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_the_base_run_file_passes_preflight():
    path = os.path.join(ROOT, "config", "countdown_3b_base.py")
    cfg, task = setup(path=path)
    # 3.09B fp32 master weights
    assert preflight.preflight(cfg, device_gb=80)["weights"] == pytest.approx(11.5, abs=0.1)
    check_task_output(task, load_problems(cfg, task, "train")[:5], cfg)


@pytest.mark.slow
def test_the_code_task_runs_end_to_end_through_the_sandbox(tmp_path):
    """The tiny model writes no code, so the engine's first completion of each group is swapped for
    the problem's reference solution: those pass their tests in the sandbox (acc > 0), the others
    score 0, nothing errs."""
    cfg, task = setup("--task=code")
    solutions = {p["prompt"]: p["solution"]
                 for split in ("train", "test") for p in load_problems(cfg, task, split)}

    def with_one_solution(engine):
        generate = engine.generate

        def swapped(prompts, n, **kw):
            groups = generate(prompts, n, **kw)
            for g in groups:
                text = engine.tokenizer.decode(g[0].prompt_ids)
                code = next(s for q, s in solutions.items() if q in text)
                g[0].text = f"<think>k</think><answer>```python\n{code}\n```</answer>"
            return groups

        engine.generate = swapped
        return engine

    grpo.main(["--config", TINY, f"--out_dir={tmp_path}", "--task=code", "--engine=hf",
               "--max_steps=2",
               "--eval_every=0", "--test_size=2", "--eval_n=2", "--max_prompt_len=256",
               "--micro_batch_tokens=320",
               "--reward_workers=2", "--sample_every=1"], wrap_engine=with_one_solution)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(m["acc"] == pytest.approx(0.25)
               and m["reward/parsed"] == pytest.approx(0.25) for m in metrics)
    assert (all(m["reward/errors"] == 0 for m in metrics)
            and metrics[-1]["eval/pass@1_greedy"] == 1.0)


# ---------------------------------------------------------------- offline replay (W5)


def test_replay_counts_and_prints_each_planted_disagreement(tmp_path, capsys):
    """Three saved rollouts re-scored through the run's task and shaping: the untouched one agrees;
    a stored component and a stored reward planted wrong are each one disagreement, printed with its
    line."""
    from infra.checkpoint import save_config

    cfg, task = setup(f"--task={ROOT}/tasks/larger.py")
    save_config(cfg, tmp_path / "config.json")
    p = {"id": "x", "a": 37, "b": 52}
    texts = ["52", "37", "Comparing the hundreds, then the tens: it is 52"]
    rewards, comps = score(task, texts, [p] * 3, [1, 1, 12], cfg)
    records = [{"step": 0, "problem": p, "completion": t, "reward": rewards[i].item(),
                "length": [1, 1, 12][i], "components": {k: v[i].item() for k, v in comps.items()}}
                for i, t in enumerate(texts)]
    records[1]["components"]["correct"] = 1.0  # "37" is wrong: the task re-scores it 0
    records[2]["reward"] = 0.5  # re-scored: correct 1 + brief 0
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay(str(path)) == 2
    out = capsys.readouterr().out
    assert "line 2: correct stored 1.0 != re-scored 0.0" in out
    assert "line 3: reward stored 0.5 != re-scored 1.0" in out
    assert "line 1:" not in out and f"replayed 3 rollouts from {path}: 2 disagreements" in out
    assert records[0]["components"]["correct"] == 1.0 and records[0]["reward"] == pytest.approx(1.1)
    # the same from the command line: python -m episodes.task --replay FILE, 1 on a disagreement
    cli = [sys.executable, "-m", "episodes.task", "--replay", str(path)]
    proc = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "line 2: correct stored 1.0 != re-scored 0.0" in proc.stdout
    assert f"replayed 3 rollouts from {path}: 2 disagreements" in proc.stdout
    path.write_text(json.dumps(records[0]) + "\n")
    agreed = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert agreed.returncode == 0 and "1 rollouts" in agreed.stdout
    usage = subprocess.run(cli[:3], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert usage.returncode == 1 and "usage: python -m episodes.task --replay" in usage.stderr


def test_a_task_that_borrows_another_tasks_configure_declares_the_same_options():
    from config import declared_options, task_path

    def options(task):
        return declared_options(task_path(task)).items()

    assert options("countdown_base") == options("countdown")
    assert options("dataset") <= options("math")


def test_a_data_file_as_the_task_takes_the_math_tasks_answer_setting(tmp_path):
    """tasks/dataset.py scores a math row with tasks/math.py: it declares math_last_number, and
    math's configure fills in the options only math has."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n' * 4)
    cfg = load_config(overrides=[f"--task={rows}", "--math_last_number=false"])
    task = load_task(cfg)
    problem = {"prompt": "What is 2 + 3?", "answer": "5"}
    assert cfg.task_options == {"math_last_number": False}
    assert task.reward("The sum is 5.", problem)["correct"] == 0.0  # tags only
    cfg = load_config(overrides=[f"--task={rows}"])
    assert load_task(cfg).reward("The sum is 5.", problem)["correct"] == 1.0
