"""A task: problems, a prompt and a reward, from one plain Python file. `task` names it.

    python grpo.py --task=countdown                  # a built-in task: tasks/countdown.py
    python grpo.py --task=mytask.py                  # your own file
    python grpo.py --task=gsm8k --data_path=data/gsm8k   # problems from a dataset (data/files.py)
    python grpo.py --task=mine.jsonl                 # shorthand: tasks/dataset.py on that file

A task file defines three functions (tasks/larger.py is a complete example):

    problems(split, n, seed) -> list of dicts     split is "train" or "test"; not needed with
                                                  data_path
    prompt(problem)          -> chat messages [{"role": "user", "content": ...}] or a raw string
                                (no template)
    reward(completion, problem) -> a float, or a dict of named floats; "correct" (1/0, or a share)
                                   makes pass@k and accuracy; "format" and "parsed" feed the
                                   shaping (rewards.py)

and may define:

    reference(problem)       -> a completion that earns full reward (`python task.py --audit`)
    COMPLETION_PREFIX = "<think>"   the answer's first words, written by the prompt, not sampled;
                                    the reward sees them in front of the completion (R1-Zero's
                                    template ends with it)
    WEIGHTS = {"numbers_valid": 0}  weights of the task's own components (default 1;
                                    reward_weights overrides)
    COLUMNS = {"question": "prompt"}  dataset columns to rename before a row becomes a problem
    check(problem)                  raise ValueError saying what a dataset row lacks (named with
                                    its line)
    configure(cfg)                  called once with the run's Config before anything else
    RUNS_CODE = True                the reward runs the model's code (sandbox.py): the run starts
                                    only where the sandbox that `sandbox` accepts can be had; or a
                                    function of a problem, if only some do (as tools=True always)
    EXECUTES_TEXT = True            the reward hands the completion's text to code that may run it
                                    as Python (a library's scorer that eval()s an answer, sympy's
                                    parse_expr): the reward then runs in the sandbox, a child
                                    process a call, where text compiled during the call may only be
                                    literals, arithmetic and sympy's functions (sandbox.Scorer);
                                    `python task.py --audit` tells when a task needs it
    STOP = ["</answer>"]            strings that end a completion (kept in it) in training and eval
                                    alike: a base model stops at its answer, not max_completion_len
    answer(completion, problem)     the completion's final answer as a normalised string, or None:
                                    the eval's maj@n votes on it (quick: it runs in the trainer)
    environment(problem)            an environment the model acts in over several turns, its
                                    rewards the task's (reward() is then optional); environment.py
    TOOLS = [fn, ...]               functions the model calls through its chat template's tool
                                    calls, their results coming back as tool messages;
                                    environment.py

Instead of reward(), a task file may give TRL's reward functions, which then work unchanged:

    reward_funcs = [accuracy_reward, format_reward]  f(prompts, completions, **columns) -> a list
                                of floats or None, batched, as TRL's GRPOTrainer calls them
                                (call_reward_funcs says with what)
    reward_weights = [1.0, 0.2]  TRL's reward_weights, one per function (default 1 each)
    CORRECT = "accuracy_reward"  the function whose score is also "correct" (acc, pass@k: solved
                                at >= 1); default: the one named accuracy_reward, as TRL's own
                                (trl.rewards.accuracy_reward); "" = none

The reward is then TRL's: the weighted sum of the functions' scores (a list, numpy array or tensor),
a None, NaN or inf left out (TRL's nansum); each function is logged as reward/<its name>. A
completion every function leaves out is left out of its group's baseline with advantage 0, and of
the logged reward, as TRL's nanmean does, and counted in reward/unscored (tested against TRL's own
GRPOTrainer). correct_weight does not apply (the functions' weights do).

The reward runs in a forked child process with a deadline (reward_timeout): a reward that raises or
hangs scores 0 for that completion and is counted in reward/errors; the run goes on. Module state
the reward changes therefore does not persist from batch to batch. Every process a reward starts (a
daemon that double-forks too) is ended when its call ends, and the reward's process dies with the
trainer. reward_timeout=0 runs it in-process: no deadline, and what it starts is its own to end (a
helper process may live across batches).
"""

