"""Both sampling engines on a tiny model: parity with the trainer, weight pushes.

    pytest tests/test_rollout.py
"""

import os
import sys
import types

import pytest
import torch

from config import load_config
from grpo import forward_logprobs, pad_batch
from infra.model_files import vllm_available
from model import build_tiny, load_policy, push_weights_iter
from rollout import HFEngine, VLLMEngine

# In CI (CI set) a missing vLLM is a failure, not a skip: the install command must provide it.
requires_vllm = pytest.mark.skipif(not vllm_available() and not os.environ.get("CI"),
                                   reason="vllm not installed")
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(str(tmp_path_factory.mktemp("models") / "tiny"))
    cfg = load_config(overrides=["--model=tiny", "--dtype=float32", "--max_prompt_len=64",
                                 "--max_completion_len=24", "--micro_batch_tokens=256", "--seed=0"])
    tokenizer, policy = load_policy(cfg, path, "cpu")
    prompts = [tokenizer("Write only digits, like 4 2 7:").input_ids,
               tokenizer("<think> 1 + 2").input_ids]
    return cfg, path, tokenizer, policy, prompts


@pytest.fixture(scope="module")
def vllm_engine(tiny):
    cfg, path, *_ = tiny
    return VLLMEngine(path, cfg, "cpu")


def trainer_gap(policy, cfg, groups):
    """Max |sampler logprob - trainer logprob| over all sampled tokens."""
    completions = [c for g in groups for c in g]
    ids, attention, mask, sampler_lp = pad_batch(completions, 0)
    with torch.no_grad():
        lp, _ = forward_logprobs(policy, ids, attention, cfg, TEMPERATURE)
    assert mask.sum() > 10
    return ((lp - sampler_lp).abs() * mask).max().item()


def sample(engine, prompts, temperature=TEMPERATURE, n=4):
    # row j of prompt i seeded i + j: fixed samples that the bounds below were set on
    seeds = [i + j for i in range(len(prompts)) for j in range(n)]
    return engine.generate(prompts, n, seeds=seeds, temperature=temperature, top_p=1.0, top_k=-1,
                           max_tokens=24)


def perturb(policy, scale):
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * scale)


@requires_vllm
def test_vllm_parity_after_0_1_and_5_pushes(tiny, vllm_engine):
    cfg, _, _, policy, prompts = tiny
    vllm_engine.wake(push_weights_iter(policy))
    assert trainer_gap(policy, cfg, sample(vllm_engine, prompts)) < 1e-3
    for pushes in range(5):
        perturb(policy, 0.02)
        vllm_engine.wake(push_weights_iter(policy))
        if pushes in (0, 4):
            assert trainer_gap(policy, cfg, sample(vllm_engine, prompts)) < 1e-3


@requires_vllm
def test_vllm_group_shares_its_prompts_kv_and_a_push_never_serves_the_old_one(tiny, vllm_engine):
    """A group's G completions reuse its prompt's KV (vLLM's prefix cache, whole blocks only: on a
    CPU the engine asks for 32-token blocks), and after a push the cache holds the new weights' KV,
    not the old."""
    from vllm import SamplingParams

    cfg, _, tokenizer, policy, _ = tiny
    prompt = tokenizer(" ".join(str(i % 10) for i in range(40))).input_ids[:40]  # a block and a bit
    vllm_engine.wake(push_weights_iter(policy))
    out = vllm_engine.llm.generate([{"prompt_token_ids": prompt}],
                                   SamplingParams(n=4, max_tokens=4), use_tqdm=False)
    assert out[0].num_cached_tokens == 32  # the siblings found the first block already computed
    assert trainer_gap(policy, cfg, sample(vllm_engine, [prompt])) < 1e-3
    perturb(policy, 0.2)
    # the prompt's cached KV is now stale, and must not be served
    vllm_engine.wake(push_weights_iter(policy))
    assert trainer_gap(policy, cfg, sample(vllm_engine, [prompt])) < 1e-3


