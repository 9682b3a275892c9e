"""Multi-turn episodes: one loop for every kind of turn. An environment answers each model turn;
the task file gives it, or the tool turns do (episodes/tools.py):

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
            close()    optional: called once the episode ends, to let go what it holds
                       (an OpenEnv server's session: episodes/openenv.py)

    TOOLS = [get_weather, python]  plain functions, their docstrings the schema (as TRL's
                                   tools=[fn]): tools.ToolCalls is their environment;
                                   episodes.tools.python runs code in the sandbox, the others run
                                   in this process, under tool_timeout
    tools=True                     Python in the completion's text: tools.TextTools, whose output
                                   goes on in the model's own turn (`inline`), not a chat turn

    python grpo.py --task=guess             # tasks/guess.py: a number to find, told higher/lower
    python grpo.py --task=calculator        # tasks/calculator.py: a calculator to write to

The rollout alternates model turns and environment turns, up to max_turns model turns
(tools=True: max_tool_calls + 1) and max_completion_len tokens in all. Everything the environment
(or a tool) writes is context: its tokens have mask 0 (no gradient, no KL, no place in the
token-mean). It is data: cut to tool_output_chars characters before it is tokenised, and tokenised
as plain text (a control token's spelling in it stays characters, never a forged turn). In a chat
it is framed as the chat template frames a message, found as TRL finds it: a dummy exchange
rendered with and without the messages, the difference taken from the end of the dummy assistant
turn. The episode's rewards are summed over its turns (env_reward="sum") or the last one counts
("last"), and added to reward()'s components where the task defines reward() too. An environment
that raises, returns the wrong type or runs past tool_timeout seconds on one call ends its episode:
the completion scores 0 and is counted in reward/errors, as a failed reward is; the run goes on.
"""

import math
import re
import sys
import time
import traceback

from episodes.tools import ToolCalls, plain_ids, tool_parser
from infra import parallel
from rollout import Completion, derive_seed
from scoring.execute import capped
from scoring.runner import OutOfTime, within


def turn_seed(seed, turn):
    """The seed of an episode's turn: the row's own seed on the first turn, then one per turn
    from it."""
    return seed if turn == 0 else derive_seed(seed, "turn", turn)


