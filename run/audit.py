"""A task checked before a run trusts it, and a run's rewards replayed after it.

    check_sandbox, check_task_output   # pre-flight of every run: the sandbox, prompt() and reward()

    python -m episodes.task --audit TASK [--config RUN] [--key=value ...]  # adversarial completions
    python -m episodes.task --replay out/run/samples.jsonl  # replay (W5): re-score a run

(`python -m run.audit` runs the same.)

The audit scores the task's reward, through the path a run uses (forked workers, reward_timeout),
on completions that should not pay (audit_cases, a fuzz of the reference, names of a library
scorer's frame) and on the reference, which should.
"""

import decimal
import inspect
import json
import math
import os
import random
import re
import sys
import tempfile
import time

from config import Config, ConfigError, config_from_argv
from episodes.task import binds, load_problems, load_task, reward_shaping
from episodes.turns import first_turn
from infra.checkpoint import load_saved
from rewards import extract_answer, score_batch
from scoring import sandbox
from scoring.runner import NOT_COLUMNS, is_chat, task_rewards


def check_sandbox(cfg, task, problems):
    """Pre-flight: where the model's code runs (tools=True, RUNS_CODE for any of `problems`, or
    EXECUTES_TEXT), the sandbox cfg.sandbox accepts must be had here, or the run stops, saying what
    is missing. Sets that tier for every later call, in this process and the reward workers it
    forks."""
    sandbox.ALLOWED = cfg.sandbox
    runs = task.runs_code if callable(task.runs_code) else lambda problem: task.runs_code
    if not cfg.tools and not task.executes_text and not any(runs(p) for p in problems):
        return
    who = ("tools=True runs the model's code" if cfg.tools else
           f"{task.where} runs the model's code" if not task.executes_text else
           f"{task.where}'s reward may run the model's text as code (EXECUTES_TEXT)")
    tier, why = sandbox.best()
    if sandbox.TIERS.index(tier) < sandbox.TIERS.index(cfg.sandbox):
        raise ConfigError(f"{who}, but the {cfg.sandbox} sandbox cannot be built here: {why}. "
                          "Run on Linux as root, or where unprivileged user namespaces are "
                          "allowed, with util-linux (unshare, setpriv); or accept what this "
                          f"machine gives by name: --sandbox={tier} ({sandbox.GIVES[tier]})")
    if cfg.sandbox != "full":
        print(f"sandbox={cfg.sandbox}: {who} in the {tier} sandbox ({sandbox.GIVES[tier]})"
              + (f"; {why}" if why else ""))


def check_task_output(task, problems, cfg):
    """Pre-flight: prompt() gives a string or chat messages for every problem, and reward() a float
    or a dict of floats on an empty completion (raising there is allowed: an empty answer may well
    be an error)."""
    for p in problems:
        out = task.prompt(p)
        if not isinstance(out, str) and not is_chat(out):
            raise ConfigError(f"{task.where}: prompt() returned {out!r:.80} for problem {p['id']}; "
                              "expected a raw string or chat messages like [{'role': 'user', "
                              "'content': '...'}]")
        if isinstance(out, str) and not (out + task.completion_prefix).strip():
            raise ConfigError(f"{task.where}: prompt() returned {out!r} for problem {p['id']}: "
                              "the model needs some text to continue")
    for name, f in zip(task.reward_names, task.reward_funcs):  # called by name, as TRL calls them
        columns = {k: [] for k in set(problems[0]) - NOT_COLUMNS}
        if not binds(f, 0, prompts=[], completions=[], completion_ids=[], **columns):
            raise ConfigError(f"{task.where}: reward function {name}{inspect.signature(f)} "
                              "cannot be called as TRL calls it, f(prompts=, completions=, "
                              "completion_ids=, and a keyword per problem key "
                              f"{sorted(columns)}); end it with **kwargs")
    result = task_rewards(task, [task.completion_prefix], problems[:1], cfg.reward_timeout,
                          quiet=True)[0]
    if isinstance(result, str) and result.startswith("wrong type"):
        raise ConfigError(f"{task.where}: {'' if task.reward_funcs else 'reward() '}{result}")
    if cfg.length_reward and isinstance(result, dict) and "correct" not in result \
            and not task.episodic:  # an environment may give "correct" over its turns
        raise ConfigError(f"{task.where}: length_reward pays short right answers, and the "
                          f"reward's components {sorted(result)} have no 'correct' to say which "
                          "are right; add one, or set length_reward=0")


