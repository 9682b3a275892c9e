"""A TRL environment class (GRPOTrainer's environment_factory) as a task file's turns, held to
TRL 1.16's own code path.   pytest tests/test_trl_environment.py"""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from config import load_config
from episodes.task import load_problems, load_task, tokenize_prompts
from episodes.turns import EpisodeEngine
from model import build_tiny
from rollout import Completion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = "<|im_end|>"

# a class written for TRL's GRPOTrainer(environment_factory=Counter), as its docs describe one
COUNTER = '''"""A counter the model adds to with a tool; 3 is the reward."""


def problems(split, n, seed):
    return [{"id": f"{split}{i}", "start": i % 3} for i in range(n)]


def prompt(problem):
    return [{"role": "user", "content": "Count to 3."}]


class Counter:
    def reset(self, **kwargs):  # the dataset row: its "prompt" and the rest
        assert kwargs["prompt"] == [{"role": "user", "content": "Count to 3."}]
        self.n = kwargs["start"]
        return f" Start at {kwargs['start']}."

    def add(self, k: int) -> str:
        """Add to the count.

        Args:
            k: how much to add
        """
        self.n += k
        return str(self.n)

    def _hidden(self):
        return "not a tool"

    def get_reward(self):
        return float(self.n == 3)


environment_factory = Counter
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trl")
    (folder / "counter.py").write_text(COUNTER)
    return str(folder / "counter.py"), build_tiny(str(folder / "tiny"))


def task_and_tokenizer(setup, *overrides):
    from trl.chat_template_utils import qwen2_5_chat_template

    path, model = setup
    # the templates' tool instructions are long in the tiny model's small vocabulary
    cfg = load_config(overrides=[f"--task={path}", "--max_prompt_len=900", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = qwen2_5_chat_template  # one TRL knows how to parse
    return cfg, load_task(cfg), tokenizer


def test_the_prompt_and_tool_schemas_are_trls_own(setup, tmp_path):
    """TRL's GRPOTrainer on the same class and rows: the same tools (add, not reset, get_reward or
    _hidden), the same schemas, and prompt tokens identical to those TRL renders (reset's text
    ending the user message)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg, task, tokenizer = task_and_tokenizer(setup)
    problems = load_problems(cfg, task, "train")[:2]
    ours = tokenize_prompts(tokenizer, task, problems, cfg.max_prompt_len)
    rows = [{"prompt": task.prompt(p), **p} for p in problems]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_steps=1, report_to="none", use_cpu=True, bf16=False,
                      max_completion_length=8)
    trainer = GRPOTrainer(model=setup[1], processing_class=tokenizer, args=args,
                          train_dataset=Dataset.from_list(rows * 2),
                          environment_factory=task.environment.factory)
    assert [f.__name__ for f in trainer._env_tools[None]] == [f.__name__ for f in task.tools]
    assert [get_json_schema(f) for f in trainer._env_tools[None]] == \
        [get_json_schema(f) for f in task.tools]
    assert trainer.reward_func_names == ["Counter"]
    seen = {}

    class Rendered(Exception):
        pass

    tokenize = trainer._tokenize_prompts

    def capture(prompts):  # TRL's reset and rendering ran; stop before it generates
        seen["ids"] = tokenize(prompts)[0]
        raise Rendered

    trainer._tokenize_prompts = capture
    with pytest.raises(Rendered):
        trainer._generate_and_score_completions([dict(r) for r in rows])
    assert [list(ids) for ids in seen["ids"]] == ours
    assert "Count to 3. Start at 1." in tokenizer.decode(ours[1])


class Scripted:
    """Answers turn t of every row with script[t]."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.turn = tokenizer, script, 0

    def generate(self, prompts, n, *, seeds, max_tokens, stop=None, **sampling):
        text = self.script[self.turn]
        self.turn += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [[Completion(list(p), ids, text, [-0.5] * len(ids), False, None)]
                for p in prompts]


@pytest.mark.parametrize("combine, want", [("sum", 1.0), ("last", 1.0)])
def test_each_rollout_has_its_own_instance_its_tools_and_its_reward(setup, combine, want):
    """Rows of start 0 and 1 both call add(3): the first reaches 3 (Counter 1.0), the second 4
    (0.0): one instance each. The reward is get_reward()'s value when the rollout ends, whichever
    way the turns' rewards combine."""
    cfg, task, tokenizer = task_and_tokenizer(setup, f"--env_reward={combine}")
    problems = [{"id": "a", "start": 0}, {"id": "b", "start": 1}]
    prompts = tokenize_prompts(tokenizer, task, problems, cfg.max_prompt_len)
    call = '<tool_call>\n{"name": "add", "arguments": {"k": 3}}\n</tool_call>' + EOS
    script = Scripted(tokenizer, [call, f"Done.{EOS}"])
    engine = EpisodeEngine(script, tokenizer, max_turns=3, combine=combine)
    rows = engine.generate(prompts, 1, seeds=[0, 1], max_tokens=300, temperature=1.0, top_p=1.0,
                           top_k=-1, task=task, problems=problems)
    first, second = rows[0][0], rows[1][0]
    assert first.env_rewards == {"Counter": want} and second.env_rewards == {"Counter": 0.0}
    assert first.tool_calls == 1 and first.tool_errors == 0
    assert "<tool_response>\n3\n</tool_response>" in first.text
    assert "<tool_response>\n4\n</tool_response>" in second.text


def test_a_trl_class_trains_two_steps_and_bad_classes_fail_before_a_model_loads(setup, tmp_path):
    import grpo
    from config import ConfigError

    path, _ = setup
    run = ["--config", os.path.join(ROOT, "config", "tiny.py"), f"--task={path}", "--engine=hf",
           "--max_steps=2", "--eval_every=0", "--max_turns=2", "--max_completion_len=48",
           "--max_prompt_len=900", "--micro_batch_tokens=1000",
           f"--chat_template={os.path.join(ROOT, 'config', 'tools_chatml.jinja')}"]
    grpo.main([*run, f"--out_dir={tmp_path / 'run'}"])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert len(metrics) == 2 and all("reward/Counter" in m for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    for bad, message in (("del Counter.reset", "defines no reset"),
                         ("del Counter.get_reward", "no reward: give Counter a get_reward"),
                         ("environment = lambda problem: None", "without environment")):
        broken = tmp_path / f"broken{len(message)}.py"
        broken.write_text(COUNTER + bad + "\n")
        with pytest.raises(ConfigError, match=message):
            grpo.main([*run, f"--task={broken}", f"--out_dir={tmp_path / 'bad'}"])
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")