import asyncio
import dataclasses
import decimal
import functools
import importlib.util
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import sandbox
from config import Config, ConfigError, config_from_argv, load_saved
from data.files import is_data_path, load_rows
from environment import first_turn
from environment import python as run_code_tool
from rewards import extract_answer, score_batch

TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


@dataclass
class Task:
    """The functions and extras of one task file; `where` names the file in every message."""

    where: str
    problems: object  # problems(split, n, seed), or None when the problems come from data_path
    prompt: object  # prompt(problem)
    reward: object  # reward(completion, problem); None with reward_funcs
    completion_prefix: str = ""
    weights: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)
    check: object = None
    runs_code: object = False  # RUNS_CODE: True, False, or a function of a problem
    executes_text: bool = False  # EXECUTES_TEXT: the reward runs in the sandbox (sandbox.Scorer)
    reference: object = None  # reference(problem) -> a completion that earns full reward
    # TRL-style reward functions instead of reward(); their names are their components
    reward_funcs: list = field(default_factory=list)
    reward_names: list = field(default_factory=list)
    correct: str = ""  # CORRECT: the function whose score is also the component "correct"
    stop: list = field(default_factory=list)  # STOP: strings that end a completion, kept in it
    answer: object = None  # answer(completion, problem): the final answer maj@n votes on, or None
    # multi-turn episodes (environment.py): environment(problem), or TOOLS' plain functions
    environment: object = None
    tools: list = field(default_factory=list)

    @property
    def episodic(self):
        """Rollouts in turns with an environment, or TOOLS' calls (environment.EpisodeEngine)."""
        return self.environment is not None or bool(self.tools)

    def close(self):
        """End the sandboxed processes of EXECUTES_TEXT's rewards (they die with this one too)."""
        for f in [self.reward, *self.reward_funcs]:
            if isinstance(f, sandbox.Scorer):
                f.close()


def multi_turn(cfg, task):
    """A rollout has turns: tools=True's calls, or the task's environment or TOOLS."""
    return cfg.tools or task.episodic


def builtin_tasks():
    """Names of the task files in tasks/."""
    return sorted(f[:-3] for f in os.listdir(TASK_DIR) if f.endswith(".py"))


def task_file(cfg):
    """The file `cfg.task` names: a built-in name, a .py path, or
    (a data file as the task) tasks/dataset.py."""
    if cfg.task in builtin_tasks():
        return os.path.join(TASK_DIR, cfg.task + ".py")
    if cfg.task.endswith(".py"):
        if not os.path.isfile(cfg.task):
            raise ConfigError(f"task file {cfg.task} not found")
        return cfg.task
    if is_data_path(cfg.task):
        return os.path.join(TASK_DIR, "dataset.py")
    raise ConfigError(f"task={cfg.task!r}: choose a built-in task {builtin_tasks()}, a task file "
                      "(.py), or a data file (.jsonl, .parquet, .csv) or folder")


def import_file(path):
    """The module in the file at `path`
    (loaded by path: tasks/ is a folder of files, not a package)."""
    name = "task_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickling and dataclasses inside the file find it
    spec.loader.exec_module(module)
    return module


