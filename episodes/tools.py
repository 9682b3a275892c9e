"""Tool turns: the model calls a tool, its result comes back as context, the model goes on. Two
ways to write the calls, one episode loop (episodes/turns.py) for both; each is an environment,
one per row, that turns.EpisodeEngine drives:

    TOOLS = [fn, ...]   a task file's plain functions (ToolCalls): the chat template lists them,
                        the model calls them in its template's format (Qwen2.5/Hermes:
                        <tool_call>{"name": ..., "arguments": {...}}</tool_call>), each result
                        comes back as a "tool" message; a turn without a call ends the episode
    tools=True          Python in the completion's own text (TextTools), any task, any model:

        <python>print(347 * 862)</python>          the model's tokens: trained on (mask 1)
        <output>299114</output>                    the tool's output: context only (mask 0)
        The answer is 299114.                      the model's tokens again

                        the model's turn pauses at the close tag, the code runs in the sandbox
                        (scoring/execute.py run_python), its output goes on in the same turn

Everything a tool writes has mask 0: no gradient, no KL, no place in the token-mean
(grpo.pad_batch reads Completion.mask). A call that fails (bad JSON, an unknown tool, bad arguments,
the tool raised, the code raised) gets its error as its result, is counted in tools/error_rate, and
the episode goes on.
"""

import inspect
import json
import re

from config import ConfigError
from scoring.execute import run_python

# ---------------------------------------------------------------- TOOLS: chat-template calls

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
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # (JSON nested too deep)
            calls.append((None, f"the call {body[:200]!r} is not JSON with a name and "
                                f"arguments: {e}"))
    return calls


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: the program; print what you want to see
    """
    # in the sandbox (scoring/sandbox.py), never in this process; its deadline inside
    # tool_timeout's default
    output, ok = run_python(code, timeout=3.0, max_output=500)
    if not ok:  # raised, killed, or no sandbox here: the model reads why, the call counts as failed
        raise RuntimeError(output)
    return output


class ToolCalls:
    """TOOLS as an environment: the turn's calls run (in this process, under tool_timeout for the
    whole turn; python() in the sandbox), each result a tool message; a turn without a call ends the
    episode."""

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


# ---------------------------------------------------------------- a TRL environment class


def tool_methods(instance):
    """The tools of a TRL environment instance, as TRL's GRPOTrainer lists them: every public
    method of its class but reset and get_reward, bound to the instance."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance),
                                                                        inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class TRLEnvironments:
    """A task file's `environment_factory = MyEnv` (TRL 1.16's GRPOTrainer contract) as its
    environment(problem): one instance per rollout; reset(**row) gets the problem's fields and its
    "prompt" (TRL's dataset row) and returns None or text that ends the last user message; its
    public methods are TOOLS (schemas from their type hints and docstrings, as transformers makes
    them); get_reward(), if defined, scores the rollout once it ends, a reward component named
    after the class (weight 1). `tools`: a probe instance's, for the prompt's tool schemas (the same
    for every instance)."""

    def __init__(self, factory, where, summed=True, prompt=None):
        probe = factory()
        self.factory, self.summed, self.tools = factory, summed, tool_methods(probe)
        self.prompt = prompt  # the task's prompt(problem): TRL's row has it as "prompt"
        self.name = type(probe).__name__
        self.rewarded = callable(getattr(type(probe), "get_reward", None))
        if not callable(getattr(type(probe), "reset", None)):
            raise ConfigError(f"{where}: environment_factory's {self.name} defines no reset(), "
                              "which TRL requires: reset(self, **kwargs) -> None or text")
        if self.rewarded and inspect.iscoroutinefunction(type(probe).get_reward):
            raise ConfigError(f"{where}: {self.name}.get_reward is async; make it a plain method")

    def __call__(self, problem):
        return TRLEpisode(self, self.factory(), problem)


class TRLEpisode(ToolCalls):
    """One rollout's instance: each turn's tool calls run on its methods (ToolCalls); get_reward()
    after each turn, its change since the last one reported, so that the turns' rewards summed
    (env_reward="sum") are its value when the rollout ends, as TRL scores it ("last": the value)."""

    def __init__(self, environments, instance, problem):
        super().__init__(tool_methods(instance))
        self.environments, self.instance, self.problem = environments, instance, problem
        self.paid = 0.0

    def reset(self):
        """reset(**row) as TRL calls it, the row being the problem and its "prompt"."""
        self.paid = 0.0
        prompt = self.environments.prompt
        row = {"prompt": prompt(self.problem), **self.problem} if prompt else self.problem
        return self.instance.reset(**row)

    def step(self, action):
        observation, rewards, done = super().step(action)
        if self.environments.rewarded:
            value = float(self.instance.get_reward())
            rewards = {self.environments.name: value - self.paid if self.environments.summed
                       else value}
            self.paid = value
        return observation, rewards, done


# ---------------------------------------------------------------- tools=True: calls in the text

TOOL_OUTPUT = "\n<output>\n{}\n</output>\n"  # what goes back into the model's context after a call


def plain_ids(tokenizer, text):
    """`text` tokenised as plain text: where it spells a control token (<|im_end|>, <|im_start|>)
    those stay characters, never the tokens, so what a tool or an environment writes cannot forge
    a turn of the chat."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids


class TextTools:
    """tools=True's calls as an environment: the model's turn pauses at the close tag (`pause`,
    "</python>"), the code between the open tag and it runs (`run`: the sandbox), and its output
    (TOOL_OUTPUT) goes on in the model's own turn (`inline`: no chat turn around it), up to
    max_calls calls; the turn after the last may not call. A close without an open runs nothing, and
    the model is told so."""

    inline = True  # the output continues the model's turn: output_ids, not the chat template

    def __init__(self, run, max_calls, tags=("<python>", "</python>")):
        self.run = run  # code -> (output text, ok): execute.run_python, or a test's scripted tool
        self.max_calls = max_calls
        self.open, self.pause = tags
        self.errors = 0

    def fresh(self):
        """One for a row: the same tool, its own count of failed calls."""
        return TextTools(self.run, self.max_calls, (self.open, self.pause))

    def reset(self):
        return None

    def step(self, action):
        """Run the call that ends `action` (the model's turn, up to the close tag)."""
        opened = action.rfind(self.open)
        if opened < 0:
            output, ok = f"error: no {self.open} before {self.pause}", False
        else:
            output, ok = self.run(action[opened + len(self.open) : action.rfind(self.pause)])
        self.errors += not ok
        return output.strip(), {}, False

    @staticmethod
    def output_ids(tokenizer, output, room):
        """(ids, cut): TOOL_OUTPUT around `output` if it fits in `room` tokens; else around as much
        of the output as fits, or nothing when not even the empty frame does. Never an output
        without its closing tag: a reward reading the model's last number would read the tool's."""
        ids = plain_ids(tokenizer, TOOL_OUTPUT.format(output))
        if len(ids) <= room:
            return ids, False
        content = plain_ids(tokenizer, output)
        frame = len(plain_ids(tokenizer, TOOL_OUTPUT.format("")))
        # tokens may merge across the cut: check
        for k in range(min(len(content), room - frame), -1, -1):
            text = tokenizer.decode(content[:k])
            ids = plain_ids(tokenizer, TOOL_OUTPUT.format(text))
            if len(ids) <= room:
                return ids, True
        return [], True