@requires_vllm
def test_vllm_stale_weights_are_visible_and_the_push_changes_the_output(tiny, vllm_engine):
    cfg, _, _, policy, prompts = tiny
    vllm_engine.wake(push_weights_iter(policy))
    before = [c.completion_ids for g in sample(vllm_engine, prompts, temperature=0.0, n=1)
              for c in g]
    perturb(policy, 0.2)  # not pushed: the sampler is stale
    assert trainer_gap(policy, cfg, sample(vllm_engine, prompts)) > 1e-2
    vllm_engine.wake(push_weights_iter(policy))
    after = [c.completion_ids for g in sample(vllm_engine, prompts, temperature=0.0, n=1)
             for c in g]
    assert after != before
    assert trainer_gap(policy, cfg, sample(vllm_engine, prompts)) < 1e-3


@requires_vllm
def test_vllm_completions_fields(tiny, vllm_engine):
    cfg, _, tokenizer, policy, prompts = tiny
    vllm_engine.wake(push_weights_iter(policy))
    groups = sample(vllm_engine, prompts, n=3)
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.prompt_ids == prompt and len(c.logprobs) == len(c.completion_ids) <= 24
            assert c.truncated == (len(c.completion_ids) == 24 and c.completion_ids[-1]
                                   != tokenizer.eos_token_id)
            assert c.text == tokenizer.decode(c.completion_ids, skip_special_tokens=True)


def test_hf_engine_decodes_in_the_trainers_bf16(tiny):
    """With dtype bfloat16 the engine decodes under the trainer's autocast: its logprobs carry bf16
    rounding (they differ from an fp32 engine's, which equal the fp32 trainer's), and they stay
    within the bf16 parity bound of the bf16 trainer's."""
    import dataclasses

    cfg, _, tokenizer, policy, prompts = tiny
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    fp32_groups = sample(HFEngine(policy, tokenizer), prompts, n=3)
    bf16_groups = sample(HFEngine(policy, tokenizer, dtype="bfloat16"), prompts, n=3)
    assert trainer_gap(policy, cfg, fp32_groups) < 5e-5
    assert trainer_gap(policy, cfg, bf16_groups) > 5e-4  # bf16 compute, not fp32
    assert trainer_gap(policy, bf16, bf16_groups) < 0.1  # PARITY_WARN["bfloat16"]


def test_hf_engine_parity_and_fields(tiny):
    cfg, _, tokenizer, policy, prompts = tiny
    engine = HFEngine(policy, tokenizer)
    groups = sample(engine, prompts, n=3)
    assert trainer_gap(policy, cfg, groups) < 1e-3
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.prompt_ids == prompt and len(c.logprobs) == len(c.completion_ids) <= 24
            # a completion ends at its first stop token, or at the length limit;
            # nothing of the padding after it
            assert not any(t in engine.stop for t in c.completion_ids[:-1])
            assert c.completion_ids[-1] in engine.stop or len(c.completion_ids) == 24
            assert c.truncated == (len(c.completion_ids) == 24 and c.completion_ids[-1]
                                   != tokenizer.eos_token_id)
    # the engine samples from the policy object itself: a change to the policy is its next output
    before = [c.completion_ids for g in sample(engine, prompts, temperature=0.0, n=1) for c in g]
    perturb(policy, 0.2)
    assert ([c.completion_ids for g in sample(engine, prompts, temperature=0.0, n=1) for c in g]
            != before)


def test_a_seed_count_other_than_one_per_row_is_a_clear_error(tiny):
    """Both engines take one seed per row; one per prompt (2 for 2 prompts x 3) is refused with the
    count it needs, not an IndexError deep in the decoding loop (or vLLM's "lengths of prompts and
    params must be the same")."""
    from rollout import check_seeds

    _, _, tokenizer, policy, prompts = tiny
    with pytest.raises(ValueError, match=r"2 prompts x n=3 = 6; got 2"):
        HFEngine(policy, tokenizer).generate(prompts[:2], 3, seeds=[0, 1], temperature=1.0,
                                             top_p=1.0, top_k=-1, max_tokens=4)
    check_seeds([[1], [2]], 3, list(range(6)))  # the right count passes
    with pytest.raises(ValueError, match="one per row"):
        check_seeds([[1], [2]], 4, list(range(6)))


