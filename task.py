"""A task: problems, a prompt and a reward, from one plain Python file. `task` names it.

    python grpo.py --task=countdown                  # a built-in task: tasks/countdown.py
    python grpo.py --task=mytask.py                  # your own file
    python grpo.py --task=gsm8k --data_path=data/gsm8k   # a task's problems from a dataset (data/files.py)
    python grpo.py --task=mine.jsonl                 # shorthand: tasks/dataset.py on that file

A task file defines three functions (tasks/larger.py is a complete example):

    problems(split, n, seed) -> list of dicts     split is "train" or "test"; not needed with data_path
    prompt(problem)          -> chat messages [{"role": "user", "content": ...}] or a raw string (no template)
    reward(completion, problem) -> a float, or a dict of named floats; "correct" (1/0, or a share) makes
                                   pass@k and accuracy; "format" and "parsed" feed the shaping (rewards.py)

and may define:

    COMPLETION_PREFIX = "<think>"   the answer's first words, written by the prompt, not sampled; the reward
                                    sees them in front of the completion (R1-Zero's template ends with it)
    WEIGHTS = {"numbers_valid": 0}  weights of the task's own components (default 1; reward_weights overrides)
    COLUMNS = {"question": "prompt"}  dataset columns to rename before a row becomes a problem
    check(problem)                  raise ValueError saying what a dataset row lacks (named with its line)
    configure(cfg)                  called once with the run's Config before anything else
    RUNS_CODE = True                the reward runs the model's code (sandbox.py): the run starts
                                    only where the sandbox that `sandbox` accepts can be had; or a
                                    function of a problem, if only some do (as tools=True always)
    STOP = ["</answer>"]            strings that end a completion (kept in it) in training and eval
                                    alike: a base model stops at its answer, not max_completion_len
    answer(completion, problem)     the completion's final answer as a normalised string, or None:
                                    the eval's maj@n votes on it (quick: it runs in the trainer)

The reward runs in a forked child process with a deadline (reward_timeout): a reward that raises or hangs
scores 0 for that completion and is counted in reward/errors; the run goes on. Module state the reward
changes therefore does not persist from batch to batch. Every process a reward starts (a daemon that
double-forks too) is ended when its call ends, and the reward's process dies with the trainer.
reward_timeout=0 runs it in-process: no deadline, and what it starts is its own to end (a helper
process may live across batches).
"""

import importlib.util
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import sandbox
from config import ConfigError, load_saved
from data.files import is_data_path, load_rows
from rewards import score_batch

TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


@dataclass
class Task:
    """The functions and extras of one task file; `where` names the file in every message."""

    where: str
    problems: object  # problems(split, n, seed), or None when the problems come from data_path
    prompt: object  # prompt(problem)
    reward: object  # reward(completion, problem)
    completion_prefix: str = ""
    weights: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)
    check: object = None
    runs_code: object = False  # RUNS_CODE: True, False, or a function of a problem
    stop: list = field(default_factory=list)  # STOP: strings that end a completion, kept in it
    answer: object = None  # answer(completion, problem): the final answer maj@n votes on, or None


def builtin_tasks():
    """Names of the task files in tasks/."""
    return sorted(f[:-3] for f in os.listdir(TASK_DIR) if f.endswith(".py"))


def task_file(cfg):
    """The file `cfg.task` names: a built-in name, a .py path, or (a data file as the task) tasks/dataset.py."""
    if cfg.task in builtin_tasks():
        return os.path.join(TASK_DIR, cfg.task + ".py")
    if cfg.task.endswith(".py"):
        if not os.path.isfile(cfg.task):
            raise ConfigError(f"task file {cfg.task} not found")
        return cfg.task
    if is_data_path(cfg.task):
        return os.path.join(TASK_DIR, "dataset.py")
    raise ConfigError(f"task={cfg.task!r}: choose a built-in task {builtin_tasks()}, a task file (.py), "
                      f"or a data file (.jsonl, .parquet, .csv) or folder")


def import_file(path):
    """The module in the file at `path` (loaded by path: tasks/ is a folder of files, not a package)."""
    name = "task_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickling and dataclasses inside the file find it
    spec.loader.exec_module(module)
    return module