def replay(path, config_path=None):
    """W5: re-score every saved rollout in a samples.jsonl; print each disagreement and a summary.

    Each line: {"problem": {...}, "completion": str, "components": {...}, and optionally "reward",
    "length", "completion_ids" and "label" (a human's correct/incorrect, 1 or 0)}. The task and the
    shaping come from the run's config.json (beside the file unless config_path says otherwise).
    Returns the number of disagreements.
    """
    cfg = load_saved(config_path or os.path.join(os.path.dirname(os.path.abspath(path)),
                                                 "config.json"))
    task = load_task(cfg)
    sandbox.ALLOWED = cfg.sandbox  # code is re-run in the sandbox the run accepted, or fails
    rows, disagreements = 0, 0
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for lineno, rec in enumerate(records, 1):
        rows += 1
        ids = [rec["completion_ids"]] if "completion_ids" in rec else None
        fresh = task_rewards(task, [task.completion_prefix + rec["completion"]], [rec["problem"]],
                             0, completion_ids=ids)[0]
        failed, fresh = isinstance(fresh, str), {} if isinstance(fresh, str) else fresh
        # "errors" and "timeouts" count rewards that failed at training time; the reward check
        # catches those. A component a completion lacks (a reward function's None) was logged as 0
        # (score_batch)
        checks = {k: (v, None if failed else fresh.get(k, 0.0))
                  for k, v in rec.get("components", {}).items() if k not in ("errors", "timeouts")}
        if "reward" in rec:
            weights, shape = reward_shaping(task, cfg)
            rewards, _ = score_batch([fresh], [rec.get("length", 0)], weights, **shape)
            # a tool run's failed calls
            penalty = cfg.tool_error_penalty * rec.get("tool_errors", 0)
            checks["reward"] = (rec["reward"], rewards[0].item() - penalty)
        if "label" in rec:
            checks["label"] = (rec["label"], fresh.get("correct"))
        for key, (stored, now) in checks.items():
            if now is None or not same_number(float(stored), float(now)):
                disagreements += 1
                print(f"line {lineno}: {key} stored {stored} != re-scored {now}")
                print(f"    completion: {rec['completion'][-200:]!r}")
    print(f"replayed {rows} rollouts from {path}: {disagreements} disagreements")
    task.close()
    return disagreements


def same_number(a, b):
    """Equal to 1e-6, NaN to NaN (an unscored completion's reward)."""
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6


# ---------------------------------------------------------------- the reward audit

AUDIT_PROBLEMS = 3  # the first problems of the train split are audited
AUDIT_FUZZ = 12  # random edits of each problem's reference
AUDIT_SLOW = 1.0  # seconds: a call slower than this is reported (a step makes batch_size of them)
AUDIT_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# names a library scorer's frame holds (reasoning-gym's score_answer: the gold among them), which an
# answer it evals could read
FRAME_NAMES = ("oracle_answer", "answer", "entry", "metadata", "valid_solutions", "globals()",
               "locals()")


def audit(task_name, argv=()):
    """python -m episodes.task --audit TASK [--config RUN] [--key=value ...]: the task's reward
    against adversarial completions (audit_cases) and a fuzz of its reference(problem), on the first
    AUDIT_PROBLEMS problems, through task_rewards as a run scores (forked workers, reward_timeout).
    Prints each crash, timeout, non-number, slow call and suspicious reward: one that reaches the
    reference's, or that the task calls correct, without giving a right answer. Returns the number
    of failures: all of these but the slow calls."""
    cfg = config_from_argv([*argv, f"--task={task_name}"])
    cfg.train_size = AUDIT_PROBLEMS
    task = load_task(cfg)
    problems = load_problems(cfg, task, "train")
    check_sandbox(cfg, task, problems)
    print(f"audit of {task.where}: {len(problems)} problems, reward_timeout={cfg.reward_timeout} s")
    if task.reward is None and not task.reward_funcs:  # the reward is the environment's
        return audit_environment(task, problems, cfg)
    if task.reference is None:
        print("  note: the task file defines no reference(problem): suspicious rewards go untold")
    run = Audit(task, cfg)
    references = [task.reference(p) if task.reference else None for p in problems]
    references = [r if isinstance(r, str) else None for r in references]  # others: Audit.problem
    for i, problem in enumerate(problems):
        run.problem(problem, references[i + 1:] + references[:i])
    for kind, text in run.findings:
        print(f"  {kind}: {text}")
    seconds, name = max(run.times)
    failures = sum(kind != "slow" for kind, _ in run.findings)
    mean = sum(t for t, _ in run.times) / len(run.times)
    print(f"{len(run.times)} calls, slowest {seconds:.3f} s ({name}), mean {mean:.3f} s; "
          f"{failures} failures, {len(run.findings) - failures} slow calls: "
          f"{'FAIL' if failures else 'PASS'}")
    task.close()
    return failures