def load_task(cfg):
    """Import the task file, check it defines what the run needs,
    call its configure(cfg). Fails in pre-flight."""
    path = task_file(cfg)
    module = import_file(path)
    data_path = cfg.data_path or (cfg.task if is_data_path(cfg.task) else "")
    trl = hasattr(module, "reward_funcs")
    environment = getattr(module, "environment", None)
    if environment is not None and not (callable(environment) and binds(environment, 1)):
        raise ConfigError(f"task file {path}: environment must be a function environment(problem) "
                          "returning an object with reset() and step(action) (environment.py)")
    for name, signature in (("prompt", "prompt(problem)"),
                            ("reward", "reward(completion, problem)"),
                            ("problems", "problems(split, n, seed)")):
        if (name == "problems" and data_path) or (name == "reward" and (trl or environment)):
            continue  # the problems come from the dataset; the reward from reward_funcs, or the
            # environment's own
        if not callable(getattr(module, name, None)):
            hint = " (or set data_path to a dataset)" if name == "problems" else ""
            raise ConfigError(f"task file {path} defines no function {signature}{hint}")
        # such a function fails only when called: a reward on every completion, each then scoring 0
        if not binds(getattr(module, name), signature.count(",") + 1):
            raise ConfigError(f"task file {path}: {name}{inspect.signature(getattr(module, name))} "
                              f"cannot be called as {signature}")
    if hasattr(module, "configure"):
        module.configure(cfg)
    extras = {"completion_prefix": getattr(module, "COMPLETION_PREFIX", ""),
              "weights": getattr(module, "WEIGHTS", {}),
              "columns": getattr(module, "COLUMNS", {}), "check": getattr(module, "check", None),
              "runs_code": getattr(module, "RUNS_CODE", False),
              "reference": getattr(module, "reference", None)}
    if not isinstance(extras["completion_prefix"], str) or not isinstance(extras["weights"], dict):
        raise ConfigError(f"task file {path}: COMPLETION_PREFIX must be a string and WEIGHTS a "
                          "dict of floats")
    if not isinstance(extras["runs_code"], bool) and not callable(extras["runs_code"]):
        raise ConfigError(f"task file {path}: RUNS_CODE must be True, False or a function of a "
                          "problem")
    if extras["reference"] is not None and not callable(extras["reference"]):
        raise ConfigError(f"task file {path}: reference must be a function reference(problem)")
    extras["executes_text"] = getattr(module, "EXECUTES_TEXT", False)
    if not isinstance(extras["executes_text"], bool):
        raise ConfigError(f"task file {path}: EXECUTES_TEXT must be True or False")
    extras["stop"] = stop_strings(path, getattr(module, "STOP", []))
    extras["answer"] = getattr(module, "answer", None)
    answer = extras["answer"]
    if answer is not None and not (callable(answer) and binds(answer, 2)):
        raise ConfigError(f"task file {path}: answer must be a function answer(completion, "
                          "problem) returning the final answer as a string, or None")
    if trl:
        extras.update(reward_funcs_extras(module, path, cfg))
    extras["environment"], extras["tools"] = environment, getattr(module, "TOOLS", [])
    if not isinstance(extras["tools"], list) or not all(map(callable, extras["tools"])):
        raise ConfigError(f"task file {path}: TOOLS must be a list of functions")
    if environment and extras["tools"]:
        raise ConfigError(f"task file {path}: an environment and TOOLS both; give the tools as "
                          "the environment's own (its step() runs them)")
    if (environment or extras["tools"]) and cfg.tools:
        raise ConfigError(f"task file {path} has its own turns (environment or TOOLS); tools=True "
                          "adds the text protocol's: leave tools off")
    if run_code_tool in extras["tools"]:  # the model's code: the run needs the sandbox
        extras["runs_code"] = True
    reward = getattr(module, "reward", None)
    if extras["executes_text"]:  # each reward function called in the sandbox, by its name
        reward, extras = sandboxed_rewards(module, path, cfg, reward, extras)
    return Task(path, None if data_path else module.problems, module.prompt, reward, **extras)


def sandboxed_rewards(module, path, cfg, reward, extras):
    """EXECUTES_TEXT: reward() (or each of reward_funcs) as a sandbox.Scorer of the same name."""
    seconds = cfg.reward_timeout or Config.reward_timeout
    settings = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))

    def scorer(f):
        name = callable_name(f)
        if getattr(module, name, None) is not f:
            raise ConfigError(f"task file {path}: EXECUTES_TEXT runs each reward function in the "
                              f"sandbox by its name; {name} is not a function defined in the file")
        return sandbox.Scorer(path, module.__name__, name, seconds, settings)

    if extras.get("reward_funcs"):
        extras = {**extras, "reward_funcs": [scorer(f) for f in extras["reward_funcs"]]}
    return (scorer(reward) if reward is not None else None), extras


