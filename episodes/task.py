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

    reference(problem)       -> a completion that earns full reward (the audit's)
    COMPLETION_PREFIX = "<think>"   the answer's first words, written by the prompt, not sampled;
                                    the reward sees them in front of the completion (R1-Zero's
                                    template ends with it)
    WEIGHTS = {"numbers_valid": 0}  weights of its components (default: correct 1, format 0.1,
                                    any other 1; reward_weights overrides)
    COLUMNS = {"question": "prompt"}  dataset columns to rename before a row becomes a problem
    check(problem)                  raise ValueError saying what a dataset row lacks (named with
                                    its line)
    configure(cfg)                  called once with the run's Config before anything else
    OPTIONS = {"countdown_numbers": (3, 4)}   the task's own settings and their defaults
                                    (literals, read from the file's text), set by name as any other
                                    (--countdown_numbers=4, or in a run file); configure reads
                                    cfg.task_options. A file that borrows another's configure
                                    declares the options a run may set through it
    RUNS_CODE = True                the reward runs the model's code (in scoring/): the run starts
                                    only where the sandbox that `sandbox` accepts can be had; or a
                                    function of a problem, if only some do (as tools=True always)
    EXECUTES_TEXT = True            the reward hands the completion's text to code that may run it
                                    as Python (a library's scorer that eval()s an answer, sympy's
                                    parse_expr): the reward then runs in the sandbox, a child
                                    process a call, where text compiled during the call may only be
                                    literals, arithmetic and sympy's functions (execute.Scorer);
                                    `python -m episodes.task --audit` tells when a task needs it
    STOP = ["</answer>"]            strings that end a completion (kept in it) in training and eval
                                    alike: a base model stops at its answer, not max_completion_len
    answer(completion, problem)     the completion's final answer as a normalised string, or None:
                                    the eval's maj@n votes on it (quick: it runs in the trainer)
    environment(problem)            an environment the model acts in over several turns, its
                                    rewards the task's (reward() is then optional); turns.py
    TOOLS = [fn, ...]               functions the model calls through its chat template's tool
                                    calls, their results coming back as tool messages;
                                    turns.py
    environment_factory = MyEnv     a TRL environment class, as GRPOTrainer takes it: an instance
                                    per rollout, reset(**problem), its methods the tools,
                                    get_reward() a component named after it (tools.TRLEnvironments)

Instead of reward(), a task file may give TRL's reward functions, which then work unchanged:

    reward_funcs = [accuracy_reward, format_reward]  f(prompts, completions, **columns) -> a list
                                of floats or None, batched, as TRL's GRPOTrainer calls them
                                (scoring.call_reward_funcs says with what)
    reward_weights = [1.0, 0.2]  TRL's reward_weights, one per function (default 1 each)
    CORRECT = "accuracy_reward"  the function whose score is also "correct" (acc, pass@k: solved
                                at >= 1); default: the one named accuracy_reward, as TRL's own
                                (trl.rewards.accuracy_reward); "" = none

The reward is then TRL's: the weighted sum of the functions' scores (a list, numpy array or tensor),
a None, NaN or inf left out (TRL's nansum); each function is logged as reward/<its name>. A
completion every function leaves out is left out of its group's baseline with advantage 0, and of
the logged reward, as TRL's nanmean does, and counted in reward/unscored (tested against TRL's own
GRPOTrainer). "correct" weighs nothing there (the functions' weights do).

The reward runs in a forked child process under a deadline (reward_timeout; scoring/runner.py, one
call from score()): a reward that raises or hangs scores 0 and is counted in reward/errors.
`python -m episodes.task --audit TASK` tries a task's reward on completions that should not pay
before a run
trusts it; `--replay` re-scores a run's samples (run/audit.py).
"""

import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from config import Config, ConfigError, builtin_tasks, task_parts, task_path
from data.files import is_data_path, load_rows
from episodes.tools import TRLEnvironments
from episodes.tools import python as run_code_tool
from rewards import reward_terms, score_batch
from scoring import execute
from scoring.runner import task_rewards


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
    executes_text: bool = False  # EXECUTES_TEXT: the reward runs in the sandbox (execute.Scorer)
    reference: object = None  # reference(problem) -> a completion that earns full reward
    # TRL-style reward functions instead of reward(); their names are their components
    reward_funcs: list = field(default_factory=list)
    reward_names: list = field(default_factory=list)
    correct: str = ""  # CORRECT: the function whose score is also the component "correct"
    stop: list = field(default_factory=list)  # STOP: strings that end a completion, kept in it
    answer: object = None  # answer(completion, problem): the final answer maj@n votes on, or None
    # multi-turn episodes (turns.py): environment(problem), or TOOLS' plain functions
    environment: object = None
    tools: list = field(default_factory=list)

    @property
    def episodic(self):
        """Rollouts in turns with an environment, or TOOLS' calls (environment.EpisodeEngine)."""
        return self.environment is not None or bool(self.tools)

    def close(self):
        """End the sandboxed processes of EXECUTES_TEXT's rewards (they die with this one too)."""
        for f in [self.reward, *self.reward_funcs]:
            if isinstance(f, execute.Scorer):
                f.close()


def multi_turn(cfg, task):
    """A rollout has turns: tools=True's calls, or the task's environment or TOOLS."""
    return cfg.tools or task.episodic


def task_file(cfg):
    """The file `cfg.task` names (config.task_path): a built-in name, a .py path, or (a data file
    as the task) tasks/dataset.py."""
    if not (cfg.task in builtin_tasks() or cfg.task.endswith(".py") or is_data_path(cfg.task)):
        raise ConfigError(f"task={cfg.task!r}: choose a built-in task {builtin_tasks()}, a task "
                          "file (.py), or a data file (.jsonl, .parquet, .csv) or folder")
    if not os.path.isfile(task_path(cfg.task)):
        raise ConfigError(f"task file {cfg.task} not found")
    return task_path(cfg.task)


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
    """Import the task file, check what the run needs, call its configure(cfg); D4: each task's"""
    if ":" in cfg.task:
        return load_mixture(cfg)
    path = task_file(cfg)
    module = import_file(path)
    data_path = cfg.data_path or (cfg.task if is_data_path(cfg.task) else "")
    # its OPTIONS' defaults where cfg was not made by load_config (which sets them all)
    cfg.task_options = {**getattr(module, "OPTIONS", {}), **cfg.task_options}
    if hasattr(module, "configure"):  # first: it may make the environment (tasks/openenv.py)
        module.configure(cfg)
    trl = hasattr(module, "reward_funcs")
    environment = getattr(module, "environment", None)
    factory = getattr(module, "environment_factory", None)  # a TRL environment class
    if factory is not None:
        if environment is not None or not callable(factory):
            raise ConfigError(f"task file {path}: environment_factory must be a class (or a "
                              "function of no argument making an instance), without environment")
        environment = TRLEnvironments(factory, f"task file {path}", cfg.env_reward == "sum",
                                      getattr(module, "prompt", None))
        if not (environment.rewarded or trl or hasattr(module, "reward")):
            raise ConfigError(f"task file {path}: no reward: give {environment.name} a "
                              "get_reward(), or the file reward() or reward_funcs")
    if environment is not None and not (callable(environment) and binds(environment, 1)):
        raise ConfigError(f"task file {path}: environment must be a function environment(problem) "
                          "returning an object with reset() and step(action) (turns.py)")
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
    if factory is not None:  # its methods are the tools, rendered as TOOLS' are
        extras["tools"] = environment.tools
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
    """EXECUTES_TEXT: reward() (or each of reward_funcs) as a execute.Scorer of the same name."""
    seconds = cfg.reward_timeout or Config.reward_timeout
    settings = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))

    def scorer(f):
        name = callable_name(f)
        if getattr(module, name, None) is not f:
            raise ConfigError(f"task file {path}: EXECUTES_TEXT runs each reward function in the "
                              f"sandbox by its name; {name} is not a function defined in the file")
        return execute.Scorer(path, module.__name__, name, seconds, settings)

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
        hint = (f"; correct is {correct}'s score, weigh that function" if "correct" in unknown
                and correct else "")
        raise ConfigError(f"reward_weights={cfg.reward_weights!r} names {unknown}, not reward "
                          f"functions of {path}: {names}{hint}")
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
    if isinstance(task, Mixture):  # D4: each task's problems, one task's after another's
        return task.own([load_problems(part.cfg, part.task, split) for part in task.parts])
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
            env = task.environment(problem)
            added = env.reset()
            getattr(env, "close", lambda: None)()  # an OpenEnv session is freed at once
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
                          "TOOLS cannot reach the model; give it one that does (ChatML models: "
                          "--chat_template=config/tools_chatml.jinja), or use tools=True's text "
                          "protocol instead")
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
        own = task_of(task, problem)  # a mixture's (D4): the problem's own task
        p = own.prompt(problem)
        text = render(tokenizer, own, p, problem)
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


