"""Models: load the policy and its tokenizer, LoRA, the weights to push, the trainer's forward.

The policy keeps fp32 master weights; compute runs in cfg.dtype under autocast (see grpo.py), so a
learning rate of 1e-6 is not rounded away as it would be in bf16 weights.
"""

import os

import torch

from infra.model_files import build_tiny, convert_smollm2
from loss import token_logprobs
from perf import cpu, logprobs


def model_path(cfg, name=None):
    """The folder (or hub name) the weights of `name` (default: cfg.model) come from: "tiny" is
    built into out_dir, "smollm2-135m" converted once (infra/model_files.py)."""
    name = name or cfg.model
    if name == "tiny":
        return build_tiny(os.path.join(cfg.out_dir, "tiny_model"), seed=cfg.seed)
    if name == "smollm2-135m":
        cache = os.path.expanduser(os.environ.get("GRPO_CACHE", "~/.cache/grpo"))
        return convert_smollm2(os.path.join(cache, "SmolLM2-135M-Instruct-f32"))
    return name


def load_tokenizer(cfg, path):
    """The model's tokenizer, with chat_template's Jinja file in place of its own template (saved
    with every checkpoint) and a pad token (its EOS where it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if cfg.chat_template:
        with open(cfg.chat_template) as f:
            tokenizer.chat_template = f.read()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg, path, device, adapter=None):
    """(tokenizer, policy) in fp32 on `device`; LoRA-wrapped when cfg.lora_rank > 0 (O5)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(cfg, path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    disable_dropout(policy)
    sdpa_off_cudnn(device)
    if torch.device(device).type == "cpu":  # exact; a decoding step ~7x faster there (perf/cpu.py)
        cpu.grouped_heads(policy)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if cfg.lora_rank:
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter:  # resuming: the trained adapter from a checkpoint
            policy = PeftModel.from_pretrained(policy, adapter, is_trainable=True)
        else:
            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                              target_modules="all-linear")
            policy = get_peft_model(policy, lora)
    return tokenizer, policy


def load_reference(path, device, offload=False):
    """The frozen reference policy (F1), fp32, on `device` or on the CPU between uses (offload)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        cpu.grouped_heads(ref)
    return ref.to("cpu" if offload else device)


def sdpa_off_cudnn(device):
    """On CUDA, keep PyTorch's SDPA off its cuDNN backend (the other backends stay).

    With a mask, a key length of 64 mod 128 and a very negative logsumexp, cuDNN's backward returns
    NaN on H100/H200 (pytorch issue 196678, since torch 2.11; Qwen2.5's heads hit it). The trainer
    passes masks in padded rows and in both shared-prompt passes, and vLLM pins a torch without the
    fix. The setting is process-wide: the reference model gets it too.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def disable_dropout(model):
    """No dropout in the policy (TRL's disable_dropout): with it, the trainer's logprobs of a batch
    are not the sampler's, and the detached-logprob shortcut for the old policy (num_iterations = 1)
    no longer holds."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        # HF attention takes it as a float
        if isinstance(getattr(module, "attention_dropout", None), float):
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
    """Full tensors of one bucket: DTensor shards are all-gathered, plain tensors pass as is."""
    return [(name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in bucket]


# ---------------------------------------------------------------- the trainer's forward


def sequence_logprobs(model, ids, temperature, cfg, **inputs):
    """(logprobs, entropy), each (b, T-1) fp32, of the tokens ids[:, 1:], from one forward over ids.

    The plain path is loss.token_logprobs on the logits; cfg.fused_logprobs and cfg.chunked_logprobs
    give the same numbers without a (b, T, V) fp32 tensor (perf/logprobs.py).
    """
    if cfg.fused_logprobs:  # L6: no logits at all; the output layer returns log p and the entropy
        return logprobs.fused_sequence_logprobs(model, ids, temperature, **inputs)
    logits = model(input_ids=ids, **inputs).logits  # (b, T, V)
    if cfg.chunked_logprobs:  # L6: fp32 one chunk of positions at a time, in forward and backward
        return logprobs.chunked_sequence_logprobs(logits, ids, temperature)
    return token_logprobs(logits[:, :-1], ids[:, 1:], temperature)


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