# the components score() adds or the shaping reads by name: no reward function may take them
RESERVED = ("correct", "format", "parsed", "errors", "timeouts", "unscored")


def reward_funcs_extras(module, path, cfg):
    """A task file's reward_funcs, reward_weights and CORRECT, checked: the Task's fields."""
    funcs, weights = module.reward_funcs, getattr(module, "reward_weights", None)
    if hasattr(module, "reward") or hasattr(module, "WEIGHTS"):
        raise ConfigError(f"task file {path}: reward_funcs replace reward() and WEIGHTS; keep "
                          "one way (weigh the functions with reward_weights)")
    if not isinstance(funcs, (list, tuple)) or not funcs or not all(map(callable, funcs)):
        raise ConfigError(f"task file {path}: reward_funcs must be a non-empty list of functions "
                          "f(prompts, completions, **columns) -> list of floats (TRL's)")
    names = [callable_name(f) for f in funcs]
    clash = sorted({n for n in names if n in RESERVED or names.count(n) > 1})
    if clash:
        raise ConfigError(f"task file {path}: reward function names {clash} are taken (by another "
                          f"function, or by {RESERVED}); each is logged as reward/<its name>: "
                          "rename them")
    weights = [1.0] * len(funcs) if weights is None else weights
    if (not isinstance(weights, (list, tuple)) or len(weights) != len(funcs)
            or not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights)):
        raise ConfigError(f"task file {path}: reward_weights must be {len(funcs)} numbers, one per "
                          f"reward function {names}, got {weights!r:.80}")
    correct = getattr(module, "CORRECT", "accuracy_reward" if "accuracy_reward" in names else "")
    if correct and correct not in names:
        raise ConfigError(f"task file {path}: CORRECT={correct!r} names none of the reward "
                          f"functions {names}")
    unknown = sorted(set(cfg.component_weights) - set(names))
    if unknown:
        raise ConfigError(f"reward_weights={cfg.reward_weights!r} names {unknown}, not reward "
                          f"functions of {path}: {names}")
    if cfg.correct_weight != Config.correct_weight:
        raise ConfigError(f"correct_weight={cfg.correct_weight}: {path}'s reward is its "
                          "reward_funcs' weighted sum; weigh the function itself, e.g. "
                          f"--reward_weights={correct or names[0]}:{cfg.correct_weight}")
    # "unscored" is logged, never rewarded: such a completion scores 0, as in TRL
    return {"reward_funcs": list(funcs), "reward_names": names, "correct": correct,
            "weights": {**dict(zip(names, map(float, weights))), "unscored": 0.0}}


def callable_name(f):
    """A reward function's name as TRL logs it: a partial's function's, or an object's class's."""
    while isinstance(f, functools.partial):
        f = f.func
    return getattr(f, "__name__", type(f).__name__)


def stop_strings(path, stop):
    """STOP as a list: a list (or tuple) of non-empty strings, else a ConfigError naming it."""
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"task file {path}: STOP = {stop!r:.80}; it must be a list of non-empty "
                          'strings, e.g. STOP = ["</answer>"]')
    return list(stop)


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


def binds(fn, count, **keywords):
    """False if fn cannot take `count` positional arguments and these keywords (True where its
    signature is hidden)."""
    try:
        inspect.signature(fn).bind(*range(count), **keywords)
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
    if (not isinstance(problems, list) or not problems
            or not all(isinstance(p, dict) for p in problems)):
        raise ConfigError(f"{task.where}: problems({split!r}, {n}, {cfg.data_seed}) must return a "
                          f"non-empty list of dicts, got {type(problems).__name__}")
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
    return render(tokenizer, task, task.prompt(problem), problem)