@requires_vllm
def test_vllm_lora_merged_push_matches_the_merged_trainer(tiny, vllm_engine):
    from peft import LoraConfig, get_peft_model

    cfg, path, _, _, prompts = tiny
    _, base = load_policy(cfg, path, "cpu")
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: B is no longer 0
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    vllm_engine.wake(push_weights_iter(lora))
    # the policy is untouched by a push
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items())
    # the sampler has base + B A merged
    assert trainer_gap(lora, cfg, sample(vllm_engine, prompts)) < 1e-3


# ---------------------------------------------------------------- tool calls (tools=True)


def scripted_tool(code):
    return "7 7 7", True


def tool_turns(groups):
    return [[(c.completion_ids, c.mask, c.tool_calls, c.truncated) for c in g] for g in groups]


@requires_vllm
def test_both_engines_take_the_same_tool_turns_and_keep_parity_over_the_models_tokens(
        tiny, vllm_engine):
    """Greedy, with the text of prompt 0's first greedy token(s) as the close tag, row 0 calls the
    (scripted) tool: both engines give the same ids, masks and turns. Sampled, with 'e' as the
    close (most rows write one soon), the sampler's logprobs of the model's tokens equal the
    trainer's; the tool's tokens are masked out of the comparison."""
    from episodes.tools import TextTools
    from episodes.turns import EpisodeEngine

    cfg, _, tokenizer, policy, prompts = tiny
    vllm_engine.wake(push_weights_iter(policy))
    hf_engine = HFEngine(policy, tokenizer)
    first = sample(hf_engine, prompts, temperature=0.0, n=1)[0][0].completion_ids
    close = next(text for k in range(1, len(first)) if (text := tokenizer.decode(first[:k])).strip()
                 and "\ufffd" not in text and text not in tokenizer.decode(first[: k - 1]))
    greedy = {}
    for name, engine in (("hf", hf_engine), ("vllm", vllm_engine)):
        # open "": the turn is the code
        text_tools = TextTools(scripted_tool, 2, ("", close))
        tools = EpisodeEngine(engine, tokenizer, text_tools=text_tools)
        greedy[name] = tool_turns(sample(tools, prompts, temperature=0.0, n=1))
    assert greedy["hf"] == greedy["vllm"]
    assert greedy["hf"][0][0][2] >= 1  # row 0 called
    for engine in (hf_engine, vllm_engine):
        tools = EpisodeEngine(engine, tokenizer, text_tools=TextTools(scripted_tool, 2, ("", "e")))
        groups = sample(tools, prompts, n=4)
        assert sum(c.tool_calls for g in groups for c in g) >= 2
        assert trainer_gap(policy, cfg, groups) < 1e-3


def test_hf_tool_rollouts_without_a_call_are_the_plain_engines(tiny):
    """With tools on and no call made, a completion is exactly the one-turn engine's: same seeds,
    same ids."""
    from episodes.tools import TextTools
    from episodes.turns import EpisodeEngine

    _, _, tokenizer, policy, prompts = tiny
    engine = HFEngine(policy, tokenizer)
    plain = sample(engine, prompts, temperature=1.0, n=3)
    tools = EpisodeEngine(engine, tokenizer, text_tools=TextTools(scripted_tool, 2))
    tools = sample(tools, prompts, temperature=1.0, n=3)
    for p, t in zip((c for g in plain for c in g), (c for g in tools for c in g)):
        got = (t.completion_ids, t.logprobs, t.truncated, t.tool_calls)
        assert got == (p.completion_ids, p.logprobs, p.truncated, 0)
        assert t.mask == [1] * len(p.completion_ids)


# ---------------------------------------------------------------- stop strings (a task's STOP)


