"""The memory one update needs (O6), estimated from a model's shape before any model loads.

    estimate_memory(cfg, shape) -> GiB by term; resident_memory, update_peak; memory_table

SHAPES holds the few config.json fields of the models the shipped run files use, so the estimate
needs no download; any other model is read from its local config.json (or, if transformers can
reach it, the hub's).
"""

import json
import os

import torch

# Logits per chunk of the fused head, by device type. Each chunk's backward reads and writes the
# whole (V, H) fp32 weight gradient: on an H200 at 2^24 logits (110 positions at V = 152k) that
# traffic takes ~5x as long as the chunk's weight-gradient matmul, at 2^27 (880 positions) about
# as long, and the chunk's few (c, V) fp32 buffers (512 MiB each) are small beside GPU memory.
# On a CPU, 2^24 (64 MiB of fp32) keeps them small beside the hidden states.
HEAD_CHUNK_LOGITS = {"cuda": 2**27}
HEAD_CHUNK_LOGITS_DEFAULT = 2**24


def head_chunk(device_type, vocab_size):
    """Positions per chunk of perf/logprobs.py's fused head (linear_logprobs_and_entropy) on a
    device type ("cuda", "cpu", ...): the chunk the update peak below is estimated with."""
    return max(1, HEAD_CHUNK_LOGITS.get(device_type, HEAD_CHUNK_LOGITS_DEFAULT) // vocab_size)


SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=1024),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "Qwen/Qwen2.5-3B-Instruct": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                                     num_hidden_layers=36, num_attention_heads=16,
                                     num_key_value_heads=2, tie_word_embeddings=True,
                                     max_position_embeddings=32768),
    "Qwen/Qwen2.5-3B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                            tie_word_embeddings=True, max_position_embeddings=32768),  # the base
}


def model_shape(name):
    """The few config.json fields the memory estimate needs,
    or None if they cannot be read offline."""
    if name in SHAPES:
        return SHAPES[name]
    if os.path.isfile(os.path.join(name, "config.json")):
        with open(os.path.join(name, "config.json")) as f:
            return json.load(f)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name).to_dict()
    except Exception:
        # offline, no transformers, or a typo: the estimate is skipped, the load will say more
        return None


def decoder_dims(shape):
    """(hidden, key/value width, MLP width, layers, vocabulary) of a Llama/Qwen-style decoder."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    kv = h * shape.get("num_key_value_heads", heads) // heads
    return h, kv, shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]


def count_params(shape):
    """Parameters of a Llama/Qwen-style decoder from its shape (biases and norms are noise here)."""
    h, _, _, layers, v = decoder_dims(shape)
    embed = v * h * (1 if shape.get("tie_word_embeddings", False) else 2)
    return layers * layer_params(shape) + embed


def layer_params(shape):
    """One decoder layer's weights: q, o (h x h); k, v (h x kv); gate, up, down (h x i)."""
    h, kv, i, _, _ = decoder_dims(shape)
    return 2 * h * h + 2 * h * kv + 3 * h * i


def lora_params(shape, rank):
    """LoRA's A and B on each decoder layer's 7 linear layers (all-linear): rank x (in + out)."""
    h, kv, i, layers, _ = decoder_dims(shape)
    return rank * layers * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))  # q, o; k, v; gate, up, down


def layer_activation_bytes(shape, compute, casts, lora):
    """Bytes per token that one decoder layer (transformers' Llama/Qwen2, sdpa) keeps for backward.

    compute: bytes per element of the matmuls; casts: how many copies of the norm outputs autocast
    makes and keeps (one for each of q, k, v, gate and up: 5 with fp32 weights under bf16, else 0).
    """
    h, _, i, _, _ = decoder_dims(shape)
    norms = 4 * 4 * h  # the two RMSNorms keep their inputs and normalised outputs, fp32
    # sdpa's q, k, v (key/value heads repeated under a mask) and output, o_proj's input
    attention = 5 * compute * h
    mlp = 4 * compute * i  # gate, up, silu(gate), and their product that down_proj takes
    adapters = compute * (6 * h + i) if lora else 0  # LoRA's A matrices copy the 7 inputs again
    return norms + casts * compute * h + attention + mlp + adapters