def render(tokenizer, task, p, problem=None):
    """prompt()'s value as text: chat messages through the chat template, a raw string as it is;
    then the COMPLETION_PREFIX (in a chat, the start of the assistant's turn). With an environment,
    the text its reset() returns ends the last user message (a raw prompt: the prompt); with TOOLS,
    the template lists them."""
    if task.environment is not None and problem is not None:
        try:
            added = task.environment(problem).reset()
        except Exception as e:
            raise ConfigError(f"{task.where}: environment(problem {problem.get('id')!r}).reset() "
                              f"raised {type(e).__name__}: {e}") from e
        if added is not None and not isinstance(added, str):
            raise ConfigError(f"{task.where}: the environment's reset() returned {added!r:.80}; "
                              "expected None or text to end the prompt with")
        if added and isinstance(p, str):
            p = p + added
        elif added:
            p = [*p[:-1], {**p[-1], "content": p[-1]["content"] + added}]
    if isinstance(p, str):
        return p + task.completion_prefix  # R1-Zero style: a base model, no template
    if not tokenizer.chat_template:
        raise ConfigError(f"{task.where}: prompt() returned chat messages but this tokenizer has "
                          "no chat template (a base model?); return a raw string instead")
    tools = {"tools": task.tools} if task.tools else {}
    if tools and (tokenizer.apply_chat_template(p, tokenize=False, **tools)
                  == tokenizer.apply_chat_template(p, tokenize=False)):
        raise ConfigError(f"{task.where}: this model's chat template does not render tools, so "
                          "TOOLS cannot reach the model; use tools=True's text protocol instead")
    if task.completion_prefix:  # the assistant's turn opened and begun, not closed
        opened = {"role": "assistant", "content": task.completion_prefix}
        return tokenizer.apply_chat_template([*p, opened], continue_final_message=True,
                                             tokenize=False, **tools)
    return tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **tools)


def tokenize_prompts(tokenizer, task, problems, max_prompt_len):
    """Prompt token ids; a prompt longer than max_prompt_len is an error, never cut."""
    # A token covers at most `longest` characters of the normalised text, and NFC or NFKC (Qwen's)
    # composes at most 4 characters into one: a longer text cannot fit, and is never tokenised whole
    longest = max(map(len, tokenizer.get_vocab()))
    out = []
    for problem in problems:
        p = task.prompt(problem)
        text = render(tokenizer, task, p, problem)
        if len(text) > 4 * (max_prompt_len + 1) * longest:
            raise ConfigError(f"prompt {problem['id']} has {len(text)} characters, more than "
                              f"max_prompt_len={max_prompt_len} tokens can hold; shorten it")
        # a chat template writes its own special tokens (BOS); a raw prompt gets the tokenizer's
        ids = tokenizer(text, add_special_tokens=isinstance(p, str)).input_ids
        if len(ids) > max_prompt_len:
            raise ConfigError(f"prompt {problem['id']} has {len(ids)} tokens > "
                              f"max_prompt_len={max_prompt_len}; raise it")
        out.append(ids)
    return out


def is_chat(p):
    """True for a non-empty list of {"role": ..., "content": str} messages."""
    return isinstance(p, list) and bool(p) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in p)


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


# ---------------------------------------------------------------- the reward under a deadline


def as_components(value):
    """A reward's return value as {name: float}:
    a float becomes {"score": float}. Raises TypeError otherwise."""
    if isinstance(value, (int, float)):
        value = {"score": value}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              for k, v in value.items()):
        raise TypeError(f"wrong type: returned {value!r:.80}; expected a float or a dict of named "
                        "floats")
    try:
        floats = {k: float(v) for k, v in value.items()}
    except OverflowError:  # an int past float's range, e.g. 10**400
        raise TypeError("wrong type: returned an integer too large for a float") from None
    if not all(math.isfinite(v) for v in floats.values()):
        raise TypeError(f"wrong type: returned a non-finite value {value!r:.80}")
    return floats


# after(): after each call, before its send
def _score_all(reward, jobs, send, check, after=lambda: None):
    """Call reward(*args) for each job (i, args) in order; send (i, check(value), "") or
    (i, "error" | "wrong type: ...", detail)."""
    for i, args in jobs:
        try:
            value = reward(*args)
        except BaseException:  # anything the reward does, sys.exit included, fails only this job
            after()
            send((i, "error", traceback.format_exc()))
            continue
        after()
        try:
            send((i, check(value), ""))
        except TypeError as e:
            send((i, str(e), ""))