def first_end(tokenizer, ids, stop):
    """The length of the shortest prefix of `ids` whose text holds `stop`, or None."""
    texts = (tokenizer.decode(ids[:j], skip_special_tokens=True) for j in range(1, len(ids) + 1))
    return next((j for j, text in enumerate(texts, 1) if stop in text), None)


def check_stop_strings(engine, tokenizer, prompts):
    """Greedy: the text of a completion's first two tokens as a stop string ends it after those two
    (the token that completes the string, kept); one that never occurs changes nothing, a truncated
    completion included. Sampled with "e": every row ends at its first "e", or holds none. Returns
    the greedy completions that stopped."""
    plain = [g[0] for g in sample(engine, prompts, temperature=0.0, n=1)]
    stops = [tokenizer.decode(c.completion_ids[:2], skip_special_tokens=True) for c in plain]
    assert all(s.strip() and "\ufffd" not in s for s in stops) and all(c.truncated for c in plain)
    stopped = [g[0] for g in engine.generate(prompts, 1, seeds=[0, 1], temperature=0.0, top_p=1.0,
                                             top_k=-1, max_tokens=24,
                                             stop=stops[::-1] + ["no such text"])]
    for c, p, s in zip(stopped, plain, stops):
        assert c.completion_ids == p.completion_ids[:2] and c.stop_string == s and not c.truncated
        assert c.text == s and len(c.logprobs) == 0  # greedy: no logprobs
    never = sample_with_stop(engine, prompts, ["no such text"], temperature=0.0, n=1)
    assert [(c.completion_ids, c.truncated, c.stop_string) for g in never for c in g] == [
        (c.completion_ids, c.truncated, None) for c in plain]
    for c in (c for g in sample_with_stop(engine, prompts, ["e"]) for c in g):
        if c.stop_string:
            assert c.stop_string == "e"
            assert first_end(tokenizer, c.completion_ids, "e") == len(c.completion_ids)
            assert not c.truncated and len(c.logprobs) == len(c.completion_ids)
        else:
            assert "e" not in c.text
    return stopped


def sample_with_stop(engine, prompts, stop, temperature=1.0, n=4):
    seeds = [i + j for i in range(len(prompts)) for j in range(n)]
    return engine.generate(prompts, n, seeds=seeds, temperature=temperature, top_p=1.0, top_k=-1,
                           max_tokens=24, stop=stop)


def test_hf_engine_stops_at_a_stop_string_and_keeps_it(tiny):
    """The checks above; and a sampled row that stops is the row sampled without the stop string,
    cut there (each row draws from its own generator), a row that holds no stop string that row."""
    _, _, tokenizer, policy, prompts = tiny
    engine = HFEngine(policy, tokenizer)
    check_stop_strings(engine, tokenizer, prompts)
    free = [c for g in sample(engine, prompts, temperature=1.0) for c in g]
    cut = [c for g in sample_with_stop(engine, prompts, ["e"]) for c in g]
    assert any(c.stop_string for c in cut) and any(not c.stop_string for c in cut)
    for c, f in zip(cut, free):
        end = first_end(tokenizer, f.completion_ids, "e") or len(f.completion_ids)
        assert (c.completion_ids, c.logprobs) == (f.completion_ids[:end], f.logprobs[:end])
        assert c.truncated == (c.stop_string is None and f.truncated)


@requires_vllm
def test_vllm_stops_at_a_stop_string_as_the_hf_engine_does(tiny, vllm_engine):
    _, _, tokenizer, policy, prompts = tiny
    vllm_engine.wake(push_weights_iter(policy))
    ours = check_stop_strings(vllm_engine, tokenizer, prompts)
    hf = check_stop_strings(HFEngine(policy, tokenizer), tokenizer, prompts)
    assert [(c.completion_ids, c.stop_string) for c in ours] == [
        (c.completion_ids, c.stop_string) for c in hf]