class EpisodeEngine:
    """Wraps an engine (rollout.py): generate() runs one episode per row, in turns. Each turn
    generates every live row in one batched call; the rows' contexts are their exact token ids so
    far (never re-tokenised from text), and vLLM's prefix cache keeps the turns before, so only
    what the environment wrote is prefilled anew.

    text_tools: tools=True's tools.TextTools, the turns of a task without turns of its own.
    output_chars: tool_output_chars, the most characters of any one result the model reads."""

    def __init__(self, engine, tokenizer, max_turns=4, timeout=5.0, combine="sum",
                 text_tools=None, output_chars=500, tool_parser=""):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_turns, self.timeout, self.combine = max_turns, timeout, combine
        self.text_tools, self.output_chars = text_tools, output_chars
        self.tool_parser, self.parsers = tool_parser, {}  # a task's TOOLS' parser, made once

    def wake(self, named_tensors):
        self.engine.wake(named_tensors)

    def sleep(self):
        self.engine.sleep()

    def episodes(self, task):
        """(make_env(problem), model turns, deadline of one call) for `task`'s rollouts, or None:
        one turn, the engine's own (an eval set's task without turns)."""
        if task is not None and task.episodic:
            make = task.environment or (lambda problem: ToolCalls(task.tools))
            if not task.tools:  # an environment of its own: its step() reads the model's turn
                return make, self.max_turns, self.timeout
            if id(task) not in self.parsers:  # made once, here: not under a call's deadline
                self.parsers[id(task)] = tool_parser(self.tool_parser, self.tokenizer, task.tools)
            return (lambda problem: parsed(make(problem), self.parsers[id(task)]), self.max_turns,
                    self.timeout)
        if self.text_tools is not None:
            # the sandbox's own deadline (tool_timeout) bounds a call, which the model reads as an
            # error; no second deadline that would end the episode
            return lambda problem: self.text_tools.fresh(), self.text_tools.max_calls + 1, None
        return None

    def generate(self, prompts, n, *, seeds, max_tokens, task=None, problems=None, stop=None,
                 progress=False, **sampling):
        """n episodes per prompt, as the engines' generate (seeds: one per row); task: the one the
        prompts are of; problems: one per prompt, each row's environment made from its own."""
        sessions = getattr(getattr(task, "environment", None), "sessions", None)
        if sessions and len(prompts) * n > sessions:  # an OpenEnv server's sessions at once
            return self.in_chunks(max(1, sessions // n), prompts, n, seeds=seeds, task=task,
                                  problems=problems, max_tokens=max_tokens, stop=stop,
                                  progress=progress, **sampling)
        episodes = self.episodes(task)
        if episodes is None:
            return self.engine.generate(prompts, n, seeds=seeds, max_tokens=max_tokens, stop=stop,
                                        progress=progress, **sampling)
        make_env, turns, timeout = episodes
        problems = problems or [None] * len(prompts)
        rows = [Completion(list(p), [], "", [], False, mask=[], env_rewards={})
                for p in prompts for _ in range(n)]
        chat = [task is not None and p is not None and not isinstance(task.prompt(p), str)
                for p in problems]  # else a raw prompt
        envs = [start(rows[r], make_env, problems[r // n], timeout) for r in range(len(rows))]
        live = [r for r in range(len(rows)) if alive(rows[r])]
        for turn in range(turns):
            # every rank decides alike: FSDP's HF engine generates in lockstep
            if parallel.all_max(len(live)) == 0:
                break
            last = turn == turns - 1
            # tools=True: the turn pauses at the close tag for the call, but the last may not call
            pause = getattr(envs[live[0]], "pause", None) if live else None
            outs = self.engine.generate(
                [rows[r].prompt_ids + rows[r].completion_ids for r in live], 1,
                seeds=[turn_seed(seeds[r], turn) for r in live],  # each turn its own draw
                max_tokens=[max_tokens - len(rows[r].completion_ids) for r in live],
                stop=[*(stop or []), pause] if pause and not last else stop or None,
                progress=progress, **sampling)
            going = []
            # the first turn begins with the task's COMPLETION_PREFIX (the prompt wrote it): the
            # environment reads the model's whole turn, as the reward does
            prefix = task.completion_prefix if task is not None and turn == 0 else ""
            for r, [out] in zip(live, outs):
                if self.answer(rows[r], envs[r], out, chat[r // n], max_tokens, timeout,
                               sampled=sampling["temperature"] > 0, last=last, prefix=prefix):
                    going.append(r)
            live = going
        for row, env in zip(rows, envs):
            row.tool_errors += getattr(env, "errors", 0)  # the tool calls that failed
            close(env, timeout)  # what it holds (an OpenEnv session) let go
            row.text = self.tokenizer.decode(row.completion_ids, skip_special_tokens=True)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def in_chunks(self, per, prompts, n, *, seeds, problems, **kwargs):
        """generate(), `per` prompts at a time; every rank runs as many chunks (FSDP's HF engine
        generates in lockstep), the rows' seeds their own as in one call."""
        problems = problems or [None] * len(prompts)
        out = []
        for c in range(parallel.all_max(-(-len(prompts) // per))):
            at = slice(c * per, (c + 1) * per)
            out += self.generate(prompts[at], n, seeds=seeds[at.start * n : at.stop * n],
                                 problems=problems[at], **kwargs)
        return out

    def answer(self, row, env, out, chat, max_tokens, timeout, sampled, last, prefix=""):
        """The model's turn `out` appended to `row`, and the environment's answer to it (the turn
        read as prefix + its text) if the episode goes on: whether the model takes another turn."""
        append(row, out.completion_ids, out.logprobs, model=True)
        row.truncated = out.truncated
        inline = getattr(env, "inline", False)
        if inline and out.stop_string != env.pause:  # no call: the model has answered
            return False
        action = prefix + self.tokenizer.decode(out.completion_ids, skip_special_tokens=True)
        observation, done = step(row, env, action, timeout, self.combine)
        if done or row.truncated or last:
            return False
        observation = cap(observation, self.output_chars)  # before any tokenising
        room = max_tokens - len(row.completion_ids)
        if inline:  # cut to fit, inside its frame
            ids, cut = env.output_ids(self.tokenizer, observation, room)
        else:
            try:  # the observation as tokens: text, or messages the template renders
                ids = self.observation_ids(observation, out.completion_ids, chat)
            except Exception:
                fail(row, "wrong type", "the observation could not be rendered:\n"
                     + traceback.format_exc())
                return False
            if len(ids) >= room:  # no room for the model to answer it: the episode is cut here
                row.truncated = True
                return False
            cut = False
        append(row, ids, [0.0] * len(ids) if sampled else [], model=False)
        row.tool_calls += 1
        row.truncated = cut or len(ids) >= room  # no room left for the model to go on
        return not row.truncated

    def observation_ids(self, observation, sampled, chat):
        """The tokens after the model's turn: the observation, then the assistant's next turn
        opened. A chat: the template's own tokens (chat_suffix); a raw prompt: the text as it is."""
        if not chat:
            if not isinstance(observation, str):
                raise TypeError("a raw prompt's episode takes text observations, not messages")
            return plain_ids(self.tokenizer, observation)
        messages = ([{"role": "user", "content": observation}] if isinstance(observation, str)
                    else observation or [])
        ids = chat_suffix(self.tokenizer, messages)
        eos = self.tokenizer.eos_token_id
        # a turn that ended on a stop string, not the end-of-turn token, is closed first
        return ids if sampled and sampled[-1] == eos else [eos, *ids]


REPORTED = set()  # the kinds of environment failure printed so far in this process
COUNTED = {"errors", "timeouts", "unscored"}  # score_batch's own components: no reward's names


def parsed(env, parse):
    """env, its TOOLS' calls (ToolCalls; a TRL class's too) read by the run's tool_parser."""
    if isinstance(env, ToolCalls):
        env.parse = parse
    return env


def start(row, make_env, problem, timeout):
    """The row's environment, made and reset under the deadline (None if either failed)."""
    env = call(row, timeout, make_env, problem)
    if alive(row):
        call(row, timeout, env.reset)  # its text is in the prompt already (episodes.task.render)
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
    failed: what `python -m episodes.task --audit` tries its adversarial completions on."""
    row = Completion([], [], "", [], False, env_rewards={})
    env = start(row, make_env, problem, timeout)
    if alive(row):
        step(row, env, action, timeout, "sum")
    close(env, timeout)
    return row.env_rewards


def close(env, timeout):
    """env.close(), where it has one, under the deadline: the episode is over and scored, so a
    close that fails is printed (once), not counted."""
    if not callable(getattr(env, "close", None)):
        return
    try:
        env.close() if timeout is None else within(timeout, env.close)
    except (Exception, OutOfTime):
        if "close" not in REPORTED:
            REPORTED.add("close")
            print("warning: an environment's close() failed (printed once; the episode was "
                  f"scored):\n{traceback.format_exc()}", file=sys.stderr)


def call(row, timeout, fn, *args):
    """fn(*args) within `timeout` seconds (tool_timeout; None: fn bounds itself); a failure ends the
    row's episode."""
    begun = time.perf_counter()
    try:
        return fn(*args) if timeout is None else within(timeout, fn, *args)
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


def cap(observation, chars):
    """The observation (text, messages or None), each text in it cut to `chars` characters."""
    if observation is None or isinstance(observation, str):
        return observation and capped(observation, chars)
    return [{**m, "content": capped(m["content"], chars)} if isinstance(m.get("content"), str)
            else m for m in observation]


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
    """The chat template's tokens for `messages`, each content that spells a control token
    tokenised as plain text (plain_ids) and the template's own text between as it renders: a
    result's <|im_end|><|im_start|>system stays text, the template's <|im_end|> is the token."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    controls = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    forged = {i for i, m in enumerate(messages) if any(c in m["content"] for c in controls)}
    if not forged:
        return tokenizer(text, add_special_tokens=False).input_ids
    # render again with a mark in place of each such content, then tokenise piece by piece
    marked = [{**m, "content": f"\x00{i}\x00"} if i in forged else m
              for i, m in enumerate(messages)]
    pieces = re.split("\x00([0-9]+)\x00", tokenizer.apply_chat_template(
        marked, tokenize=False, **kwargs))  # template text, content index, template text, ...
    for change in (str, str.strip):  # the template puts the content in as it is, or trimmed
        contents = {i: change(messages[i]["content"]) for i in forged}
        if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces)) == text:
            return [t for k, p in enumerate(pieces) for t in (
                plain_ids(tokenizer, contents[int(p)]) if k % 2
                else tokenizer(p, add_special_tokens=False).input_ids)]
    # a template that changes contents otherwise: they go in without the control spellings
    spelled = re.compile("|".join(map(re.escape, controls)))
    cleaned = []
    for m in messages:
        content = m["content"]
        while spelled.search(content):  # "<|im_<|im_end|>end|>" spells one again once cut
            content = spelled.sub("", content)
        cleaned.append({**m, "content": content})
    return encode_chat(tokenizer, cleaned, **kwargs)