def load_task(cfg):
    """Import the task file, check it defines what the run needs, call its configure(cfg). Fails in pre-flight."""
    path = task_file(cfg)
    module = import_file(path)
    data_path = cfg.data_path or (cfg.task if is_data_path(cfg.task) else "")
    for name, signature in (("prompt", "prompt(problem)"), ("reward", "reward(completion, problem)"),
                            ("problems", "problems(split, n, seed)")):
        if name == "problems" and data_path:
            continue  # the problems come from the dataset
        if not callable(getattr(module, name, None)):
            hint = " (or set data_path to a dataset)" if name == "problems" else ""
            raise ConfigError(f"task file {path} defines no function {signature}{hint}")
        # such a function fails only when called: a reward on every completion, each then scoring 0
        if not binds(getattr(module, name), signature.count(",") + 1):
            raise ConfigError(f"task file {path}: {name}{inspect.signature(getattr(module, name))} "
                              f"cannot be called as {signature}")
    if hasattr(module, "configure"):
        module.configure(cfg)
    extras = {"completion_prefix": getattr(module, "COMPLETION_PREFIX", ""), "weights": getattr(module, "WEIGHTS", {}),
              "columns": getattr(module, "COLUMNS", {}), "check": getattr(module, "check", None),
              "runs_code": getattr(module, "RUNS_CODE", False)}
    if not isinstance(extras["completion_prefix"], str) or not isinstance(extras["weights"], dict):
        raise ConfigError(f"task file {path}: COMPLETION_PREFIX must be a string and WEIGHTS a dict of floats")
    if not isinstance(extras["runs_code"], bool) and not callable(extras["runs_code"]):
        raise ConfigError(f"task file {path}: RUNS_CODE must be True, False or a function of a "
                          "problem")
    extras["stop"] = stop_strings(path, getattr(module, "STOP", []))
    extras["answer"] = getattr(module, "answer", None)
    answer = extras["answer"]
    if answer is not None and not (callable(answer) and binds(answer, 2)):
        raise ConfigError(f"task file {path}: answer must be a function answer(completion, "
                          "problem) returning the final answer as a string, or None")
    return Task(path, None if data_path else module.problems, module.prompt, module.reward, **extras)


def stop_strings(path, stop):
    """STOP as a list: a list (or tuple) of non-empty strings, else a ConfigError naming it."""
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"task file {path}: STOP = {stop!r:.80}; it must be a list of non-empty "
                          'strings, e.g. STOP = ["</answer>"]')
    return list(stop)


def check_sandbox(cfg, task, problems):
    """Pre-flight: where the model's code runs (tools=True, or RUNS_CODE for any of `problems`),
    the sandbox cfg.sandbox accepts must be had here, or the run stops, saying what is missing.
    Sets that tier for every later call, in this process and the reward workers it forks."""
    sandbox.ALLOWED = cfg.sandbox
    runs = task.runs_code if callable(task.runs_code) else lambda problem: task.runs_code
    if not cfg.tools and not any(runs(p) for p in problems):
        return
    who = "tools=True runs the model's code" if cfg.tools else f"{task.where} runs the model's code"
    tier, why = sandbox.best()
    if sandbox.TIERS.index(tier) < sandbox.TIERS.index(cfg.sandbox):
        raise ConfigError(f"{who}, but the {cfg.sandbox} sandbox cannot be built here: {why}. "
                          "Run on Linux as root, or where unprivileged user namespaces are "
                          "allowed, with util-linux (unshare, setpriv); or accept what this "
                          f"machine gives by name: --sandbox={tier} ({sandbox.GIVES[tier]})")
    if cfg.sandbox != "full":
        print(f"sandbox={cfg.sandbox}: {who} in the {tier} sandbox ({sandbox.GIVES[tier]})"
              + (f"; {why}" if why else ""))