def test_tool_turns_stop_at_the_tasks_strings_and_at_the_close_tag_while_a_call_may_come():
    """tools=True's turns hand the inner engine the task's stop strings in every turn and the close
    tag only in the turns that may call; a row that stops on the task's string makes no call and
    ends."""
    from types import SimpleNamespace

    from episodes.tools import TextTools
    from episodes.turns import EpisodeEngine
    from rollout import Completion

    asked = []

    # turn 0: row 0 closes a call, row 1 stops on the task's string; then row 0 answers
    class Scripted:
        def generate(self, prompts, n, *, stop, **kwargs):
            asked.append(stop)
            texts = ["x</python>", "y</answer>"] if len(asked) == 1 else ["z"]
            ends = ["</python>", "</answer>"] if len(asked) == 1 else [None]
            return [[Completion(p, [len(t)], t, [0.0], False, e)]
                    for p, t, e in zip(prompts, texts, ends)]

    class Tokenizer:  # every text one token, 9: the frame's (tools.plain_ids calls it)
        def __call__(self, text, **kwargs):
            return SimpleNamespace(input_ids=[9])

        def decode(self, ids, skip_special_tokens=True):
            return "x</python>"

        def encode(self, text, add_special_tokens=False):
            return [9]

    tokenizer = Tokenizer()
    scripted = TextTools(lambda code: ("out", True), 1)
    engine = EpisodeEngine(Scripted(), tokenizer, text_tools=scripted)
    groups = engine.generate([[1], [2]], 1, seeds=[0, 1], max_tokens=24, stop=["</answer>"],
                             temperature=1.0, top_p=1.0, top_k=-1)
    assert asked == [["</answer>", "</python>"], ["</answer>"]]  # the last turn may not call
    assert [g[0].tool_calls for g in groups] == [1, 0]


def test_a_task_files_stop_strings_and_answer_are_read_and_checked(tmp_path):
    """STOP: a list of non-empty strings (the base-model Countdown task stops at </answer>);
    answer(): a function of (completion, problem). Anything else fails as the task loads."""
    from config import ConfigError
    from episodes.task import load_task

    assert load_task(load_config(overrides=["--task=countdown_base"])).stop == ["</answer>"]
    assert load_task(load_config(overrides=["--task=countdown"])).stop == []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plain = open(os.path.join(root, "tasks", "larger.py")).read()
    for extra, message in (('STOP = "</answer>"', "STOP = '</answer>'; it must be a list of"),
                           ('STOP = ["</answer>", ""]', "it must be a list of non-empty strings"),
                           ("def answer(completion):\n    return None", "answer must be a")):
        path = tmp_path / "mine.py"
        path.write_text(plain + "\n" + extra + "\n")
        with pytest.raises(ConfigError, match=f"task file {path}: .*{message}"):
            load_task(load_config(overrides=[f"--task={path}"]))


@requires_vllm
def test_vllm_parity_with_untied_embeddings(tiny, tmp_path):
    # Last of the tests on an in-process engine: vLLM keeps its parallel groups in process-global
    # state, and tearing down this second engine tears them down under the module's shared engine
    # too (a real run has one).
    cfg = tiny[0]
    path = build_tiny(str(tmp_path / "untied"), tie=False)
    _, policy = load_policy(cfg, path, "cpu")
    assert policy.lm_head.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()
    perturb(policy, 0.05)  # lm_head and embeddings now differ: both must be pushed
    engine = VLLMEngine(path, cfg, "cpu")
    engine.wake(push_weights_iter(policy, bucket_mb=0))  # bucket_mb=0: one tensor per bucket
    assert trainer_gap(policy, cfg, sample(engine, tiny[4])) < 1e-3


# --------------------------------------------------- the model's generation_config, stops and seeds


def with_generation_config(path, tmp_path, **fields):
    """A copy of the tiny model folder whose generation_config.json sets `fields`."""
    import shutil

    from transformers import GenerationConfig

    folder = str(tmp_path / "with_generation_config")
    shutil.copytree(path, folder)
    GenerationConfig(**fields).save_pretrained(folder)
    return folder


