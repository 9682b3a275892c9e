"""TOOLS' calls in every common format, parsed by vLLM's own tool parsers (`tool_parser`).

    pytest tests/test_tool_parsers.py

Each format on the text its models write: Hermes (Qwen2.5, and config/tools_chatml.jinja's own
rendering of a call), Llama 3.1's JSON, Mistral's [TOOL_CALLS], Llama 3.2/4's pythonic list. A
malformed call (bad JSON, arguments not an object, an unknown tool, wrong argument types) is a tool
error the model reads and tools/ counts, never the end of the run.
"""

import builtins
import os

import pytest

from config import ConfigError
from episodes.tools import (
    ToolCalls,
    default_tool_parser,
    parse_tool_calls,
    parser_class,
    tool_parser,
)
from infra.model_files import vllm_available
from model import build_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
requires_vllm = pytest.mark.skipif(not vllm_available() and not os.environ.get("CI"),
                                   reason="vllm not installed")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny tokenizer, with the special tokens Llama 3.1 and Mistral call tools with."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny(str(tmp_path_factory.mktemp("m") / "tiny")))
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]"]})
    return tok


TWO = [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
# each format: (text its models write, the calls in it)
FORMATS = {
    "hermes": [
        ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
         TWO[:1]),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>', TWO)],
    "llama3_json": [  # Llama 3.1's custom tools: JSON with "parameters", or after <|python_tag|>
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', TWO[:1]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', TWO[:1]),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}; '
         '{"name": "add", "parameters": {"a": 3, "b": 4}}', TWO)],
    "mistral": [  # Mistral v0.3's (an HF tokenizer: the JSON list after the token)
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', TWO[:1]),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
         '{"name": "add", "arguments": {"a": 3, "b": 4}}]', TWO)],
    "pythonic": [  # Llama 3.2 and 4's
        ("[add(a=1, b=2)]", TWO[:1]),
        ("[add(a=1, b=2), add(a=3, b=4)]", TWO)],
}
MALFORMED = {
    "hermes": ['<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
               '<tool_call>{"name": add}</tool_call>'],
    "llama3_json": ['{"name": "add", "parameters": {"a": 1,', '<|python_tag|>{"name": "add", "p'],
    "mistral": ['[TOOL_CALLS][{"name": "add", "arg', "[TOOL_CALLS]not json"],
    "pythonic": ["[add(a=1, b=]", "[add(a=1"],
}


@requires_vllm
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_parses_with_vllms_own_parser(tokenizer, name):
    parse = tool_parser(name, tokenizer, [add])
    assert parse is not parse_tool_calls  # vLLM's, not this project's
    for text, calls in FORMATS[name]:
        assert parse(text) == calls, text
    assert parse("The sum is 3.") == []  # no call: the episode ends
    for text in MALFORMED[name]:
        [(none, why)] = parse(text)
        assert none is None and "does not parse" in why, text


@requires_vllm
def test_hermes_parses_what_the_shipped_template_renders_as_a_call(tokenizer):
    """config/tools_chatml.jinja's rendering of an assistant call, parsed back by vLLM's hermes."""
    with open(os.path.join(ROOT, "config", "tools_chatml.jinja")) as f:
        template = f.read()
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1 + 2?"},
         {"role": "assistant", "content": "", "tool_calls": [call]}],
        tools=[add], chat_template=template, tokenize=False)
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    assert "<tool_call>" in turn
    assert tool_parser("", tokenizer, [add])(turn) == TWO[:1]