def binds(fn, count):
    """False if fn cannot take `count` positional arguments (True where its signature is hidden)."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: the call will tell
        pass
    return True


# ---------------------------------------------------------------- problems and prompts


def load_problems(cfg, task, split):
    """The problems of `split` ("train" or "test"): the task's problems(), or rows of data_path.
    "eval", an eval_tasks set: a dataset's every test row (a file of its own: every row), else the
    task's test split."""
    n = cfg.train_size if split == "train" else cfg.test_size
    if split == "eval" and task.problems is not None:
        split = "test"
    elif split == "eval":
        n = None  # every row: the file is the eval set, as a paper reports it
    if task.problems is None:
        columns = {**task.columns, **cfg.data_column_map}
        rows = load_rows(cfg.data_path or cfg.task, split, n, columns, task.check, cfg.data_name)
        return json_safe(task, rows)
    problems = task.problems(split, n, cfg.data_seed)
    if not isinstance(problems, list) or not problems or not all(isinstance(p, dict) for p in problems):
        raise ConfigError(f"{task.where}: problems({split!r}, {n}, {cfg.data_seed}) must return a non-empty list "
                          f"of dicts, got {type(problems).__name__}")
    problems = [{**p, "id": str(p.get("id", f"{split}:{i}"))} for i, p in enumerate(problems)]
    return json_safe(task, problems)


def json_safe(task, problems):
    """The problems, each checked to be writable as JSON: samples.jsonl stores them (W6)."""
    for p in problems:
        try:
            json.dumps(p)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{task.where}: problem {p['id']} holds what JSON cannot write "
                              f"({e}); keep problems to dicts, lists, strings, numbers, booleans "
                              "and None") from None
    return problems


def prompt_text(tokenizer, task, problem):
    """The text the model continues for this problem (render)."""
    return render(tokenizer, task, task.prompt(problem))


def render(tokenizer, task, p):
    """prompt()'s value as text: chat messages through the chat template, a raw string as it is; then the
    COMPLETION_PREFIX (in a chat, the start of the assistant's turn)."""
    if isinstance(p, str):
        return p + task.completion_prefix  # R1-Zero style: a base model, no template
    if not tokenizer.chat_template:
        raise ConfigError(f"{task.where}: prompt() returned chat messages but this tokenizer has no chat template "
                          "(a base model?); return a raw string instead")
    if task.completion_prefix:  # the assistant's turn opened and begun, not closed
        return tokenizer.apply_chat_template([*p, {"role": "assistant", "content": task.completion_prefix}],
                                             continue_final_message=True, tokenize=False)
    return tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)


def tokenize_prompts(tokenizer, task, problems, max_prompt_len):
    """Prompt token ids; a prompt longer than max_prompt_len is an error, never cut."""
    # A token covers at most `longest` characters of the normalised text, and NFC or NFKC (Qwen's)
    # composes at most 4 characters into one: a longer text cannot fit, and is never tokenised whole
    longest = max(map(len, tokenizer.get_vocab()))
    out = []
    for problem in problems:
        p = task.prompt(problem)
        text = render(tokenizer, task, p)
        if len(text) > 4 * (max_prompt_len + 1) * longest:
            raise ConfigError(f"prompt {problem['id']} has {len(text)} characters, more than "
                              f"max_prompt_len={max_prompt_len} tokens can hold; shorten it")
        # a chat template writes its own special tokens (BOS); a raw prompt gets the tokenizer's
        ids = tokenizer(text, add_special_tokens=isinstance(p, str)).input_ids
        if len(ids) > max_prompt_len:
            raise ConfigError(f"prompt {problem['id']} has {len(ids)} tokens > max_prompt_len={max_prompt_len}; "
                              "raise it")
        out.append(ids)
    return out


def is_chat(p):
    """True for a non-empty list of {"role": ..., "content": str} messages."""
    return isinstance(p, list) and bool(p) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in p)


def check_task_output(task, problems, cfg):
    """Pre-flight: prompt() gives a string or chat messages for every problem, and reward() a float or a dict of
    floats on an empty completion (raising there is allowed: an empty answer may well be an error)."""
    for p in problems:
        out = task.prompt(p)
        if not isinstance(out, str) and not is_chat(out):
            raise ConfigError(f"{task.where}: prompt() returned {out!r:.80} for problem {p['id']}; expected a raw "
                              "string or chat messages like [{'role': 'user', 'content': '...'}]")
        if isinstance(out, str) and not (out + task.completion_prefix).strip():
            raise ConfigError(f"{task.where}: prompt() returned {out!r} for problem {p['id']}: "
                              "the model needs some text to continue")
    result = run_rewards(task.reward, [task.completion_prefix], problems[:1], cfg.reward_timeout, quiet=True)[0]
    if isinstance(result, str) and result.startswith("wrong type"):
        raise ConfigError(f"{task.where}: reward() {result}")


