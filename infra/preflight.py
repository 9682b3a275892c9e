"""Pre-flight (O6): the checks that run before any model loads: the memory one update needs
(memory.py's estimate) against the device, the KV cache against free RAM, a prompt and its
completion against the model's context.

    python -m infra.preflight --config config/countdown_3b.py  # the config, the estimate by term
    python -m infra.preflight --config config/countdown_3b.py --device_memory_gb=80  # and the fit

Where the weights come from (the folders built here, the hub, the engine): model_files.py.
"""

import argparse
import dataclasses
import os
import sys

from config import ConfigError, config_from_argv, on_gpu
from infra.memory import (
    device_memory_gib,
    estimate_memory,
    memory_table,
    model_shape,
    resident_memory,
    update_peak,
)
from infra.model_files import vllm_available

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
    vllm = cfg.engine == "vllm" or (cfg.engine == "auto" and vllm_available())
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


def preflight(cfg, device_gb=None):
    """O6: fail if the KV cache, a prompt and its completion, one update or the vLLM share cannot
    fit; print the memory estimate. device_gb: a GPU's GiB to plan against
    (`python -m infra.preflight --device_memory_gb=80`); None: this machine's GPU, if it has one."""
    check_cache_switch(cfg)
    check_kv_cache(cfg)
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"pre-flight: cannot read {cfg.model}'s config.json offline; memory estimate skipped")
        return None
    check_context(cfg, shape)
    est = estimate_memory(cfg, shape)
    total = device_memory_gib(device_gb)
    resident, update = resident_memory(est), update_peak(est)
    if total is None:
        if update > CPU_RUN_GIB and cfg.device != "cpu":
            print(memory_table(cfg, est))
            raise ConfigError(
                f"this run's update needs ~{update:.0f} GiB: it is sized for a GPU, and there is "
                "none here. To run it on the CPU anyway (slowly), pass --device=cpu; `python "
                "grpo.py` is the CPU-sized run")
        # no device to fit: one line (python -m infra.preflight --config X prints the whole table)
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


def gib(text):
    """--device_memory_gb's value: a GPU's size in GiB, finite and above 0."""
    size = float(text)
    if not 0 < size < float("inf"):
        raise ValueError(text)
    return size


if __name__ == "__main__":  # python -m infra.preflight --config RUN_FILE [--device_memory_gb=80]
    # a GPU this machine lacks; allow_abbrev off: --device=cpu is a setting, not this flag cut short
    plan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    plan.add_argument("--device_memory_gb", type=gib, default=None)
    args, argv = plan.parse_known_args(sys.argv[1:])
    try:
        cfg = config_from_argv(argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    for f in dataclasses.fields(cfg):
        print(f"{f.name:24s} = {getattr(cfg, f.name)!r}")
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"cannot read {cfg.model}'s config.json")
    elif device_memory_gib(args.device_memory_gb) is None:  # no GPU here, none named: the table
        print(memory_table(cfg, estimate_memory(cfg, shape)))
    else:
        try:
            preflight(cfg, args.device_memory_gb)
        except ConfigError as e:
            print(f"config error: {e}")
            sys.exit(1)