def _child(reward, jobs, check, conn, parent):
    sandbox.die_with_parent(parent)  # kill -9 of the trainer ends this worker too
    sandbox.become_subreaper()  # what the reward starts stays below the worker, even a daemon
    _score_all(reward, jobs, conn.send, check, after=_end_leftovers)
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


def end_tree(root, with_root=False, spare=()):
    """SIGKILL every live process below `root` (and root itself if with_root), but the subtrees of
    `spare`. Each is stopped first, so none can fork or die (and so leave the tree) while the tree
    is read."""
    stopped = {root} if with_root else set()
    try:
        _signal(stopped, signal.SIGSTOP)
        while True:
            children, todo, below = _live_children(), [root], set()
            while todo:
                kids = [k for k in children.get(todo.pop(), []) if k not in spare]
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
    """After a reward call in a worker (a child subreaper): kill and reap all the reward left, but a
    Scorer's sandbox, which serves the worker's next call (sandbox.KEPT)."""
    deadline, ended = time.monotonic() + 5, False
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child, so nothing below: an orphan would have become this process's child
        if pid:
            continue  # reaped one
        if not set(_live_children().get(os.getpid(), [])) - sandbox.KEPT:
            return  # the Scorers alone remain
        if not ended:
            end_tree(os.getpid(), spare=sandbox.KEPT)
            ended = True
        else:
            time.sleep(0.001)


_REPORTED = set()  # the first failure of each kind is printed once per process, then only counted
FAILURES = {"error": "a reward raised (or its process died)",
            "timeout": "a reward ran past reward_timeout"}


def report(value, detail):
    """A failed reward's warning, once a process for each kind: value is run_rewards' string."""
    kind = value if value in FAILURES else "wrong type"
    if kind not in _REPORTED:
        _REPORTED.add(kind)
        print(f"warning: {FAILURES.get(kind, 'a reward returned the wrong type')}; the completion "
              f"scores 0 and is counted in reward/errors (printed once):\n{detail}",
              file=sys.stderr)


def run_rewards(reward, texts, problems, timeout, workers=1, quiet=False, failed=None):
    """reward(text, problem) for each completion: a components dict, or a string saying why it
    failed ("error", "timeout", "wrong type: ..."). With timeout > 0, `workers` forked children each
    score a share in order; one that sends nothing for `timeout` s is killed, its completion marked
    "timeout", and a fresh child goes on with the rest. A worker kills every process its reward
    leaves (after each call), and is killed with them on a timeout. timeout = 0: in this process, no
    deadline, none killed. Each failure is reported (once a process for each kind), or not (quiet),
    or given to failed(value, detail) with its traceback or reason."""
    jobs = [(i, (t, p)) for i, (t, p) in enumerate(zip(texts, problems))]
    failed = failed or (ignore if quiet else report)
    return _run_jobs(reward, jobs, as_components, timeout, workers, failed)


def ignore(*args):
    pass


def _run_jobs(reward, jobs, check, timeout, workers, failed, size=lambda args: 1):
    """run_rewards for any jobs (i, args), i = 0, 1, ...: reward(*args) then check(value), or why
    it failed. A job has timeout * size(args) seconds."""
    results, workers = [None] * len(jobs), max(1, workers)

    def record(message):
        i, value, detail = message
        results[i] = value
        if isinstance(value, str):
            failed(value, detail or value)

    if not timeout:
        _score_all(reward, jobs, record, check)
        return results
    # the child inherits the task module: any function works
    ctx = multiprocessing.get_context("fork")

    def start(share):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(reward, share, check, child, os.getpid()),
                           daemon=True)
        proc.start()
        child.close()
        return parent, [proc, share, time.monotonic() + timeout * size(share[0][1])]

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
                    message, dead = (share[0][0], "error",
                                     f"its process died (exit code {proc.exitcode})"), True
            elif time.monotonic() >= deadline:
                end_tree(proc.pid, with_root=True)  # the worker and all its reward started
                message, dead = (share[0][0], "timeout",
                                 f"no result within reward_timeout={timeout} s"), True
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
                running[conn] = [proc, rest, time.monotonic() + timeout * size(rest[0][1])]
            else:
                proc.join()
    return results