# ---------------------------------------------------------------- the reward under a deadline


def as_components(value):
    """A reward's return value as {name: float}: a float becomes {"score": float}. Raises TypeError otherwise."""
    if isinstance(value, (int, float)):
        value = {"score": value}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              for k, v in value.items()):
        raise TypeError(f"wrong type: returned {value!r:.80}; expected a float or a dict of named floats")
    try:
        floats = {k: float(v) for k, v in value.items()}
    except OverflowError:  # an int past float's range, e.g. 10**400
        raise TypeError("wrong type: returned an integer too large for a float") from None
    if not all(math.isfinite(v) for v in floats.values()):
        raise TypeError(f"wrong type: returned a non-finite value {value!r:.80}")
    return floats


def _score_all(reward, jobs, send, after=lambda: None):  # after(): after each call, before its send
    """Score each (i, text, problem) in order; send (i, components, "") or (i, "error" | "wrong type: ...", detail)."""
    for i, text, problem in jobs:
        try:
            value = reward(text, problem)
        except BaseException:  # anything the reward does, sys.exit included, fails only this completion
            after()
            send((i, "error", traceback.format_exc()))
            continue
        after()
        try:
            send((i, as_components(value), ""))
        except TypeError as e:
            send((i, str(e), ""))


def _child(reward, jobs, conn, parent):
    sandbox.die_with_parent(parent)  # kill -9 of the trainer ends this worker too
    sandbox.become_subreaper()  # what the reward starts stays below the worker, even a daemon
    _score_all(reward, jobs, conn.send, after=_end_leftovers)
    conn.close()


def _live_children():
    """{pid: [its live children]} of every process, from /proc (Linux; {} elsewhere)."""
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{name}/stat") as f:
                # the name in (...) may hold spaces
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if state not in "ZX":
            children.setdefault(int(ppid), []).append(int(name))
    return children


def end_tree(root, with_root=False):
    """SIGKILL every live process below `root` (and root itself if with_root). Each is stopped
    first, so none can fork or die (and so leave the tree) while the tree is read."""
    stopped = {root} if with_root else set()
    try:
        _signal(stopped, signal.SIGSTOP)
        while True:
            children, todo, below = _live_children(), [root], set()
            while todo:
                kids = children.get(todo.pop(), [])
                below.update(kids)
                todo += kids
            if not below - stopped:
                break
            _signal(below - stopped, signal.SIGSTOP)
            stopped |= below
    finally:  # a stopped process is never left behind
        _signal(stopped, signal.SIGKILL)


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone already
            pass


def _end_leftovers():
    """After a reward call in a worker (a child subreaper): kill and reap all the reward left."""
    deadline, ended = time.monotonic() + 5, False
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child, so nothing below: an orphan would have become this process's child
        if pid == 0 and not ended:
            end_tree(os.getpid())
            ended = True
        elif pid == 0:
            time.sleep(0.001)


_REPORTED = set()  # the first failure of each kind is printed once per process, then only counted
FAILURES = {"error": "a reward raised (or its process died)", "timeout": "a reward ran past reward_timeout"}


def report(kind, detail):
    if kind not in _REPORTED:
        _REPORTED.add(kind)
        print(f"warning: {FAILURES.get(kind, 'a reward returned the wrong type')}; the completion scores 0 and is "
              f"counted in reward/errors (printed once):\n{detail}", file=sys.stderr)


