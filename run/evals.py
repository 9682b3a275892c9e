"""Evaluation (M2): evaluate an eval set, evaluate_in_run (grpo.eval_is_due says when), eval_only;
the estimators, the eval sets, eval_only's table.

    avg@n    the mean "correct" over n samples a problem
    pass@k   the unbiased estimator of Chen et al. 2021, for the k of pass_ks(n)
    maj@n    is the most common final answer (a task's answer()) a correct one
"""

import collections
import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings

import torch

from config import ConfigError
from episodes.task import Mixture, by_task, load_problems, load_task, multi_turn, score
from infra import log, parallel
from model import push_weights_iter
from rollout import row_seeds
from run.audit import check_sandbox, check_task_output


def evaluate(engine, test, cfg, seed, sampled=True):
    """M2 on one eval set: pass@1 with greedy decoding; avg@n, pass@k and maj@n from n = eval_n
    samples per problem at the training temperature (sampled_metrics); format.

    reward: the greedy answers' mean shaped reward. parsed: the share of greedy answers given in a
    tag or a box (what unparsed_penalty rewards). The accuracies need the task to report "correct",
    format and parsed "format" and "parsed". Keys: eval/... for the training task's test split,
    eval/<name>/... for a set of eval_tasks. Returns (metrics, greedy completion texts). Under
    torchrun every rank evaluates the whole set alike (FSDP keeps the ranks in step); rank 0 logs
    it.
    """
    n, prompts, stop = cfg.eval_n, test.prompt_ids, test.task.stop or None
    # each set's own seeds, the same at every eval: evals differ by the weights alone
    stream = (seed, "eval", test.name) if test.name else (seed, "eval")
    seeds = row_seeds(stream, 0, len(prompts), n)
    bar = sys.stdout.isatty()  # a progress bar on a terminal
    made_of = {"task": test.task, "problems": test.problems}  # an environment's episodes need them
    greedy = engine.generate(prompts, 1, seeds=seeds[::n], temperature=0.0, top_p=1.0, top_k=-1,
                             max_tokens=cfg.max_completion_len, stop=stop, progress=bar, **made_of)
    texts = [g[0].text for g in greedy]
    lengths = [len(g[0].completion_ids) for g in greedy]
    rewards, comps = score(test.task, texts, test.problems, lengths, cfg,
                           [g[0].completion_ids for g in greedy],
                           [g[0].env_rewards for g in greedy])
    out = {"reward": log.scored(rewards).mean().item()}
    if "correct" in comps:
        out["pass@1_greedy"] = (comps["correct"] >= 1).float().mean().item()
    # every rank generates the same calls whatever the rewards say (FSDP's HF engine: lockstep)
    if sampled:  # n samples per problem: 4 to 100 times the greedy pass's cost
        rows = engine.generate(prompts, n, seeds=seeds, temperature=cfg.temperature,
                               top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_completion_len,
                               stop=stop, progress=bar, **made_of)
        if "correct" in comps:
            out.update(sampled_metrics(test, rows, cfg))
    for name in ("format", "parsed"):
        if name in comps:
            out[name] = comps[name].mean().item()
    out["response_length"] = sum(lengths) / len(greedy)
    if multi_turn(cfg, test.task):  # the greedy answers that called the tool (or environment)
        out["tools/share_using"] = sum(g[0].tool_calls > 0 for g in greedy) / len(greedy)
    prefix = f"eval/{test.name}/" if test.name else "eval/"
    return {prefix + k: v for k, v in out.items()}, texts


def evaluate_all(engine, eval_sets, cfg, sampled=True):
    """evaluate() on each set, the training task's test split first: (all their metrics, {set's
    name: its greedy completion texts})."""
    metrics, texts = {}, {}
    for split in eval_sets:
        try:
            if isinstance(split.task, Mixture):  # D4: each task's test problems, then overall
                found, texts[split.name] = evaluate_mixture(engine, split, cfg, sampled)
            else:
                found, texts[split.name] = evaluate(engine, split, cfg, cfg.seed, sampled)
        except FloatingPointError as e:  # the HF engine's logits (rollout.sample_next)
            raise log.diverged(cfg, f"eval: {e}") from None
        metrics.update(found)
    return metrics, texts


def evaluate_mixture(engine, test, cfg, sampled=True):
    """D4: evaluate() on each task's test problems (eval/<task>/...), then each figure over all of
    them (eval/...). Every figure is a mean over problems, so the overall one is the tasks' means
    weighed by their numbers of problems; one that a task lacks (maj@n without answer()) is only
    the tasks'. Returns (metrics, greedy completion texts in the set's order)."""
    metrics, texts, means = {}, [None] * len(test.problems), collections.defaultdict(list)
    for part, (own, at) in zip(test.task.parts, by_task(test.task, test.problems)):
        name = f"{test.name}/{part.name}" if test.name else part.name
        split = dataclasses.replace(test, task=own, problems=[test.problems[i] for i in at],
                                    prompt_ids=[test.prompt_ids[i] for i in at], name=name)
        found, greedy = evaluate(engine, split, cfg, cfg.seed, sampled)
        metrics.update(found)
        for i, text in zip(at, greedy):
            texts[i] = text
        for key, value in found.items():
            means[key.removeprefix(f"eval/{name}/")].append((len(at), value))
    prefix = f"eval/{test.name}/" if test.name else "eval/"
    for key, pairs in means.items():
        if len(pairs) == len(test.task.parts) and None not in [v for _, v in pairs]:
            metrics[prefix + key] = sum(n * v for n, v in pairs) / sum(n for n, _ in pairs)
    return metrics, texts


def evaluate_in_run(engine, eval_sets, cfg, step):
    """M2's metrics before this step's update (grpo.eval_is_due), on the weights the engine
    holds."""
    start = time.perf_counter()
    # greedy only unless asked: the in-run evals draw the curve, the final one is full
    metrics = evaluate_all(engine, eval_sets, cfg, sampled=cfg.eval_in_run_sampled)[0]
    return {**metrics, "eval/updates": step, "time/eval": time.perf_counter() - start}


def wake_and_evaluate(engine, policy, eval_sets, cfg):
    """M2 on the policy as it is now: pushed into the engine, every eval set; their metrics."""
    engine.wake(push_weights_iter(policy))
    return evaluate_all(engine, eval_sets, cfg)[0]


def eval_only(cfg, engine, policy, eval_sets):
    """M2 on the weights as they are (the model, or init_from): a table of every eval set; all of
    it, with a few examples to read, appended to eval.jsonl."""
    engine.wake(push_weights_iter(policy))
    metrics, texts = evaluate_all(engine, eval_sets, cfg)
    results = {"weights": cfg.init_from or cfg.model, **metrics}
    for split in eval_sets:
        results[f"examples/{split.name}" if split.name else "examples"] = [
            {"prompt": split.task.prompt(p), "completion": t}
            for p, t in zip(split.problems[:4], texts[split.name])]
    path = os.path.join(cfg.out_dir, "eval.jsonl")
    if parallel.rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(results) + "\n")
    print(eval_table(eval_sets, metrics, cfg.task))
    print(f"weights {results['weights']}: every metric and a few examples appended to {path}")


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
