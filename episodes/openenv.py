"""Environments served by an OpenEnv server (Meta's OpenEnv, `pip install openenv-core==0.3.0`),
driven over OpenEnv's own protocol through its own client:

    python -m episodes.guess_server --port 8000 &          # an example server (OpenEnv's classes)
    python grpo.py --task=openenv --env_url=http://localhost:8000

Each rollout is one OpenEnv session: a WebSocket to the server's /ws, its own environment
instance there (openenv.core.GenericEnvClient, the client that needs no package of the
environment's). reset(**kwargs) opens the episode, step(action) answers each model turn; the
observation's `reward` and `done` are used as the server sets them (a reward of None pays 0; done
ends the episode). What the model writes becomes the action's one text field, the observation's
text field is what the model reads next (the server's /schema names both; a task says which where
there are several).

Sessions are held across turns, so the server must take as many at once as a batch has episodes
(create_app(..., max_concurrent_envs=N)). At the start Server opens that many, counts what the
server takes and runs the episodes that many at a time (EpisodeEngine); a server that takes fewer
than group_size, or none, or is down, fails the run there, before any model loads. During the run
a server that is down, slow (past tool_timeout) or answers what is not OpenEnv's protocol ends that
episode only: a counted failure (reward/errors), its error printed once (episodes/turns.py).
"""

import asyncio
import json
import math
import threading
import urllib.request

from config import ConfigError

INSTALL = "pip install openenv-core==0.3.0"
LOOP = []  # one event loop, in a thread of its own, for every session of this process


def run(coroutine, seconds):
    """The coroutine's value, run on the sessions' loop; TimeoutError past `seconds`."""
    if not LOOP:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="openenv", daemon=True).start()
        LOOP.append(loop)
    future = asyncio.run_coroutine_threadsafe(coroutine, LOOP[0])
    try:
        return future.result(seconds)
    except TimeoutError:
        future.cancel()
        raise TimeoutError(f"the OpenEnv server did not answer within {seconds} s") from None


def text_field(schema, name, what):
    """The field of an action or observation schema that holds the text: `name`, or the one
    string field (metadata aside)."""
    fields = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    if name:
        if name not in fields:
            raise ConfigError(f"the server's {what} has no field {name!r}; it has {sorted(fields)}")
        return name
    texts = [k for k, v in fields.items() if v.get("type") == "string"]
    if len(texts) == 1:
        return texts[0]
    return None  # several or none: an action must be named; an observation is shown whole


class Server:
    """An OpenEnv server at `url` as a task's environment(problem): each call a fresh session.

    sessions: the most episodes the run holds open at once (batch_size); the server is asked for
    them now and `self.sessions` is what it takes. timeout: tool_timeout, one call's deadline.
    action / observation: the schema field the model's text fills and the one it reads ("" = the
    schema's only text field). reset(problem): reset()'s keyword arguments (default: the
    problem's "seed", which OpenEnv's reset takes; a server passes on only what its reset accepts).
    reward(reward, done) -> a float or a dict of named floats, from a step's reward and done."""

    def __init__(self, url, sessions, group_size=1, timeout=5.0, action="", observation="",
                 reset=None, reward=None):
        try:
            from openenv.core import GenericEnvClient
        except ImportError as e:
            raise ConfigError(f"an OpenEnv environment needs openenv-core: {INSTALL}") from e
        self.client, self.url, self.timeout = GenericEnvClient, url.rstrip("/"), timeout
        self.reset = reset or (lambda problem: {"seed": problem["seed"]} if "seed" in problem
                               else {})
        self.reward = reward or (lambda reward, done: reward)
        try:
            with urllib.request.urlopen(f"{self.url}/schema", timeout=timeout) as answer:
                schema = json.loads(answer.read())
        except Exception as e:
            raise ConfigError(f"no OpenEnv server answers at {self.url} ({type(e).__name__}: "
                              f"{e}); start it first, or set env_url") from e
        self.action = text_field(schema.get("action", {}), action, "action")
        if self.action is None:
            raise ConfigError(f"the action of the server at {self.url} has several fields or no "
                              "text one; name the one the model's text fills (env_action)")
        self.observation = text_field(schema.get("observation", {}), observation, "observation")
        self.sessions = self.open_at_once(sessions)
        if self.sessions < group_size:
            raise ConfigError(f"the OpenEnv server at {self.url} takes {self.sessions} sessions "
                              f"at once, fewer than group_size={group_size}: start it with "
                              f"max_concurrent_envs >= {sessions}")
        if self.sessions < sessions:
            print(f"the OpenEnv server at {self.url} takes {self.sessions} sessions at once: "
                  f"episodes run {self.sessions} at a time (max_concurrent_envs >= {sessions} "
                  "runs a batch at once)")

    def open_at_once(self, n):
        """How many of n sessions, opened and reset at once, the server takes (closed after)."""
        async def probe():
            clients = [self.client(base_url=self.url, connect_timeout_s=self.timeout,
                                   message_timeout_s=self.timeout) for _ in range(n)]
            answers = await asyncio.gather(*(c.reset() for c in clients), return_exceptions=True)
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            return answers
        answers = run(probe(), 3 * self.timeout + n)
        taken = sum(not isinstance(a, BaseException) for a in answers)
        if taken == 0:
            raise ConfigError(f"the OpenEnv server at {self.url} opened no session: {answers[0]}")
        return taken

    def __call__(self, problem):
        return Episode(self, problem)

    def text(self, observation):
        """What the model reads of an observation (a dict): its text field, or all of it."""
        if not isinstance(observation, dict):
            raise TypeError(f"the server's observation is not an object: {observation!r:.200}")
        if self.observation:
            return str(observation.get(self.observation, ""))
        return json.dumps(observation)


class Episode:
    """One rollout's session: reset() opens it, step(action) plays a turn, close() ends it."""

    def __init__(self, server, problem):
        self.server, self.problem, self.session = server, problem, None

    def reset(self):
        """The episode opened: the observation's text, which ends the prompt's last user message
        (the same for every row of a problem: the server's reset must follow from its seed)."""
        self.close()
        server = self.server
        self.session = server.client(base_url=server.url, connect_timeout_s=server.timeout,
                                     message_timeout_s=server.timeout)
        answer = run(self.session.reset(**server.reset(self.problem)), server.timeout)
        return server.text(answer.observation)

    def step(self, action):
        server = self.server
        answer = run(self.session.step({server.action: action}), server.timeout)
        reward = 0.0 if answer.reward is None else answer.reward
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"the server's reward is not a number: {answer.reward!r:.100}")
        if answer.done:
            self.close()
        return server.text(answer.observation), server.reward(reward, answer.done), answer.done

    def close(self):
        """The session closed (the server frees its instance); a failure to close is ignored."""
        if self.session is not None:
            session, self.session = self.session, None
            try:
                run(session.close(), self.server.timeout)
            except Exception:
                pass