def run_rewards(reward, texts, problems, timeout, workers=1, quiet=False):
    """reward(text, problem) for each completion: a components dict, or a string saying why it failed
    ("error", "timeout", "wrong type: ..."). With timeout > 0, `workers` forked children each score a share
    in order; one that sends nothing for `timeout` s is killed, its completion marked "timeout", and a fresh
    child goes on with the rest. A worker kills every process its reward leaves (after each call),
    and is killed with them on a timeout. timeout = 0: in this process, no deadline, none killed."""
    results, workers = [None] * len(texts), max(1, workers)

    def record(message):
        i, value, detail = message
        results[i] = value
        if isinstance(value, str) and not quiet:
            report(value if value in FAILURES else "wrong type", detail or value)

    jobs = [(i, t, p) for i, (t, p) in enumerate(zip(texts, problems))]
    if not timeout:
        _score_all(reward, jobs, record)
        return results
    ctx = multiprocessing.get_context("fork")  # the child inherits the task module: any function works

    def start(share):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(reward, share, child, os.getpid()), daemon=True)
        proc.start()
        child.close()
        return parent, [proc, share, time.monotonic() + timeout]

    running = dict(start(jobs[w::workers]) for w in range(min(workers, len(jobs))))
    while running:
        soonest = min(state[2] for state in running.values())
        ready = multiprocessing.connection.wait(list(running), max(0.0, soonest - time.monotonic()))
        for conn in list(running):
            proc, share, deadline = running.pop(conn)
            if conn in ready:
                try:
                    message, dead = conn.recv(), False
                except EOFError:  # the child died (a crash, os._exit) while scoring share[0]
                    proc.join()
                    message, dead = (share[0][0], "error", f"its process died (exit code {proc.exitcode})"), True
            elif time.monotonic() >= deadline:
                end_tree(proc.pid, with_root=True)  # the worker and all its reward started
                message, dead = (share[0][0], "timeout", f"no result within reward_timeout={timeout} s"), True
            else:
                running[conn] = [proc, share, deadline]
                continue
            record(message)
            rest = share[1:]
            if dead:
                proc.join()
                if rest:  # a fresh child for the rest of this share
                    running.update([start(rest)])
            elif rest:
                running[conn] = [proc, rest, time.monotonic() + timeout]
            else:
                proc.join()
    return results


def score(task, texts, problems, lengths, cfg):
    """Rewards (N,) and components {name: (N,)} of N completions: the task's reward, then the shaping (W2, W3)."""
    seen = [task.completion_prefix + t for t in texts]  # the reward sees the answer as the model's whole turn
    results = run_rewards(task.reward, seen, problems, cfg.reward_timeout, cfg.reward_workers)
    return score_batch(results, lengths, {**task.weights, **cfg.component_weights}, **cfg.shaping)


# ---------------------------------------------------------------- offline replay (W5)


def replay(path, config_path=None):
    """W5: re-score every saved rollout in a samples.jsonl; print each disagreement and a summary.

    Each line: {"problem": {...}, "completion": str, "components": {...}, and optionally "reward",
    "length" and "label" (a human's correct/incorrect, 1 or 0)}. The task and the shaping come from the
    run's config.json (beside the file unless config_path says otherwise). Returns the number of disagreements.
    """
    cfg = load_saved(config_path or os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"))
    task = load_task(cfg)
    sandbox.ALLOWED = cfg.sandbox  # code is re-run in the sandbox the run accepted, or fails
    rows, disagreements = 0, 0
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for lineno, rec in enumerate(records, 1):
        rows += 1
        fresh = run_rewards(task.reward, [task.completion_prefix + rec["completion"]], [rec["problem"]], 0)[0]
        fresh = {} if isinstance(fresh, str) else fresh
        # "errors" and "timeouts" count rewards that failed at training time; the reward check catches those
        checks = {k: (v, fresh.get(k)) for k, v in rec.get("components", {}).items() if k not in ("errors", "timeouts")}
        if "reward" in rec:
            rewards, _ = score_batch([fresh], [rec.get("length", 0)], {**task.weights, **cfg.component_weights},
                                     **cfg.shaping)
            penalty = cfg.tool_error_penalty * rec.get("tool_errors", 0)  # a tool run's failed calls
            checks["reward"] = (rec["reward"], rewards[0].item() - penalty)
        if "label" in rec:
            checks["label"] = (rec["label"], fresh.get("correct"))
        for key, (stored, now) in checks.items():
            if now is None or abs(float(stored) - float(now)) > 1e-6:
                disagreements += 1
                print(f"line {lineno}: {key} stored {stored} != re-scored {now}")
                print(f"    completion: {rec['completion'][-200:]!r}")
    print(f"replayed {rows} rollouts from {path}: {disagreements} disagreements")
    return disagreements


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--replay":
        sys.exit("usage: python task.py --replay out/run/samples.jsonl")
    sys.exit(1 if replay(sys.argv[2]) else 0)
