"""Evaluation's pieces beside grpo.evaluate (M2): the estimators, the eval sets, eval_only's table.

    avg@n    the mean "correct" over n samples a problem
    pass@k   the unbiased estimator of Chen et al. 2021, for the k of pass_ks(n)
    maj@n    is the most common final answer (a task's answer()) a correct one
"""

import collections
import copy
import math
import os
import warnings

import torch

from config import ConfigError
from task import check_sandbox, check_task_output, load_problems, load_task, score


def pass_at_k(n, c, k):
    """The unbiased pass@k of Chen et al. 2021 (the Codex paper): the chance that k samples drawn
    without replacement from n, of which c are correct, hold a correct one.

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod over i = n - c + 1 .. n of (1 - k / i)

    The product is the paper's numerically stable form: it never forms the binomials, which outgrow
    a float past n ~ 1000. The plug-in 1 - (1 - c / n)^k often written instead is biased.
    Example: n = 5, c = 2 -> pass@1 = 0.4, pass@2 = 0.7, pass@5 = 1.0; c = 0 -> 0.0 for every k.
    """
    if n - c < k:  # every k of the n hold a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n):
    """The k of the pass@k logged from n samples: every k <= n up to n = 8; above, the powers of 2
    below n and n itself (n = 100: 1, 2, 4, ..., 64, 100)."""
    if n <= 8:
        return list(range(1, n + 1))
    return [2**i for i in range(n.bit_length()) if 2**i < n] + [n]


def majority_correct(answers, correct):
    """maj@n of one problem: is the most common answer among its n samples a correct one?

    answers: each sample's final answer (task.answer), None where it gave none (no vote); correct:
    each sample's 1/0. An answer is as correct as the first sample that gave it. A tie scores the
    share of the tied answers that are correct: the expected maj@n of breaking it at random. No
    vote at all scores 0.
    Example: ["7", "7", "3", None], [1, 1, 0, 0] -> 1.0;  ["7", "3", "3", "7"], [1, 0, 0, 1] -> 0.5.
    """
    votes = collections.Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    first = {}
    for a, ok in zip(answers, correct):
        if a is not None:
            first.setdefault(a, float(ok))
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    return sum(first[a] for a in tied) / len(tied)


def task_answers(task, texts, problems):
    """task.answer(completion, problem) of each completion, as a string; None where it gives none or
    raises (that completion casts no maj@n vote)."""
    out = []
    for text, problem in zip(texts, problems):
        try:
            value = task.answer(task.completion_prefix + text, problem)  # what the reward sees
        except Exception as e:  # a parser's bug costs votes, not the run
            warnings.warn(f"{task.where}: answer() raised {type(e).__name__}; that completion "
                          "casts no maj@n vote")
            value = None
        out.append(None if value is None else str(value))
    return out


def sampled_metrics(test, sampled, cfg):
    """avg@n, pass@k (for each k of pass_ks) and, where the task defines answer(), maj@n, from n
    samples per problem.

    avg@n is the mean "correct", a share counted as it is (the code task's share of tests passed);
    pass@k and maj@n count a sample correct where "correct" >= 1. mean_correct_sampled is avg@n's
    older name, kept for the plots and tables that read it.
    """
    n = cfg.eval_n
    flat = [c for g in sampled for c in g]
    texts = [c.text for c in flat]
    problems = [p for p in test.problems for _ in range(n)]
    _, comps = score(test.task, texts, problems, [len(c.completion_ids) for c in flat], cfg,
                     [c.completion_ids for c in flat], [c.env_rewards for c in flat])
    correct = comps.get("correct", torch.zeros(len(flat))).view(-1, n)  # (problems, n)
    right = (correct >= 1).int().tolist()
    out = {f"avg@{n}": correct.mean().item(), "mean_correct_sampled": correct.mean().item()}
    for k in pass_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(row), k) for row in right) / len(right)
    if test.task.answer is not None:
        answers = task_answers(test.task, texts, problems)
        votes = [majority_correct(answers[i * n : (i + 1) * n], row) for i, row in enumerate(right)]
        out[f"maj@{n}"] = sum(votes) / len(votes)
    return out


def eval_table(eval_sets, metrics, task_name):
    """eval_only's summary: a row per eval set, a column per metric ("-" where a set has none)."""
    rows = []
    for split in eval_sets:
        prefix = f"eval/{split.name}/" if split.name else "eval/"
        # a set's own metrics; under the plain prefix, not another set's eval/<name>/...
        own = {k[len(prefix) :]: v for k, v in metrics.items()
               if k.startswith(prefix) and "/" not in k[len(prefix) :]}
        rows.append([split.name or f"{task_name} (test split)", str(len(split.problems)), own])
    # in the order of the set with the most metrics; mean_correct_sampled is avg@n again, and
    # eval/updates (the training loop's) no set's
    fullest = sorted(rows, key=lambda row: -len(row[2]))
    columns = [k for k in dict.fromkeys(k for *_, own in fullest for k in own)
               if k not in ("mean_correct_sampled", "updates")]
    table = [["eval set", "problems", *columns]]
    for name, count, own in rows:
        table.append([name, count, *(table_cell(own, k) for k in columns)])
    widths = [max(map(len, column)) for column in zip(*table)]
    lines = [[row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
             for row in table]
    return "\n".join("  ".join(line) for line in lines)


def table_cell(metrics, key):
    """A metric as eval_table shows it: a length to 0.1 token, a share to 0.001; "-" if missing."""
    if key not in metrics:
        return "-"
    return f"{metrics[key]:.1f}" if key == "response_length" else f"{metrics[key]:.3f}"


def load_eval_tasks(cfg):
    """eval_tasks (M2): [(name, task, problems)] of each set, loaded and checked as the training
    task is (O6). Its problems: its test split (test_size of them), or a data file's every test row
    (a file without splits: every row). Its name: its file's or task's, less folder and suffix."""
    sets = []
    for spec in filter(None, (s.strip() for s in cfg.eval_tasks.split(","))):
        name = os.path.splitext(os.path.basename(spec.rstrip("/")))[0]
        if name in [s[0] for s in sets]:
            raise ConfigError(f"eval_tasks={cfg.eval_tasks!r}: two sets named {name!r} (a set is "
                              "named by its file or task); rename one of the files")
        own = copy.copy(cfg)  # the run's settings, but the set's own task and data
        own.task, own.data_path, own.data_name, own.data_column_map = spec, "", "", {}
        try:
            task = load_task(own)
            problems = load_problems(own, task, "eval")
        except ValueError as e:  # a ConfigError, or a malformed row (DataError)
            if "problems(split, n, seed)" in str(e):  # a task that reads a dataset, as gsm8k
                raise ConfigError(f"eval_tasks: {spec} has no problems() of its own (it reads "
                                  "data_path, which is the training task's); name the data file "
                                  "itself, e.g. eval_tasks=data/gsm8k_test.jsonl (tasks/dataset.py "
                                  "scores its math and code rows)") from None
            raise ConfigError(f"eval_tasks: {spec}: {e}") from None
        check_sandbox(own, task, problems)  # an eval set's code runs sandboxed too
        check_task_output(task, problems, own)
        sets.append((name, task, problems))
    return sets
