"""Multi-turn episodes: an environment answers each model turn, or the model's chat-template tool
calls run. Either one comes from the task file:

    def environment(problem):      a fresh environment for each row (each of the G completions)
        return Game(problem)       with
            reset() -> None, or text the prompt's last user message ends with (TRL's
                       environment_factory does the same); the text is rendered once per problem,
                       so it must depend on the problem alone: it is the prompt of all G rows
            step(action) -> (observation, reward, done)
                       action: the model's turn as text; observation: text (the next user
                       message), a list of chat messages, or None; reward: a float (the component
                       "env") or a dict of named floats, as reward() returns ("correct" makes
                       the accuracy); done: the episode is over

    TOOLS = [get_weather, python]  plain functions, their docstrings the schema (as TRL's
                                   tools=[fn]): the chat template lists them in the prompt, the
                                   model calls them in its template's format (Qwen2.5/Hermes:
                                   <tool_call>{"name": ..., "arguments": {...}}</tool_call>), each
                                   result comes back as a "tool" message; a turn without a call
                                   ends the episode, and reward() judges the whole completion.
                                   environment.python runs code in the sandbox; the others run in
                                   this process, under tool_timeout

    python grpo.py --task=guess             # tasks/guess.py: a number to find, told higher/lower
    python grpo.py --task=calculator        # tasks/calculator.py: a calculator to write to

The rollout alternates model turns and environment turns, up to max_turns model turns and
max_completion_len tokens in all. Everything the environment (or a tool) writes is context: its
tokens have mask 0 (no gradient, no KL, no place in the token-mean), exactly as tools=True's output.
Its tokens are the chat template's own, found as TRL finds them: a dummy exchange rendered with and
without the messages, the difference taken from the end of the dummy assistant turn. The episode's
rewards are summed over its turns (env_reward="sum") or the last one counts ("last"), and added to
reward()'s components where the task defines reward() too. An environment that raises, returns the
wrong type or runs past tool_timeout seconds on one call ends its episode: the completion scores 0
and is counted in reward/errors, as a failed reward is; the run goes on.
"""

import json
import math
import re
import sys
import time
import traceback

import parallel
from rollout import Completion
from sandbox import run_python
from scoring import OutOfTime, within
from tools import turn_seed