def estimate_memory(cfg, shape):
    """GiB on one GPU, term by term, of what the trainer's code allocates (update_peak sums them).

    Weights count count_params; a term that grows with the micro-batch counts micro_batch_tokens
    tokens (with shared prompts a micro-batch computes fewer). An estimate to catch impossible
    settings, not a promise: the CUDA context, vLLM's leftovers and fragmentation come on top.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    sharded = cfg.parallel == "fsdp" and world > 1
    out = {**state_bytes(cfg, shape, world), **pass_bytes(cfg, shape, sharded)}
    if sharded:  # FSDP2: each rank keeps 1/world of every sharded state
        for key in ("weights", "reference", "teacher", "optimizer", "grads", "adam_step"):
            if key in out:
                out[key] /= world
    return {key: b / 2**30 for key, b in out.items()}


def state_bytes(cfg, shape, world):
    """Bytes of the weights, the reference, AdamW's state and the gradients, unsharded."""
    n = count_params(shape)
    trained = lora_params(shape, cfg.lora_rank) if cfg.lora_rank else n
    # model.load_policy: from_pretrained(dtype=torch.float32), a LoRA base too (its adapters fp32)
    out = {"weights": 4 * (n + (trained if cfg.lora_rank else 0))}
    if cfg.beta > 0 and not cfg.lora_rank and not cfg.ref_offload:  # LoRA: adapters disabled (F1)
        out["reference"] = 4 * n  # prepare.build_models: from_pretrained(dtype=torch.float32)
    if cfg.teacher and not cfg.ref_offload:  # L9: frozen in fp32 as the reference (its own shape)
        out["teacher"] = 4 * count_params(model_shape(cfg.teacher) or shape)
    out["optimizer"] = 8 * trained  # torch.optim.AdamW: exp_avg and exp_avg_sq, fp32
    out["grads"] = 4 * trained  # loss.backward(): fp32, summed over a step's micro-batches
    if cfg.parallel == "ddp" and world > 1:  # parallel.wrap: DDP keeps flat buckets to all-reduce
        out["ddp_buckets"] = 4 * trained
    # optimizer.step(): foreach AdamW's torch._foreach_sqrt(exp_avg_sqs), a parameter-sized copy
    out["adam_step"] = 4 * trained
    return out


def pass_bytes(cfg, shape, sharded):
    """Bytes one micro-batch's forward and backward add: weight copies, activations, the head."""
    h, kv, _, layers, v = decoder_dims(shape)
    tokens, bf16 = cfg.micro_batch_tokens, cfg.dtype == "bfloat16"
    compute = 2 if bf16 else 4
    out = {}
    # grpo.forward_logprobs: autocast keeps a bf16 copy of each trained weight a Linear takes until
    # the pass ends (the fused head casts its own, in "head"). FSDP2 gathers the weights in the
    # compute dtype instead: the root (embeddings, head) and two decoder layers at a time
    if sharded:
        root = v * h * (1 if shape.get("tie_word_embeddings", False) else 2)
        out["weight_copies"] = compute * (root + 2 * layer_params(shape))
    elif bf16 and cfg.lora_rank:  # the frozen base is cast op by op, not kept
        out["weight_copies"] = 2 * lora_params(shape, cfg.lora_rank)
    elif bf16:
        head = 0 if cfg.fused_logprobs else v * h
        out["weight_copies"] = 2 * (layers * layer_params(shape) + head)
    else:
        out["weight_copies"] = 0
    residual = 2 if sharded and bf16 else 4  # fp32 beside fp32 weights; bf16 from FSDP2's bf16
    casts = 5 if bf16 and not sharded else 0
    layer = layer_activation_bytes(shape, compute, casts, cfg.lora_rank > 0) * tokens
    if cfg.gradient_checkpointing:  # every layer's input, and one layer recomputed in backward
        out["activations"] = residual * h * layers * tokens + layer
    else:
        out["activations"] = layers * layer
    # perf.shared_prompt.PromptCache: each layer's prompt keys and values, whole pass
    if cfg.shared_prompt:
        out["activations"] += 2 * kv * compute * layers * tokens
    out["head"] = head_bytes(cfg, v, h, tokens, compute, copy=bf16 and not sharded)
    return out