def audit_environment(task, problems, cfg):
    """The audit of a task whose reward is its environment's: each adversarial completion as the
    model's first turn, in a fresh environment of each problem, under tool_timeout. A failure: a
    call that raises, hangs or returns the wrong shape, or a turn that scores "correct"."""
    failures, calls = 0, 0
    for problem in problems:
        prompt = task.prompt(problem)
        prompt = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        for name, text in audit_cases(prompt, None, None).items():
            rewards = first_turn(task.environment, problem, text, cfg.tool_timeout)
            calls += 1
            if not isinstance(rewards, dict) or rewards.get("correct", 0.0) >= 1:
                failures += 1
                print(f"  {'scores correct' if isinstance(rewards, dict) else rewards}: problem "
                      f"{problem['id']}, the {name} completion")
    print(f"{calls} environment turns; {failures} failures: {'FAIL' if failures else 'PASS'}")
    return failures


class Audit:
    """Scores completions as a run does, timing each call, and collects what goes wrong."""

    def __init__(self, task, cfg):
        self.task, self.findings, self.times, self.noted = task, [], [], False
        # never in-process (reward_timeout=0): a reward that hangs would hang the audit
        self.timeout = cfg.reward_timeout or Config.reward_timeout
        weights, shape = reward_shaping(task, cfg)
        # no tokenizer here, so no length shaping (W3)
        self.weights, self.shape = weights, {**shape, "length_soft_limit": 0, "length_min": 0}

    def problem(self, problem, others):
        """Audit one problem; others: the other problems' references, wrong answers to try here."""
        task, best, gold, wrong = self.task, None, None, None
        reference = task.reference(problem) if task.reference else None
        if reference is not None and not isinstance(reference, str):
            self.findings.append(("bad reference", f"problem {problem['id']}: reference() returned "
                                  f"{type(reference).__name__} {reference!r:.60}; it must return "
                                  "a completion (a string) or None"))
            reference = None
        if reference is not None:
            best, result = self.score("reference", problem, reference)
            if best is not None and result.get("correct", 1.0) < 1:
                self.findings.append(("bad reference", f"problem {problem['id']}: "
                                      f"{as_text(result)} for its reference {reference!r:.80}"))
                best = None
        if best is not None:
            gold = extract_answer(task.completion_prefix + reference)
            gold = reference.strip() if gold is None else gold
            wrong = self.wrong_answer(problem, reference, gold, best, others)
        prompt = task.prompt(problem)
        prompt = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        cases = audit_cases(prompt, gold, wrong)
        cases.update(near_misses(reference, gold) if best is not None else {})
        for name, text in cases.items():
            self.score(name, problem, text, best)
        self.probe(problem, reference if best is not None else None, gold)
        if best is None:
            print(f"problem {problem['id']}: no reference: crashes, slow calls, non-numbers only")
            return
        pieces = ["<answer>", "</answer>", "<think>", "</think>", "\\boxed{", "}", "```python\n",
                  "```", "\n", gold, "correct"]
        pieces += [extract_answer(wrong) or wrong] if wrong else []
        rng = random.Random(problem["id"])
        for name, text in fuzzed(reference, pieces, rng, AUDIT_FUZZ).items():
            self.score(name, problem, text, best, strictly=True)  # an edit may leave it right
        print(f"problem {problem['id']}: reference scores {best:.4g}; {len(cases)} cases, "
              f"{AUDIT_FUZZ} fuzzed references")

    def score(self, name, problem, text, limit=None, strictly=False):
        """The reward and components of one completion (None, None if it failed), noting a
        failure, a slow call and a suspicious reward: above `limit` (or at it, or correct, unless
        strictly)."""
        failures = []
        start = time.perf_counter()
        result = task_rewards(self.task, [self.task.completion_prefix + text], [problem],
                              self.timeout, failed=lambda value, detail: failures.append(detail))[0]
        seconds = time.perf_counter() - start
        self.times.append((seconds, name))
        where = f"{name}, problem {problem['id']}"
        if isinstance(result, str):  # the traceback's last line, or why
            why = (failures[0].strip().splitlines() or [result])[-1] if failures else result
            kind = {"error": "crash", "timeout": "timeout"}.get(result, "non-number")
            self.findings.append((kind, f"{where}: {why:.200}; completion {text!r:.80}"))
            return None, None
        if seconds > AUDIT_SLOW:
            self.findings.append(("slow", f"{where}: {seconds:.2f} s a call; {text!r:.60}"))
        reward = score_batch([result], [0], self.weights, **self.shape)[0][0].item()
        if limit is None:
            return reward, result
        if reward > limit + 1e-9 or (not strictly and reward >= limit - 1e-9):
            self.findings.append(("suspicious", f"{where}: {reward:.4g} >= the reference's "
                                  f"{limit:.4g} ({as_text(result)}); completion {text!r:.120}"))
        elif not strictly and result.get("correct", 0.0) >= 1:  # what acc and pass@k count
            self.findings.append(("suspicious", f"{where}: correct ({as_text(result)}); "
                                  f"completion {text!r:.120}"))
        return reward, result

    def probe(self, problem, reference, gold):
        """Answers that are Python (items 1-2 of a library scorer's risks): does the reward run them
        outside a sandbox (each makes a folder here if it runs), or can one read a name of the
        scorer's frame, the gold among them (a folder by that name, or a score above nonsense)?"""
        with tempfile.TemporaryDirectory() as folder:
            def placed(text):  # in the reference's answer place, else in an answer tag
                if reference is None or not gold or gold not in reference:
                    return f"<think>k</think><answer>{text}</answer>"
                at = reference.rfind(gold)
                return reference[:at] + text + reference[at + len(gold):]

            mkdir = "__import__('os').mkdir({!r} + {})"
            runs = {"runs Python": mkdir.format(folder + "/ran", "''"),
                    "runs Python, in a list": "[" + mkdir.format(folder + "/ran", "''") + "]"}
            for name in FRAME_NAMES:
                runs[f"reads {name}"] = mkdir.format(f"{folder}/{name.strip('()')}",
                                                     f"str({name})[:0]")
            for case, text in runs.items():
                self.score(f"probe: {case}", problem, placed(text))
            ran = sorted(os.listdir(folder))
            if ran:
                self.findings.append(("executes", (
                    f"problem {problem['id']}: answers that are Python ran outside a sandbox, as "
                    f"this user (e.g. {runs['runs Python']!r:.60}); declare EXECUTES_TEXT = True "
                    "in the task file")))
            read = [name for name in FRAME_NAMES if name.strip("()") in ran]
            if read:
                self.findings.append(("reads the gold", (
                    f"problem {problem['id']}: an answer evaluated these names of the scorer's "
                    f"frame: {', '.join(read)}")))
            for name in FRAME_NAMES:  # each against the same text with a name bound to nothing
                unbound = name.replace(name.strip("()"), "q" * len(name.strip("()")))
                for form in ("{}", "{}[0]", "[r.split() for r in {}[0].split(chr(10))]"):
                    text, control = form.format(name), form.format(unbound)
                    reward, _ = self.score(f"probe: {text}", problem, placed(text))
                    floor, _ = self.score(f"probe: {control}", problem, placed(control))
                    if reward is not None and floor is not None and reward > floor + 1e-9:
                        self.findings.append(("reads the gold", (
                            f"problem {problem['id']}: the answer {text!r} scores {reward:.4g}, "
                            f"{control!r} {floor:.4g}: an answer can read the scorer's names")))

    def wrong_answer(self, problem, reference, gold, best, others):
        """A completion in the reference's form that the reward scores below it: a number near a
        one-number answer, or another problem's reference; None if none is found."""
        def form(text):
            return [mark in text for mark in ("```", "\\boxed", "<answer>", "<think>")]

        alike = [o for o in others if o and form(o) == form(reference)]
        for candidate in [*near_misses(reference, gold).values(), *alike]:
            reward = self.score("a wrong answer", problem, candidate)[0]
            if reward is not None and reward < best - 1e-9:
                return candidate
            if reward is not None and not self.noted:
                self.noted = True
                print(f"  note: problem {problem['id']}: {candidate!r:.40} scores {reward:.4g} "
                      "here, as much as its reference: a reward that ignores the problem?")
        print(f"  note: problem {problem['id']}: no wrong answer in the reference's form; the "
              "cases that give the gold answer and then another are left out")
        return None


