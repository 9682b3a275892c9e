"""reasoning-gym's procedural tasks and scorers.   --task=reasoning_gym --rg_dataset=countdown

reasoning-gym (pip install reasoning-gym==0.1.25, in the README's install command) generates ~100
kinds of problems (countdown, leg_counting, basic_arithmetic, ...; reasoning_gym.factory.DATASETS).
A problem is an entry of reasoning_gym.create_dataset(rg_dataset, seed=..., size=...): the train and
the test entries come from two fixed streams, seeded from data_seed, and a question belongs to one
split only (its hash decides, data/split.py), so the splits never share a problem. The prompt is the
question with an instruction to answer inside <answer> </answer>; "correct" is the dataset's own
score_answer on the content of the last answer tag (rewards.extract_answer): 1.0 for a right answer,
and what the dataset's authors chose otherwise (countdown: 0.05 for a wrong equation, 0.01 for none;
many give partial credit). pass@k counts 1.0 only.

A problem keeps the entry as plain JSON (question, answer, metadata) and where it came from
(dataset, seed, size, index), so samples.jsonl holds it whole; the scorer is made again from
those, and the tuples JSON turned into lists become tuples again (their paths kept in "tuples"), so
score_answer sees exactly the entry the dataset made.
"""

import copy
import difflib
import functools
import hashlib
import json
import operator

from config import ConfigError
from data.split import in_split
from rewards import extract_answer, has_format

PROMPT = (
    "{question}\nThink step by step inside <think> </think> tags, then give only the final answer "
    "inside <answer> </answer> tags."
)
# Several scorers eval() the answer (string_insertion, spiral_matrix, binary_matrix, n_queens) or
# hand it to sympy's parse_expr, which evaluates Python (countdown, puzzle24, polynomial and
# integration tasks): the reward runs in the sandbox, under its text guard (scoring/execute.py
# Scorer)
EXECUTES_TEXT = True
DRAWS = 20  # entries drawn per problem asked for, at most: the test split keeps 1 question in 10
# a longer answer is no answer: the longest of the datasets' own is ~4,000 characters
# (tower_of_hanoi), and some scorers take seconds on a megabyte (countdown parses it)
MAX_ANSWER_CHARS = 10_000
OPTIONS = {"rg_dataset": ""}  # this task's setting: its reasoning-gym dataset, e.g. countdown
SETTINGS = {}
_DATASETS = {}  # (name, seed, size) -> its dataset: made once a process (forked workers inherit it)


def configure(cfg):
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError("task=reasoning_gym needs the reasoning-gym package: "
                          "pip install reasoning-gym==0.1.25") from None
    if cfg.data_path:
        raise ConfigError("task=reasoning_gym makes its own problems; unset "
                          f"data_path={cfg.data_path!r}")
    name = {**OPTIONS, **cfg.task_options}["rg_dataset"]  # a file using configure may not set it
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ConfigError(f"rg_dataset={name!r}: name one of reasoning-gym's datasets, "
                          f"e.g. --rg_dataset=countdown{hint}. All: {', '.join(sorted(DATASETS))}")
    SETTINGS["name"] = name


def dataset(name, seed, size):
    """reasoning-gym's dataset object: its entries and its score_answer."""
    if (name, seed, size) not in _DATASETS:
        import reasoning_gym

        try:
            made = reasoning_gym.create_dataset(name, seed=seed, size=size)
        except Exception as e:  # e.g. composite, which needs its own settings
            raise ConfigError(f"rg_dataset={name!r}: reasoning-gym cannot make it with its default "
                              f"settings ({type(e).__name__}: {e}); choose another") from None
        _DATASETS[name, seed, size] = made
    return _DATASETS[name, seed, size]


def problems(split, n, seed):
    name = SETTINGS["name"]
    stream = int(hashlib.sha256(f"reasoning_gym:{seed}:{split}".encode()).hexdigest()[:8], 16)
    size = DRAWS * n + 100  # some datasets make all their entries up front: no more than needed
    data, out, seen = dataset(name, stream, size), [], set()
    for index in range(size):
        entry = data[index]
        question = entry["question"]
        if question in seen or not in_split(f"reasoning_gym:{name}:{question}", split):
            continue
        seen.add(question)
        out.append(as_problem(entry, f"{name}:{split}:{index}", name, stream, size, index))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} distinct {split} problems in {size} entries of "
                     f"reasoning-gym's {name}; lower train_size/test_size")


def as_problem(entry, key, name, seed, size, index):
    """The entry as plain JSON, with where it came from; checked to come back as the same entry."""
    kept = {k: entry[k] for k in ("question", "answer", "metadata")}
    where = {"dataset": name, "seed": seed, "size": size, "index": index,
             "tuples": tuple_paths(kept)}
    problem = {"id": key, **json.loads(json.dumps(kept)), "rg": where}
    if original_entry(problem) != kept:  # e.g. a dict with int keys: JSON makes them strings
        raise ConfigError(f"rg_dataset={name!r}: its entries do not come back from JSON as they "
                          "were (samples.jsonl keeps problems as JSON); choose another dataset")
    return problem


def tuple_paths(value, path=()):
    """The paths (keys, indices) of the tuples in value, outer ones first: JSON makes them lists."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in tuple_paths(v, (*path, k))]
    if isinstance(value, (list, tuple)):
        inner = [p for i, v in enumerate(value) for p in tuple_paths(v, (*path, i))]
        return [list(path), *inner] if isinstance(value, tuple) else inner
    return []


def original_entry(problem):
    """The entry as the dataset made it: a copy of the problem's, its tuples tuples again."""
    entry = copy.deepcopy({k: problem[k] for k in ("question", "answer", "metadata")})
    # inner ones first, while their holders are lists still
    for *up, last in reversed(problem["rg"]["tuples"]):
        holder = functools.reduce(operator.getitem, up, entry)
        holder[last] = tuple(holder[last])
    return entry


def prompt(problem):
    return [{"role": "user", "content": PROMPT.format(question=problem["question"])}]


def reward(completion, problem):
    """correct: the dataset's own score_answer of the last <answer> tag's content (None: no tag,
    or one past MAX_ANSWER_CHARS)."""
    answer = extract_answer(completion)
    if answer is not None and len(answer) > max(MAX_ANSWER_CHARS, 4 * len(str(problem["answer"]))):
        answer = None
    scorer = dataset(problem["rg"]["dataset"], problem["rg"]["seed"], problem["rg"]["size"])
    score = scorer.score_answer(answer, original_entry(problem))
    return {"format": float(has_format(completion)), "parsed": float(bool(answer)),
            "correct": float(score)}


def reference(problem):
    """The dataset's answer in the tags; None where it keeps none (its scorer checks a solution)."""
    if problem["answer"] is None:
        return None
    return f"<think>The dataset's answer.</think><answer>{problem['answer']}</answer>"