# ---------------------------------------------------------------- TRL-style reward functions

# TRL passes the prompt and the completion by their own names; a column of such a name would clash
NOT_COLUMNS = {"prompt", "completion", "completion_ids", "prompts", "completions"}


def run_reward_funcs(task, texts, problems, timeout, workers=1, completion_ids=None, quiet=False,
                     failed=None):
    """TRL's reward functions on N completions, as run_rewards runs reward(): per completion
    {function name: score} (a None left out, "correct" and "unscored" added; reward_rows), or a
    string saying why it failed. Each function is called once per share of the batch: the whole
    batch, or with workers > 1 that many contiguous shares scored at once (as under TRL on several
    GPUs, a function sees only a share). A function that raises, hangs or returns the wrong type
    fails its share: each completion of it scores 0 and is counted in reward/errors. A share of n
    completions has n * timeout seconds, the deadline reward() would have on them."""
    if not texts:
        return []
    n, workers = len(texts), max(1, min(workers, len(texts)))
    ids = completion_ids or [None] * n  # None where the text was not sampled (the audit, replay)
    shares = [range(w * n // workers, (w + 1) * n // workers) for w in range(workers)]
    jobs = [(k, ([texts[i] for i in r], [problems[i] for i in r], [ids[i] for i in r]))
            for k, r in enumerate(shares)]
    done = _run_jobs(functools.partial(call_reward_funcs, task), jobs,
                     functools.partial(reward_rows, task), timeout, workers,
                     failed or (ignore if quiet else report),
                     size=lambda args: len(args[0]))
    # a failed share: its reason for each of its completions
    results = [row for r, out in zip(shares, done)
               for row in (out if isinstance(out, list) else [out] * len(r))]
    unscored = [i for i, row in enumerate(results) if isinstance(row, dict) and row["unscored"]]
    if unscored and not quiet and "unscored" not in _REPORTED:  # TRL warns too
        _REPORTED.add("unscored")
        print(f"warning: every reward function returned None for a completion; it scores 0 and is "
              "counted in reward/unscored (printed once):\n"
              f"problem {problems[unscored[0]]!r:.300}\ncompletion {texts[unscored[0]]!r:.300}",
              file=sys.stderr)
    return results


def call_reward_funcs(task, texts, problems, ids):
    """TRL's call: each reward function once on these completions, with prompts (prompt()'s
    values), completions, completion_ids and a keyword per problem key, TRL's dataset columns
    ("id" too; not TRL's trainer_state, log_extra, log_metric). Returns (n, {name: its list})."""
    prompts = [task.prompt(p) for p in problems]
    # a chat prompt's completion is the assistant's message, as TRL passes it
    completions = [[{"role": "assistant", "content": t}] if is_chat(p) else t
                   for t, p in zip(texts, prompts)]
    keys = sorted({k for p in problems for k in p} - NOT_COLUMNS)
    columns = {k: [p.get(k) for p in problems] for k in keys}
    out = {}
    for name, f in zip(task.reward_names, task.reward_funcs):
        out[name] = f(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        if inspect.iscoroutine(out[name]):  # an async function, as TRL allows (e.g. an LLM judge)
            out[name] = asyncio.run(out[name])
    return len(texts), out


def reward_rows(task, called):
    """(n, {name: n scores}) -> n components dicts, as TRL treats the scores: a list, tuple, numpy
    array or tensor of n numbers (numpy and torch scalars too) or None; a None, NaN or inf is left
    out (TRL turns None into NaN and its nansum leaves NaN out: one NaN does not fail the batch).
    "correct" = the CORRECT function's score; "unscored" 1.0 where every function left the
    completion out: score_batch gives it reward NaN, so its group's baseline leaves it out and its
    advantage is 0 (group_advantages), as in TRL."""
    n, values = called
    rows = [{} for _ in range(n)]
    for name, scores in values.items():
        if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__") \
                or len(scores) != n:
            raise TypeError(f"wrong type: reward function {name} returned {scores!r:.80}; "
                            f"expected a list of {n} floats (or None), one per completion")
        for row, value in zip(rows, scores):
            score = as_score(value)
            if score is False:
                raise TypeError(f"wrong type: reward function {name} returned {value!r:.80}; "
                                "expected a float or None")
            if score is not None:
                row[name] = score
    for row in rows:
        row["unscored"] = float(not row)
        if task.correct in row:
            row["correct"] = row[task.correct]
    return rows


def as_score(value):
    """A reward function's score as a float; None for None, NaN or inf (left out, as TRL's nansum
    leaves them); False for what is no number (a string, a list, a tensor of several values)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return False
    try:
        score = float(value)  # a numpy or torch scalar, a 1-element tensor
    except OverflowError:  # an int past float's range
        return None
    except (TypeError, ValueError, RuntimeError):
        return False
    return score if math.isfinite(score) else None


# ---------------------------------------------------------------- scoring


def task_rewards(task, texts, problems, timeout, workers=1, completion_ids=None, quiet=False,
                 failed=None):
    """The task's components for each completion (or why it failed): reward() or reward_funcs."""
    if task.executes_text:  # each call in a sandboxed process of its own, under its deadline
        timeout, workers = 0, 1
    if task.reward_funcs:
        return run_reward_funcs(task, texts, problems, timeout, workers, completion_ids, quiet,
                                failed)
    if task.reward is None:  # an environment's rewards alone (score adds them)
        return [{} for _ in texts]
    return run_rewards(task.reward, texts, problems, timeout, workers, quiet, failed)


def reward_shaping(task, cfg):
    """score_batch's weights and shaping (W2, W3) for this task."""
    weights = {**task.weights, **cfg.component_weights}
    if task.reward_funcs:  # "correct" only copies the CORRECT function's score, already weighed
        return weights, {**cfg.shaping, "correct_weight": 0.0}
    return weights, cfg.shaping


def score(task, texts, problems, lengths, cfg, completion_ids=None, env_rewards=None):
    """Rewards (N,) and components {name: (N,)} of N completions: the task's reward, then the
    shaping (W2, W3). completion_ids: their sampled token ids, for TRL's reward functions.
    env_rewards: each episode's rewards from its environment (Completion.env_rewards), added to the
    reward's components; a failed episode (a string saying why) scores 0 as a failed reward does."""
    # the reward sees the answer as the model's whole turn
    seen = [task.completion_prefix + t for t in texts]
    results = task_rewards(task, seen, problems, cfg.reward_timeout, cfg.reward_workers,
                           completion_ids)
    for i, env in enumerate(env_rewards or []):
        if isinstance(env, str):  # the episode failed
            results[i] = env
        elif env and not isinstance(results[i], str):  # the environment's names win a clash
            results[i] = {**results[i], **env}
    weights, shape = reward_shaping(task, cfg)
    return score_batch(results, lengths, weights, **shape)


# ---------------------------------------------------------------- offline replay (W5)


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
    """python task.py --audit TASK [--config RUN] [--key=value ...]: the task's reward against
    adversarial completions (audit_cases) and a fuzz of its reference(problem), on the first
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
    model's first turn, in a fresh environment of each problem, under env_timeout. A failure: a
    call that raises, hangs or returns the wrong shape, or a turn that scores "correct"."""
    failures, calls = 0, 0
    for problem in problems:
        prompt = task.prompt(problem)
        prompt = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        for name, text in audit_cases(prompt, None, None).items():
            rewards = first_turn(task.environment, problem, text, cfg.env_timeout)
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replay":
        sys.exit(1 if replay(sys.argv[2]) else 0)
    if len(sys.argv) >= 3 and sys.argv[1] == "--audit":
        try:
            sys.exit(1 if audit(sys.argv[2], sys.argv[3:]) else 0)
        except ConfigError as e:
            sys.exit(f"error: {e}")
    sys.exit("usage: python task.py --replay out/run/samples.jsonl\n"
             "       python task.py --audit TASK [--config RUN] [--key=value ...]")