class EpisodeEngine:
    """Wraps an engine (rollout.py): generate() runs one episode per row, in turns. Each turn
    generates every live row in one batched call; the rows' contexts are their exact token ids so
    far (never re-tokenised from text), and vLLM's prefix cache keeps the turns before."""

    def __init__(self, engine, tokenizer, max_turns, timeout, combine="sum"):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_turns, self.timeout, self.combine = max_turns, timeout, combine

    def wake(self, named_tensors):
        self.engine.wake(named_tensors)

    def sleep(self):
        self.engine.sleep()

    def generate(self, prompts, n, *, seeds, max_tokens, task=None, problems=None, stop=None,
                 progress=False, **sampling):
        """n episodes per prompt, as the engines' generate (seeds: one per row); task: the one the
        prompts are of; problems: one per prompt, each row's environment made from its own. A task
        without an environment or TOOLS (an eval set's) gets one turn, the engine's own."""
        if task is None or not task.episodic:
            return self.engine.generate(prompts, n, seeds=seeds, max_tokens=max_tokens, stop=stop,
                                        progress=progress, **sampling)
        make_env = task.environment or (lambda problem: ToolCalls(task.tools))
        rows = [Completion(list(p), [], "", [], False, mask=[], env_rewards={})
                for p in prompts for _ in range(n)]
        chat = [not isinstance(task.prompt(p), str) for p in problems]  # else a raw prompt
        envs = [start(rows[r], make_env, problems[r // n], self.timeout) for r in range(len(rows))]
        live = [r for r in range(len(rows)) if alive(rows[r])]
        for turn in range(self.max_turns):
            # every rank decides alike: FSDP's HF engine generates in lockstep
            if parallel.all_max(len(live)) == 0:
                break
            outs = self.engine.generate(
                [rows[r].prompt_ids + rows[r].completion_ids for r in live], 1,
                seeds=[turn_seed(seeds[r], turn) for r in live],  # each turn its own draw
                max_tokens=[max_tokens - len(rows[r].completion_ids) for r in live],
                stop=stop, progress=progress, **sampling)
            going = []
            for r, [out] in zip(live, outs):
                row = rows[r]
                append(row, out.completion_ids, out.logprobs, model=True)
                row.truncated = out.truncated
                action = self.tokenizer.decode(out.completion_ids, skip_special_tokens=True)
                observation, done = step(row, envs[r], action, self.timeout, self.combine)
                if done or row.truncated or turn == self.max_turns - 1:
                    continue
                try:  # the observation as tokens: text, or messages the template renders
                    ids = self.observation_ids(observation, out.completion_ids, chat[r // n])
                except Exception:
                    fail(row, "wrong type", "the observation could not be rendered:\n"
                         + traceback.format_exc())
                    continue
                room = max_tokens - len(row.completion_ids)
                if len(ids) >= room:  # no room for the model to answer it: the episode is cut here
                    row.truncated = True
                    continue
                append(row, ids, [0.0] * len(ids) if sampling["temperature"] > 0 else [],
                       model=False)
                row.tool_calls += 1
                going.append(r)
            live = going
        for row, env in zip(rows, envs):
            row.tool_errors += getattr(env, "errors", 0)  # ToolCalls: the tools that failed
            row.text = self.tokenizer.decode(row.completion_ids, skip_special_tokens=True)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def observation_ids(self, observation, sampled, chat):
        """The tokens after the model's turn: the observation, then the assistant's next turn
        opened. A chat: the template's own tokens (chat_suffix); a raw prompt: the text as it is."""
        if not chat:
            if not isinstance(observation, str):
                raise TypeError("a raw prompt's episode takes text observations, not messages")
            return self.tokenizer.encode(observation, add_special_tokens=False)
        messages = ([{"role": "user", "content": observation}] if isinstance(observation, str)
                    else observation or [])
        ids = chat_suffix(self.tokenizer, messages)
        eos = self.tokenizer.eos_token_id
        # a turn that ended on a stop string, not the end-of-turn token, is closed first
        return ids if sampled and sampled[-1] == eos else [eos, *ids]


REPORTED = set()  # the kinds of environment failure printed so far in this process
COUNTED = {"errors", "timeouts", "unscored"}  # score_batch's own components: no reward's names


def start(row, make_env, problem, timeout):
    """The row's environment, made and reset under the deadline (None if either failed)."""
    env = call(row, timeout, make_env, problem)
    if alive(row):
        call(row, timeout, env.reset)  # its text is in the prompt already (task.render)
    return env


def step(row, env, action, timeout, combine):
    """env.step(action) under the deadline, its reward recorded in row.env_rewards (summed, or
    the last turn's): (observation, done)."""
    out = call(row, timeout, env.step, action)
    if not alive(row):  # failed: the episode ends here
        return None, True
    try:
        observation, reward, done = out
        reward = {"env": reward} if not isinstance(reward, dict) else reward
        reward = {str(k): float(v) for k, v in reward.items()}
        if not all(map(math.isfinite, reward.values())):
            raise ValueError(f"a reward is not finite: {reward}")
        if set(reward) & COUNTED:
            raise ValueError(f"{sorted(set(reward) & COUNTED)} are counts the run keeps")
        if not (observation is None or isinstance(observation, str)
                or is_messages(observation)):
            raise TypeError("the observation is not text, chat messages or None")
    except (TypeError, ValueError) as e:
        fail(row, "wrong type", f"step() must return (observation, reward, done), reward a "
             f"float or a dict of floats; it returned {out!r:.200}: {e}")
        return None, True
    if combine == "sum":
        for k, v in reward.items():
            row.env_rewards[k] = row.env_rewards.get(k, 0.0) + v
    else:  # "last": the turn's rewards replace those before
        row.env_rewards = reward
    return observation, bool(done) or observation is None


def first_turn(make_env, problem, action, timeout):
    """The rewards of one model turn `action` in a fresh environment of `problem`, or why it
    failed: what `python task.py --audit` tries its adversarial completions on."""
    row = Completion([], [], "", [], False, env_rewards={})
    env = start(row, make_env, problem, timeout)
    if alive(row):
        step(row, env, action, timeout, "sum")
    return row.env_rewards


def call(row, timeout, fn, *args):
    """fn(*args) within `timeout` seconds (tool_timeout); a failure ends the row's episode."""
    begun = time.perf_counter()
    try:
        return within(timeout, fn, *args)
    except OutOfTime:
        fail(row, "timeout", f"{getattr(fn, '__qualname__', fn)} ran past tool_timeout={timeout} s")
    except Exception:
        fail(row, "error", traceback.format_exc())
    finally:
        row.tool_seconds += time.perf_counter() - begun


def fail(row, kind, detail):
    """The episode ends; its completion will score 0, counted in reward/errors (score_batch reads
    the kind in env_rewards' place). The first failure of each kind is printed."""
    row.env_rewards = kind
    row.tool_errors += 1
    if kind not in REPORTED:
        REPORTED.add(kind)
        print(f"warning: an environment call failed ({kind}); its completion scores 0 and is "
              f"counted in reward/errors (printed once):\n{detail}", file=sys.stderr)


def alive(row):
    """The row's environment has not failed: its rewards are still a dict."""
    return isinstance(row.env_rewards, dict)


def append(row, ids, logprobs, model):
    row.completion_ids += ids
    row.logprobs += logprobs
    row.mask += [int(model)] * len(ids)


def is_messages(value):
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)


def chat_suffix(tokenizer, messages):
    """Token ids of `messages` in the chat template, from the end of an assistant turn (its EOS) to
    the next assistant turn opened, as TRL's GRPOTrainer finds a tool result's tokens: a dummy
    exchange rendered without and with them. A tool message needs an assistant turn that called it
    (some templates name the tool from the call)."""
    names = [m.get("name", "tool") for m in messages if m["role"] == "tool"]
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name in names]
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", **({"tool_calls": calls} if calls else {})}]
    prefix = encode_chat(tokenizer, dummy, add_generation_prompt=False)
    full = encode_chat(tokenizer, dummy + messages, add_generation_prompt=True)
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:  # "...<|im_end|>\n": the turn ends at the EOS the model samples, not after it
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("this chat template renders the conversation before an observation "
                         "differently once the observation follows; its tokens cannot be found")
    return full[len(prefix) :]


def encode_chat(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids


# ---------------------------------------------------------------- chat-template tool calls

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # Qwen2.5, Hermes, and others


def parse_tool_calls(text):
    """The model's calls in a turn: [(name, arguments dict)] from Hermes-style <tool_call> JSON;
    a call that does not parse is (None, why)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append((name, arguments))
        except (ValueError, KeyError, TypeError) as e:
            calls.append((None, f"the call {body[:200]!r} is not JSON with a name and "
                                f"arguments: {e}"))
    return calls


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: the program; print what you want to see
    """
    # in the sandbox (sandbox.py), never in this process; its deadline inside tool_timeout's default
    output, ok = run_python(code, timeout=3.0, max_output=500)
    if not ok:  # raised, killed, or no sandbox here: the model reads why, the call counts as failed
        raise RuntimeError(output)
    return output


class ToolCalls:
    """TOOLS as an environment: the turn's calls run (in this process, under tool_timeout for the
    whole turn; python() in the sandbox), each result a tool message; a turn without a call ends the
    episode. A call that fails (an unknown name, bad arguments, the tool raised) gets its error as
    its result, and is counted in tools/error_rate; the episode goes on."""

    def __init__(self, tools):
        self.tools = {f.__name__: f for f in tools}
        self.errors = 0

    def reset(self):
        return None

    def step(self, action):
        calls = parse_tool_calls(action)
        if not calls:  # rewards: none of its own ({}), reward() judges the whole completion
            return None, {}, True
        results = []
        for name, arguments in calls:
            try:
                if name is None:
                    raise ValueError(arguments)
                if name not in self.tools:
                    raise ValueError(f"no tool {name!r}; the tools are {sorted(self.tools)}")
                result = str(self.tools[name](**arguments))
            except Exception as e:
                self.errors += 1
                result = json.dumps({"error": f"{type(e).__name__}: {e}"})
            results.append({"role": "tool", "name": name or "unknown", "content": result})
        return results, {}, False