# ------------------------------------------------------------ the reward and its shaping (W1-W3)


def reward_shaping(task, cfg):
    """score_batch's weights and shaping (W2, W3) for this task."""
    weights = {**task.weights, **cfg.component_weights}
    if task.reward_funcs:  # "correct" only copies the CORRECT function's score, already weighed
        weights["correct"] = 0.0
    return weights, cfg.shaping


def score(task, texts, problems, lengths, cfg, completion_ids=None, env_rewards=None):
    """Rewards (N,) and components {name: (N,)} of N completions: the task's reward, then the
    shaping (W2, W3). completion_ids: their sampled token ids, for TRL's reward functions.
    env_rewards: each episode's rewards from its environment (Completion.env_rewards), added to the
    reward's components; a failed episode (a string saying why) scores 0 as a failed reward does."""
    if isinstance(task, Mixture):  # D4: each task's completions by its own reward
        return score_parts(task, texts, problems, lengths, cfg, completion_ids, env_rewards)
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


def split_reward(task, cfg, rewards, components):
    """rewards.reward_terms with this run's weights: the terms that per-component advantages (A6,
    GDPO) normalise one by one; (terms (N, K), weights (K,))."""
    weights, _ = reward_shaping(task, cfg)
    terms, w, _ = reward_terms(rewards, components,
                               {**weights, "length_reward": cfg.length_reward})
    return terms, w