def test_hf_engine_ignores_the_models_sampling_defaults(tiny, tmp_path):
    """Qwen2.5-Instruct ships repetition_penalty 1.05; transformers fills every unset setting from
    it. The samples must follow the trainer's distribution exactly: the HF engine's own decoding
    loop reads only its EOS list."""
    cfg, path, tokenizer, _, prompts = tiny
    folder = with_generation_config(path, tmp_path, do_sample=True, repetition_penalty=3.0,
                                    no_repeat_ngram_size=2, top_k=5, min_p=0.2)
    _, policy = load_policy(cfg, folder, "cpu")
    assert policy.generation_config.repetition_penalty == 3.0
    engine = HFEngine(policy, tokenizer)
    assert trainer_gap(policy, cfg, sample(engine, prompts)) < 1e-3
    # restored: checkpoints keep the model's own file
    assert policy.generation_config.repetition_penalty == 3.0


def greedy_first_token(policy, prompt):
    with torch.no_grad():
        return int(policy(torch.tensor([prompt])).logits[0, -1].argmax())


def test_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs():
    from types import SimpleNamespace

    from rollout import stop_tokens

    tok = SimpleNamespace(eos_token_id=7)
    assert stop_tokens(tok, SimpleNamespace(eos_token_id=[151645, 151643])) == [7, 151643, 151645]
    assert stop_tokens(tok, SimpleNamespace(eos_token_id=7)) == [7]
    assert stop_tokens(tok, None) == [7]


def test_hf_engine_stops_on_every_eos_the_model_lists(tiny, tmp_path):
    cfg, path, tokenizer, _, prompts = tiny
    # the folder's weights (others perturb)
    first = greedy_first_token(load_policy(cfg, path, "cpu")[1], prompts[0])
    assert first != tokenizer.eos_token_id
    folder = with_generation_config(path, tmp_path, eos_token_id=[tokenizer.eos_token_id, first])
    _, listed = load_policy(cfg, folder, "cpu")
    got = sample(HFEngine(listed, tokenizer), prompts[:1], temperature=0.0, n=1)[0][0]
    # stopped on the second listed EOS, kept it
    assert got.completion_ids == [first] and not got.truncated


VLLM_SCRIPT = """
import json, sys
from config import load_config
from rollout import VLLMEngine, row_seeds
cfg = load_config(overrides=["--model=tiny", "--dtype=float32", "--max_prompt_len=64",
                             "--max_completion_len=24", "--micro_batch_tokens=256", "--seed=0"])
engine = VLLMEngine(sys.argv[1], cfg, "cpu")
prompts = json.loads(sys.argv[2])
def ids(seeds, temperature=1.0, n=4):
    groups = engine.generate(prompts, n, seeds=seeds, temperature=temperature, top_p=1.0, top_k=-1,
                             max_tokens=24)
    return [[c.completion_ids for c in g] for g in groups]
# two ranks' rows
rank0, rank1 = row_seeds((0, "train", 3), 0, 2, 4), row_seeds((0, "train", 3), 2, 2, 4)
print("RESULT " + json.dumps({"rank0": ids(rank0), "rank1": ids(rank1), "rank0_again": ids(rank0),
                              "greedy": ids([0, 0], temperature=0.0, n=1), "stop": engine.stop}))
"""


