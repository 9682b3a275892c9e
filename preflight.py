"""Pre-flight (SPEC O6): the memory an update needs, estimated before any model loads, against the device.

    python config.py --config config/countdown_3b.py   # prints the final config and this estimate

SHAPES holds the few config.json fields of the models the shipped run files use, so the estimate
needs no download; any other model is read from its local config.json.
"""

import importlib.util
import json
import os

from config import ConfigError, on_gpu

# Shapes of the models the shipped run files use, so pre-flight needs no download.
# Any other model is read from its local config.json (or, if transformers can reach it, the hub).
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "Qwen/Qwen2.5-3B-Instruct": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                                     num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                     tie_word_embeddings=True, max_position_embeddings=32768),
    "Qwen/Qwen2.5-3B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                            num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                            max_position_embeddings=32768),  # the base
}


def model_shape(name):
    """The few config.json fields the memory estimate needs, or None if they cannot be read offline."""
    if name in SHAPES:
        return SHAPES[name]
    if os.path.isfile(os.path.join(name, "config.json")):
        with open(os.path.join(name, "config.json")) as f:
            return json.load(f)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name).to_dict()
    except Exception:  # offline, no transformers, or a typo: the estimate is skipped, the load will say more
        return None


def count_params(shape):
    """Parameters of a Llama/Qwen-style decoder from its shape (biases and norms are noise here)."""
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h * shape.get("num_key_value_heads", shape["num_attention_heads"]) // shape["num_attention_heads"]
    attn = 2 * h * h + 2 * h * kv  # q, o: h x h; k, v: h x kv (grouped-query attention)
    mlp = 3 * h * shape["intermediate_size"]  # gate, up, down
    embed = v * h * (1 if shape.get("tie_word_embeddings", False) else 2)
    return layers * (attn + mlp) + embed