# ---------------------------------------------------------------- a task mixture (D4)


@dataclass
class Part:
    """One task of a mixture: its name (as eval_tasks names a set), weight, Task, and the run's
    settings with it as their task (what load_problems reads)."""

    name: str
    weight: float
    task: Task
    cfg: object


@dataclass
class Mixture:
    """D4: tasks trained together, `task=math:0.7,countdown:0.3` (as nanochat's TaskMixture, with
    weights: data.sampler.MixtureSampler). Each keeps its own prompt, reward, STOP and options.
    The problems stay as their tasks make them (a task may read its ids); the mixture knows whose
    each problem object is (own), and takes it to its task wherever the run meets it: the prompts
    (tokenize_prompts), the sampling (generate, a call per task), the reward (score), the evals
    (run.evals: per task, then overall)."""

    where: str
    parts: list
    owners: dict = field(default_factory=dict)  # id(problem) -> (its part, the problem)

    def own(self, problems):
        """Each part's problems, [[problem]] in the parts' order, as one list; each known as its
        part's."""
        for part, theirs in zip(self.parts, problems):
            self.owners.update({id(p): (part, p) for p in theirs})  # the problem kept: its id too
        return [p for theirs in problems for p in theirs]

    def part_of(self, problem):
        found = self.owners.get(id(problem))
        if found is None or found[1] is not problem:
            raise KeyError(f"{self.where}: problem {problem.get('id')!r} is no task's: a mixture "
                           "takes only the problem objects its load_problems made")
        return found[0]

    def prompt(self, problem):
        return self.part_of(problem).task.prompt(problem)

    @property
    def episodic(self):
        return any(part.task.episodic for part in self.parts)

    def close(self):
        for part in self.parts:
            part.task.close()