@requires_vllm
@pytest.mark.slow
def test_vllm_seeds_survive_a_fresh_engine_and_stops_match_the_hf_engine(tiny, tmp_path):
    """Resume starts a fresh engine: the same seeds must give the same completions, and other ranks'
    seeds other completions. Each engine runs in its own process (vLLM's parallel state is
    process-global)."""
    import json
    import subprocess
    import sys

    cfg, path, tokenizer, _, prompts = tiny
    # the weights the engine loads
    first = greedy_first_token(load_policy(cfg, path, "cpu")[1], prompts[0])
    folder = with_generation_config(path, tmp_path, eos_token_id=[tokenizer.eos_token_id, first])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run():
        proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, folder, json.dumps(prompts)],
                              capture_output=True, text=True, cwd=root, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        return json.loads(result[7:])

    a, b = run(), run()
    assert a["rank0"] == b["rank0"] and a["rank1"] == b["rank1"]  # a fresh engine, the same samples
    assert a["rank0"] == a["rank0_again"]  # and within one engine, whatever ran before
    assert a["rank0"] != a["rank1"]  # other seeds, other samples
    assert a["stop"] == HFEngine(load_policy(cfg, folder, "cpu")[1], tokenizer).stop
    assert a["greedy"][0] == [[first]]  # vLLM stopped on the second listed EOS too, and kept it


def test_hf_engine_batches_prompts_yet_each_row_follows_its_own_seed(tiny):
    """Every prompt of a call in one left-padded batch, yet each row is drawn from its own seed
    alone: two ranks' halves sampled apart give one process's samples, a fresh engine the same ones,
    other seeds others, and a row moved to another place in the call (other seeds around it) keeps
    its sample."""
    from rollout import row_seeds

    cfg, _, tokenizer, policy, prompts = tiny
    assert len(prompts[0]) != len(prompts[1])  # the batch is padded

    def ids(engine, ps, seeds, n=3):
        groups = engine.generate(ps, n, seeds=seeds, temperature=1.0, top_p=1.0, top_k=-1,
                                 max_tokens=24)
        return [[c.completion_ids for c in g] for g in groups]

    engine, seeds = HFEngine(policy, tokenizer), row_seeds((0, "train", 3), 0, 2, 3)
    both = ids(engine, prompts, seeds)
    # 1 rank == 2 ranks
    assert both == ids(engine, prompts[:1], seeds[:3]) + ids(engine, prompts[1:], seeds[3:])
    # a fresh engine (a resumed run)
    assert both == ids(HFEngine(policy, tokenizer), prompts, seeds)
    assert both != ids(engine, prompts, [s + 100 for s in seeds])
    assert len({tuple(row) for row in both[0]}) > 1  # a group's rows are not copies of each other
    # row 2 of prompt 1 alone, as row 0 of a one-row call: the same sample from the same seed
    assert ids(engine, prompts[1:], seeds[5:], n=1) == [[both[1][2]]]