def audit_cases(prompt, gold, wrong):
    """The adversarial completions, by name, none of which gives a right answer as its answer:
    the gold answer (`gold`: what the reference's answer tag holds) appears only where another
    answer (`wrong`, a completion in the reference's form the reward scores lower) follows it.
    Without gold or wrong, the cases that need neither."""
    cases = {
        "empty": "",
        "whitespace": " \n\t \r\n  ",
        "huge (1 MB)": ("lorem ipsum dolor sit amet " * 40_000)[:1_000_000],
        "huge tags (1 MB)": "<answer>" * 60_000 + "</answer>" * 60_000,
        # control characters and every byte but the digits; RTL, zero-width, BOM, combining, astral
        "binary junk": "".join(chr(b) for b in range(256) if not chr(b).isdigit()) * 20,
        "unicode junk": "\u202e\u200b\ufeff\x00 \u4e2d\u6587 \U0001f916 e\u0301 \uffff \U0010ffff"
        * 50,
        "prompt copied": prompt,
        "says correct": "correct",
        "says correct, tagged": "<think>correct</think><answer>correct</answer>",
        "says correct, in words": "The answer is correct. Correct! Full marks, verified.",
    }
    if gold is None or wrong is None:
        return cases
    other = extract_answer(wrong)
    other = wrong.strip() if other is None else other
    cases.update({
        "gold mentioned, another answer": f"The answer is not {gold}.\n{wrong}",
        "several answers, gold between":
            f"<answer>{other}</answer>\n<answer>{gold}</answer>\n{wrong}",
        "nested tags": f"<answer>{gold}<answer>{other}</answer></answer>",
        "nested tags, gold inside": f"<answer><answer>{gold}</answer>{other}</answer>",
        "unbalanced tags": f"</answer>{gold}<answer>\n{wrong}",
        "unclosed tag": f"<answer>{gold}\n{wrong}",
    })
    return cases