def load_mixture(cfg):
    """D4: every task of `cfg.task`, each loaded as a run of it alone would load it (its OPTIONS
    too); one that fails says which it is."""
    parts = []
    for spec, weight in task_parts(cfg.task).items():
        name = os.path.splitext(os.path.basename(spec.rstrip("/")))[0]
        if name in [part.name for part in parts]:
            raise ConfigError(f"task={cfg.task!r}: two tasks named {name!r} (a task is named by "
                              "its file or task); rename one of the files")
        own = copy.copy(cfg)
        own.task = spec
        try:
            parts.append(Part(name, weight, load_task(own), own))
        except ValueError as e:  # a ConfigError, or a malformed row
            raise ConfigError(f"task mixture {cfg.task!r}: its task {spec}: {e}") from None
    return Mixture(f"task mixture {cfg.task}", parts)


def task_of(task, problem):
    """The task a problem is of: the task; in a mixture (D4), the problem's own."""
    return task.part_of(problem).task if isinstance(task, Mixture) else task


def by_task(task, problems):
    """[(task, positions)]: the positions in `problems` of each task; one task's are all. A
    mixture's (D4) every task, in order, with no position where none of the problems is its."""
    if not isinstance(task, Mixture):
        return [(task, list(range(len(problems))))]
    names = [task.part_of(p).name for p in problems]
    return [(part.task, [i for i, n in enumerate(names) if n == part.name]) for part in task.parts]


def generate(engine, task, prompts, problems, n, seeds, **sampling):
    """engine.generate with the task's STOP strings (and its episodes: task, problems). A mixture
    (D4): each task's prompts in a call of their own, with its own; every task called on every
    rank, though it has no prompt there (FSDP's HF engine generates in lockstep)."""
    groups = [None] * len(prompts)
    for own, at in by_task(task, problems):
        out = engine.generate([prompts[i] for i in at], n,
                              seeds=[seeds[i * n + j] for i in at for j in range(n)],
                              stop=own.stop or None, task=own, problems=[problems[i] for i in at],
                              **sampling)
        for i, group in zip(at, out):
            groups[i] = group
    return groups


def score_parts(task, texts, problems, lengths, cfg, completion_ids=None, env_rewards=None):
    """score() of a mixture (D4): each task's completions by its own reward and weights; the
    components of all of them, 0 where a completion's task has none of that name (as
    rollout.Rollouts adds batches)."""
    rewards, parts = torch.zeros(len(texts)), []
    for own, at in by_task(task, problems):
        if at:
            def pick(xs, at=at):
                return None if xs is None else [xs[i] for i in at]

            r, comps = score(own, pick(texts), pick(problems), pick(lengths), cfg,
                             pick(completion_ids), pick(env_rewards))
            rewards[at] = r
            parts.append((at, comps))
    names = sorted({k for _, comps in parts for k in comps})
    components = {k: torch.zeros(len(texts)) for k in names}
    for at, comps in parts:
        for k, v in comps.items():
            components[k][at] = v
    return rewards, components


def mixture_metrics(train, drawn, group_size):
    """D4: task/<name>/reward, /acc (the mean "correct", as "acc") and /prompts over a step's
    drawn rollouts, each task of a mixture on its own; {} for one task."""
    if not isinstance(train.task, Mixture):
        return {}
    names = [train.task.part_of(train.problems[i]).name for i in drawn.problem]
    correct, out = drawn.components.get("correct"), {}
    for part in train.task.parts:
        rows = torch.tensor([n == part.name for n in names], dtype=torch.bool)
        rewards = drawn.rewards[rows]
        rewards = rewards[~rewards.isnan()]  # TRL's unscored completions left out, as in "reward"
        key = f"task/{part.name}/"
        out[key + "reward"] = rewards.mean().item() if len(rewards) else None
        out[key + "acc"] = correct[rows].mean().item() if correct is not None and len(
            rewards) else None
        out[key + "prompts"] = int(rows.sum()) // group_size
    return out


if __name__ == "__main__":
    # `python -m episodes.task --audit` and `--replay` are run/audit.py's commands, run as that
    # module: an import of run.audit here would be an edge run -> episodes -> run in the import
    # graph (tests/test_layout.py counts every import statement, a script block's too)
    import runpy

    runpy.run_module("run.audit", run_name="__main__", alter_sys=True)