def test_sample_next_draws_each_token_with_its_probability():
    """20,000 rows of probs 0.1, 0.2, 0.3, 0.4 (and a masked fifth): each token's share is its
    probability within the sampling error (4 sigma); the masked token (p = 0) and nothing outside
    the vocabulary is ever drawn."""
    import math

    from rollout import sample_next

    probs = (0.1, 0.2, 0.3, 0.4)
    n = 20_000
    logits = torch.tensor([[math.log(p) for p in probs] + [-float("inf")]]).repeat(n, 1)
    tokens, _ = sample_next(logits, 1.0, 1.0, -1,
                            [torch.Generator().manual_seed(i) for i in range(n)])
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert counts[4] == 0 and sum(counts) == n
    for count, p in zip(counts, probs):
        assert abs(count / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_sample_next_keeps_top_k_and_top_p_and_renormalises():
    """probs 0.1, 0.2, 0.3, 0.4: top_k=2 and top_p=0.5 both keep {0.3, 0.4} -> 3/7, 4/7;
    top_p=0.8 drops only 0.1."""
    import math

    from rollout import sample_next

    logits = torch.tensor([[math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]]).repeat(400, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(400)]
    for top_p, top_k, kept in [(1.0, 2, {2: 3 / 7, 3: 4 / 7}), (0.5, -1, {2: 3 / 7, 3: 4 / 7}),
                               (0.8, -1, {1: 2 / 9, 2: 3 / 9, 3: 4 / 9}),
                               (1.0, -1, {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})]:
        tokens, logprobs = sample_next(logits, 1.0, top_p, top_k, generators)
        assert set(tokens.tolist()) == set(kept)  # 400 draws reach every kept token, and no other
        for t, lp in zip(tokens.tolist(), logprobs.tolist()):
            assert lp == pytest.approx(math.log(kept[t]), abs=1e-6)
    tokens, logprobs = sample_next(logits[:2], 0.0, 1.0, -1, generators[:2])
    assert tokens.tolist() == [3, 3] and logprobs is None  # temperature 0: greedy



class FakeLLM:
    """vLLM's LLM.generate as the engine calls it: each sample's one token is its seed
    (or -1 without one)."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, params, use_tqdm=False):
        from types import SimpleNamespace

        self.calls.append([(r["prompt_token_ids"], p.n, p.seed, p.max_tokens)
                           for r, p in zip(requests, params)])
        return [SimpleNamespace(prompt_token_ids=r["prompt_token_ids"], outputs=[
            SimpleNamespace(token_ids=[p.seed if p.seed is not None else -1], logprobs=None,
                            finish_reason="stop", stop_reason=None) for _ in range(p.n)])
                for r, p in zip(requests, params)]


@requires_vllm
def test_vllm_on_a_gpu_asks_for_each_row_with_its_own_seed(tiny):
    """On a GPU each row is a request of its own with its seed (vLLM's n samples of one request
    would get seed, seed + 1, ...); the rows come back n per prompt in order. On a CPU: one request
    of n per prompt, the call seeded from its first row's seed."""
    from types import SimpleNamespace

    engine = VLLMEngine.__new__(VLLMEngine)  # no engine start: the request plumbing only
    engine.llm, engine.group, engine.stop = FakeLLM(), None, [0]
    engine.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids))
    engine.per_request_seed = True
    groups = engine.generate([[1, 2], [3]], 2, seeds=[101, 102, 103, 104], temperature=1.0,
                             top_p=1.0, top_k=-1, max_tokens=[5, 6])
    assert engine.llm.calls[-1] == [([1, 2], 1, 101, 5), ([1, 2], 1, 102, 5), ([3], 1, 103, 6),
                                    ([3], 1, 104, 6)]
    assert [[(c.prompt_ids, c.completion_ids) for c in g] for g in groups] == [
        [([1, 2], [101]), ([1, 2], [102])], [([3], [103]), ([3], [104])]]
    engine.per_request_seed = False
    groups = engine.generate([[1, 2], [3]], 2, seeds=[101, 102, 103, 104], temperature=1.0,
                             top_p=1.0, top_k=-1, max_tokens=8)
    assert engine.llm.calls[-1] == [([1, 2], 2, None, 8), ([3], 2, None, 8)]
    assert [[c.prompt_ids for c in g] for g in groups] == [[[1, 2], [1, 2]], [[3], [3]]]
    # the CPU path seeded torch's generator from the first row's seed
    assert torch.initial_seed() == 101


def test_auto_engine_says_why_it_falls_back_to_hf(monkeypatch, capsys):
    """engine=auto takes vLLM when it imports; an installed vLLM that fails to import (a missing
    CUDA library) gives the HF engine and one line with the error's first line; without vLLM, one
    line saying it is not installed."""
    import builtins

    from infra import model_files

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise ImportError("libcudart.so.12: cannot open shared object file\nmore detail")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(model_files, "vllm_available", lambda: True)  # the package is there
    monkeypatch.setattr(builtins, "__import__", broken)
    assert model_files.auto_engine() == "hf"
    assert capsys.readouterr().out == (
        "engine=auto: vLLM is installed but does not import (ImportError: libcudart.so.12: cannot "
        "open shared object file; --engine=vllm shows it all); sampling with the HF engine\n")
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr(model_files, "vllm_available", lambda: False)
    assert model_files.auto_engine() == "hf"
    out = capsys.readouterr().out
    assert out == "engine=auto: vLLM is not installed; sampling with the HF engine\n"
    monkeypatch.setattr(model_files, "vllm_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # one that imports
    assert model_files.auto_engine() == "vllm" and capsys.readouterr().out == ""