def head_bytes(cfg, v, h, tokens, compute, copy):
    """Bytes of the output layer's pass: the fused head's, or the logits and their gradient."""
    if not cfg.fused_logprobs:  # model.sequence_logprobs
        # the (b, T, V) logits kept for backward, their gradient, and the fp32 buffers of
        # perf.logprobs._LogprobsEntropy's chunk of 1024 positions
        return 2 * compute * tokens * v + 12 * min(tokens, 1024) * v
    # perf.logprobs._LinearLogprobsEntropy.backward: weight.to(compute dtype) (copy: fp32 weights
    # under autocast), the fp32 grad_weight, and per chunk three fp32 (chunk, V) buffers and one in
    # the compute dtype, the previous chunk's still held while the next chunk's logits are made
    chunk = min(tokens, head_chunk("cuda", v))
    return (compute * v * h if copy else 0) + 4 * v * h + (12 + compute) * chunk * v


def resident_memory(est):
    """GiB the trainer holds between steps, beside the awake vLLM engine: weights, reference,
    teacher, AdamW's moments (and DDP's buckets)."""
    buckets = est.get("ddp_buckets", 0.0)
    frozen = est.get("reference", 0.0) + est.get("teacher", 0.0)
    return est["weights"] + frozen + est["optimizer"] + buckets


def update_peak(est):
    """GiB at the update's peak: the resident state and the gradients, plus the larger of the
    optimizer step's temporary and one micro-batch's pass (weight copies + activations + head).
    The forward's weight copies and the backward's head gradient are counted together, a slight
    over-estimate that stands in for one layer's activation gradients, which no term counts."""
    micro_batch = est["weight_copies"] + est["activations"] + est["head"]
    return resident_memory(est) + est["grads"] + max(est["adam_step"], micro_batch)


MEMORY_TERMS = {  # what each term of estimate_memory counts, for the table pre-flight prints
    "weights": "fp32 master weights (model.load_policy)",
    "reference": "fp32 frozen reference (prepare.build_models)",
    "teacher": "fp32 frozen teacher of on-policy distillation (prepare.load_teacher)",
    "optimizer": "AdamW's two fp32 moments",
    "grads": "fp32 gradients, summed over the micro-batches",
    "ddp_buckets": "DDP's flat gradient buckets",
    "adam_step": "AdamW's foreach step: one parameter-sized temporary",
    "weight_copies": "autocast's bf16 weights (one process) or FSDP2's gathered layers",
    "activations": "layer inputs (checkpointing), one layer's saved tensors, prompt keys/values",
    "head": "fused head: weight copy, gradient, chunks; or the logits and their gradient",
}


def memory_table(cfg, est):
    """The estimate as pre-flight prints it: a line per term, the resident state, the peak."""
    tokens = cfg.micro_batch_tokens
    lines = [f"pre-flight memory (GiB a GPU), {cfg.model}, micro_batch_tokens {tokens}:"]
    lines += [f"  {key:14s}{value:7.2f}  {MEMORY_TERMS[key]}" for key, value in est.items()]
    lines.append(f"  {'resident':14s}{resident_memory(est):7.2f}  weights + reference, teacher + "
                 f"optimizer (+ buckets), between steps")
    lines.append(f"  {'update peak':14s}{update_peak(est):7.2f}  resident + grads + max(adam_step, "
                 f"weight_copies + activations + head)")
    return "\n".join(lines)


def device_memory_gib(device_gb=None):
    """Total memory of the GPU to plan against: device_gb if given, else this machine's first
    GPU's, or None on a CPU-only machine."""
    if device_gb:
        return device_gb
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return None