def estimate_memory(cfg, shape):
    """GiB per phase on one GPU: the trainer's resident state, what an update adds, and the vLLM share.

    Weights stay fp32 (master copy) and compute runs in cfg.dtype under autocast: with a lr of 1e-6
    a bf16 weight would round most updates away. AdamW keeps two fp32 moments per trained param.
    Activations per token per layer ~34 x hidden bytes at 16 bits (Korthikanti et al. 2022, flash
    attention), or 2 x hidden with gradient checkpointing plus one layer recomputed. These are
    estimates to catch impossible settings, not a promise.
    """
    gib = 2**30
    n = count_params(shape)
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    act_bytes = 2 if cfg.dtype == "bfloat16" else 4
    trained = n if cfg.lora_rank == 0 else 2 * cfg.lora_rank * h * 7 * layers  # LoRA on the 7 linear layers
    weight_bytes = 4 if cfg.lora_rank == 0 else act_bytes  # a frozen LoRA base needs no fp32 master
    out = {"weights": weight_bytes * n / gib, "optimizer": 8 * trained / gib, "grads": 4 * trained / gib}
    per_layer = 2 * h if cfg.gradient_checkpointing else 17 * h  # 17 x hidden elements at 2 bytes = 34 h bytes
    recompute = 17 * h * cfg.micro_batch_tokens if cfg.gradient_checkpointing else 0
    logits = cfg.micro_batch_tokens * v * (2 * act_bytes)  # logits and their grad; fp32 only per chunk (L6)
    if cfg.fused_logprobs:  # no logits at all: one chunk of ~2^26 fp32 logits, its softmax and its gradient
        logits = 3 * 4 * min(cfg.micro_batch_tokens, max(1, 2**26 // v)) * v
    out["activations"] = (act_bytes * (per_layer * layers * cfg.micro_batch_tokens + recompute) + logits) / gib
    if cfg.beta > 0 and cfg.lora_rank == 0:
        out["reference"] = act_bytes * n / gib  # a frozen copy in compute dtype (can be offloaded, F1)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if cfg.parallel == "fsdp" and world > 1:  # each rank keeps 1/world of every sharded state (one layer gathered)
        out = {k: v / world if k in ("weights", "optimizer", "grads", "reference") else v for k, v in out.items()}
    return out


def device_memory_gib(cfg):
    """Total memory of the GPU to plan against, or None on a CPU-only machine."""
    if cfg.device_memory_gb:
        return cfg.device_memory_gb
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except ImportError:
        pass
    return None


CPU_RUN_GIB = 16  # O6: an update estimated above this, with no GPU, needs an explicit --device=cpu


def available_memory_gib():
    """GiB this machine can give now (MemAvailable in /proc/meminfo); None where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib / 2**20


def check_kv_cache(cfg):
    """On a CPU, vLLM takes vllm_cpu_kv_cache_gb of RAM for its KV cache as it starts: it must be
    free."""
    installed = importlib.util.find_spec("vllm") is not None
    vllm = cfg.engine == "vllm" or (cfg.engine == "auto" and installed)
    # a VLLM_CPU_KVCACHE_SPACE set by hand wins over the setting (rollout.py)
    if not vllm or on_gpu(cfg) or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    free = available_memory_gib()
    if free is not None and cfg.vllm_cpu_kv_cache_gb > free:
        raise ConfigError(f"vllm_cpu_kv_cache_gb={cfg.vllm_cpu_kv_cache_gb}: vLLM takes that many "
                          f"GiB of RAM for its KV cache, and this machine has {free:.1f} GiB free; "
                          "lower it (1 holds the default run's cache) or use --engine=hf")


def check_context(cfg, shape):
    """A prompt and its completion fit in the model's context (max_position_embeddings)."""
    limit = shape.get("max_position_embeddings")
    longest = cfg.max_prompt_len + cfg.max_completion_len
    if limit and longest > limit:
        raise ConfigError(f"max_prompt_len + max_completion_len = {cfg.max_prompt_len} + "
                          f"{cfg.max_completion_len} = {longest} tokens, beyond {cfg.model}'s "
                          f"context of {limit} (max_position_embeddings in its config.json); "
                          "lower them")


def preflight(cfg):
    """O6: fail if the KV cache, a prompt and its completion, one update or the vLLM share cannot
    fit; print the memory estimate."""
    check_kv_cache(cfg)
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"pre-flight: cannot read {cfg.model}'s config.json offline; memory estimate skipped")
        return None
    check_context(cfg, shape)
    est = estimate_memory(cfg, shape)
    total = device_memory_gib(cfg)
    resident = est["weights"] + est["optimizer"] + est.get("reference", 0.0)
    update = resident + est["grads"] + est["activations"]
    print("pre-flight memory estimate (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in est.items()))
    if total is None:
        if update > CPU_RUN_GIB and cfg.device != "cpu":
            raise ConfigError(
                f"this run's update needs ~{update:.0f} GiB: it is sized for a GPU, and there is none here. "
                f"To run it on the CPU anyway (slowly), pass --device=cpu; `python grpo.py` is the CPU-sized run")
        print(f"pre-flight: update peak ~{update:.2f} GiB; no GPU here, so no fit check")
        return est
    vllm = cfg.gpu_memory_utilization * total
    print(f"pre-flight: device {total:.1f} GiB | update peak {update:.1f} | vLLM share {vllm:.1f} "
          f"+ resident {resident:.1f}")
    if update > 0.95 * total:
        fixes = [f"lower micro_batch_tokens (now {cfg.micro_batch_tokens})"]
        fixes += [] if cfg.gradient_checkpointing else ["set gradient_checkpointing=True"]
        fixes += [] if cfg.lora_rank else ["set lora_rank=16"]
        raise ConfigError(f"one update needs ~{update:.1f} GiB of {total:.1f}: " + " or ".join(fixes))
    if vllm + resident > 0.95 * total:
        raise ConfigError(
            f"the vLLM share ({vllm:.1f} GiB) and the trainer's resident weights and optimizer "
            f"({resident:.1f} GiB) exceed {total:.1f} GiB: lower gpu_memory_utilization or use lora_rank > 0"
        )
    return est