@requires_vllm
def test_arguments_that_are_not_an_object_are_a_failed_call(tokenizer):
    [(none, why)] = tool_parser("hermes", tokenizer, [add])(
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert none is None and "not a JSON object" in why


@requires_vllm
def test_a_malformed_call_comes_back_as_an_error_and_is_counted(tokenizer):
    env = ToolCalls([add])
    env.parse = tool_parser("mistral", tokenizer, [add])
    results, rewards, done = env.step('[TOOL_CALLS][{"name": "add", "arg')
    assert "does not parse" in results[0]["content"] and env.errors == 1 and not done
    results, _, _ = env.step('[TOOL_CALLS][{"name": "mul", "arguments": {}}, '
                             '{"name": "add", "arguments": {"a": "x", "b": [1]}}, '
                             '{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert "no tool 'mul'" in results[0]["content"] and "TypeError" in results[1]["content"]
    assert results[2]["content"] == "3" and env.errors == 3
    huge = '[TOOL_CALLS][{"name": "add", "arguments": {"a": "' + "9" * 1_000_000 + '", "b": 1}}]'
    results, _, done = env.step(huge)  # a huge argument: the tool's TypeError, the episode goes on
    assert "TypeError" in results[0]["content"] and env.errors == 4 and not done


def test_the_default_parser_is_the_chat_templates_format(tokenizer):
    with open(os.path.join(ROOT, "config", "tools_chatml.jinja")) as f:
        shipped = f.read()
    for template, name in ((shipped, "hermes"), ("{{ '[TOOL_CALLS]' }}", "mistral"),
                           ("{{ '<|python_tag|>' }}", "llama3_json"),
                           ("[func_name1(params_name1=params_value1)]", "pythonic"),
                           ("{{ messages }}", "hermes")):
        tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
        tok.chat_template = template
        assert default_tool_parser(tok) == name


@requires_vllm
def test_an_unknown_parser_or_one_the_tokenizer_cannot_serve_fails_saying_so(tmp_path):
    with pytest.raises(ConfigError, match="no parser of that name; its parsers: .*hermes"):
        parser_class("hermess")
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(build_tiny(str(tmp_path / "tiny")))
    with pytest.raises(ConfigError, match="cannot parse this model's calls"):
        tool_parser("mistral", plain, [add])  # no [TOOL_CALLS] token in this vocabulary


def test_without_vllm_hermes_is_parsed_here_and_other_formats_say_what_to_install(
        tokenizer, monkeypatch):
    real = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name.startswith("vllm"):
            raise ImportError("no vllm here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    assert tool_parser("", tokenizer, [add]) is parse_tool_calls
    assert parse_tool_calls(FORMATS["hermes"][1][0]) == TWO  # the same format, the same calls
    with pytest.raises(ConfigError, match="pip install vllm"):
        tool_parser("pythonic", tokenizer, [add])


def test_the_multiply_call_task_pays_the_number_after_the_tools_result(tokenizer):
    """tasks/multiply_call.py: its reward judges the model's number after the last result."""
    from config import load_config
    from episodes.task import load_problems, load_task, score

    cfg = load_config(None, ["--model=tiny", "--task=multiply_call", "--train_size=3"])
    task = load_task(cfg)
    # the prompt writes the call up to the tool's name; the model names the tool
    assert [t.__name__ for t in task.tools] == ["add", "multiply"]
    assert task.completion_prefix == '<tool_call>\n{"name": "'
    p = load_problems(cfg, task, "train")[0]
    call = f'multiply", "arguments": {{"a": {p["a"]}, "b": {p["b"]}}}}}\n</tool_call>'
    result = f"\nuser\n<tool_response>\n{p['answer']}\n</tool_response>\nassistant\n"
    texts = [f"{call}{result}The answer is {p['answer']}.",  # right, after the result
             f"{call}{result}The answer is 7.",  # the result read, a wrong answer
             f"{call}\nuser\n<tool_response>\n{p['answer']}"]  # the tool's number only
    _, comps = score(task, texts, [p] * 3, [10] * 3, cfg)
    assert comps["correct"].tolist() == [1.0, 0.0, 0.0]
    assert comps["called"].tolist() == [1.0, 1.0, 0.0]
    assert task.tools[1](a=p["a"], b=p["b"]) == p["answer"] != task.tools[0](a=p["a"], b=p["b"])