def near_misses(reference, gold):
    """Numbers that round to a one-number answer, in its place in the reference: for 27, 27.4,
    26.6 and 27.000001."""
    numbers = AUDIT_NUMBER.findall(gold)
    if len(numbers) != 1 or "```" in gold:
        return {}
    at, value = reference.rfind(numbers[0]), decimal.Decimal(numbers[0])
    near = (value + decimal.Decimal("0.4"), value - decimal.Decimal("0.4"),
            value + decimal.Decimal("0.000001"))
    end = at + len(numbers[0])
    return {f"rounds to the answer ({v})": reference[:at] + str(v) + reference[end:] for v in near}


def fuzzed(reference, pieces, rng, n):
    """n random edits of the reference: pieces put in, spans deleted or doubled, junk characters."""
    out = {}
    for k in range(n):
        text = reference
        for _ in range(rng.randint(1, 3)):
            i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
            op = rng.choice(("insert", "delete", "double", "junk"))
            if op == "insert":
                text = text[:i] + rng.choice(pieces) + text[i:]
            elif op == "delete":
                text = text[:i] + text[j:]
            elif op == "double":
                text = text[:j] + text[i:j] + text[j:]
            else:
                text = text[:i] + rng.choice("\x00<>/{}()*`\n \u00e9\U0001f916") + text[i + 1:]
        out[f"fuzz {k}"] = text
    return out


def as_text(components):
    return ", ".join(f"{k} {v:.4g}" for k, v in components.items())


def main(argv):
    """python -m episodes.task --audit TASK ... | --replay FILE: exits 1 where a check failed."""
    if len(argv) == 2 and argv[0] == "--replay":
        sys.exit(1 if replay(argv[1]) else 0)
    if len(argv) >= 2 and argv[0] == "--audit":
        try:
            sys.exit(1 if audit(argv[1], argv[2:]) else 0)
        except ConfigError as e:
            sys.exit(f"error: {e}")
    sys.exit("usage: python -m episodes.task --replay out/run/samples.jsonl\n"
             "       python -m episodes.task --audit TASK [--config RUN] [--key=value ...]")


if __name__ == "__main__":
    main(sys.argv[1:])
