"""Pre-flight (O6): the checks that run before any model loads. config.validate has refused the
settings that cannot work anywhere; here: what this machine lacks for them (check_run: a GPU, a
logger's package, a writable out_dir), settings that run but mislead (warned), and the memory one
update needs (memory.py's estimate) against the device, the KV cache against free RAM, a prompt and
its completion against the model's context (preflight).

    python -m infra.preflight --config config/countdown_3b.py  # the config, the estimate by term
    python -m infra.preflight --config config/countdown_3b.py --device_memory_gb=80  # and the fit

Where the weights come from (the folders built here, the hub, the engine): model_files.py.
"""

import argparse
import dataclasses
import importlib.util
import os
import sys
import warnings

from config import LR_USUAL, ConfigError, config_from_argv, need, on_gpu, reporters
from infra.memory import (
    count_params,
    decoder_dims,
    device_memory_gib,
    estimate_memory,
    memory_table,
    model_shape,
    resident_memory,
    update_peak,
)
from infra.model_files import vllm_available


def check_run(cfg):
    """What a run of `cfg` needs of this machine (out_dir, check_machine), and the settings that run
    but do not do what their names suggest (warn_misleading). Returns cfg."""
    check_out_dir(cfg.out_dir)
    check_machine(cfg)
    warn_misleading(cfg)
    return cfg


def check_out_dir(path):
    """out_dir is a folder, or one that can be made: not empty, not a file, a writable parent."""
    need(path.strip(), "out_dir is empty; name the run's folder (metrics, samples, checkpoints), "
                       "e.g. out/myrun")
    need(not os.path.exists(path) or os.path.isdir(path),
         f"out_dir={path!r} is a file, not a folder; choose another out_dir")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the folder that makedirs would create the rest under
        parent = os.path.dirname(parent)
    why = "is a file" if not os.path.isdir(parent) else "is not writable"
    need(os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK),
         f"out_dir={path!r} cannot be created: {parent} {why}; choose another")


def check_machine(cfg):
    """Settings that ask this machine for what it lacks: a GPU, the wandb or tensorboard package."""
    import torch

    need(cfg.device != "cuda" or torch.cuda.is_available(),
         "device='cuda', but torch sees no CUDA GPU here; use --device=cpu or auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    need(not (cfg.async_rollouts and on_gpu) or torch.cuda.device_count() > world,
         f"async_rollouts on GPUs: the sampler takes the GPU after the {world} trainer rank(s), "
         f"and this machine has {torch.cuda.device_count()}; run one rank fewer")
    for package in reporters(cfg.report_to):
        need(importlib.util.find_spec(package) is not None,
             f"report_to={cfg.report_to!r} needs the {package} package: pip install {package}, "
             "or leave it out of report_to (metrics.jsonl has every metric)")


def warn_misleading(cfg):
    """Settings that run but do not do what their name suggests: warn, saying what to change."""
    if cfg.tools and any("\\n" in tag for tag in cfg.tool_tags):  # the shell took the quotes
        warnings.warn(f"tool_tags={cfg.tool_tags!r} hold a backslash and an n, not a newline, so "
                      "the model's calls may never match; on a command line quote the tags: "
                      """--tool_tags='"```python\\n","\\n```\\n"'""")
    if cfg.ratio_level == "sequence":  # L8, GSPO
        if cfg.loss_agg == "token-mean":
            warnings.warn("ratio_level='sequence' (GSPO) with loss_agg='token-mean' weighs each "
                          "completion by its length; GSPO averages per sequence: set "
                          "loss_agg='seq-mean'")
        if cfg.clip_eps > 0.01:
            warnings.warn(f"ratio_level='sequence' with clip_eps={cfg.clip_eps}: a geometric-mean "
                          "ratio almost never leaves 1 +- 0.2, so nothing is clipped; GSPO uses "
                          "clip_eps=3e-4, clip_eps_high=4e-4")
        if cfg.num_iterations == 1 and cfg.mini_batches == 1:
            warnings.warn("ratio_level='sequence' with num_iterations=1: every ratio is exactly 1, "
                          "so the gradient equals the token-level one; GSPO differs only when "
                          "num_iterations > 1 or mini_batches > 1")
    variant = []  # the settings that act only through a ratio != 1
    if cfg.policy_loss != "clip":
        variant.append(f"policy_loss={cfg.policy_loss!r}")
    if cfg.dual_clip:
        variant.append(f"dual_clip={cfg.dual_clip}")
    if variant and cfg.num_iterations == 1 and cfg.mini_batches == 1:  # L1, L7
        warnings.warn(f"{', '.join(variant)} with one optimizer step per batch: every ratio is "
                      "exactly 1, where CISPO, SAPO, GPG and dual-clip all give GRPO's gradient; "
                      "they differ from the second step on a batch on (num_iterations > 1 or "
                      "mini_batches > 1)")
    if cfg.async_rollouts and cfg.is_correction == "off" and cfg.old_logprobs == "recompute":
        warnings.warn(f"async_rollouts: each batch comes from weights up to {cfg.max_staleness} "
                      "update(s) old and nothing corrects for it (R8); set "
                      "is_correction=token_truncate (TIS; token_mask with is_floor=0.5 for "
                      "IcePop's band) or sequence_mask, or old_logprobs=sampler")
    if cfg.old_logprobs == "sampler" and cfg.is_correction.endswith("_truncate"):
        warnings.warn("old_logprobs=sampler puts q in the ratio already; a truncated IS weight "
                      "pi_old / q on top counts the gap twice: use is_correction=token_mask or "
                      "sequence_mask (a band), or off")
    if not LR_USUAL[0] <= cfg.lr <= LR_USUAL[1]:  # O1: an AdamW step moves each weight by ~lr
        warnings.warn(f"lr={cfg.lr:g} is far outside the usual range ({LR_USUAL[0]:g} to "
                      f"{LR_USUAL[1]:g}; 1e-6 to 1e-5 for full fine-tuning of a 1-8B model): the "
                      "first update may destroy the model, or none may move it")
    if cfg.top_p < 1 or cfg.top_k > 0:
        warnings.warn(f"top_p={cfg.top_p}, top_k={cfg.top_k}: the sampler's logprobs are "
                      "renormalised over the kept tokens while the trainer's are over the whole "
                      "vocabulary, so the two sides of the ratio (and the parity metric) differ by "
                      "construction; use top_p=1, top_k=-1 for GRPO (R5)")


# ---------------------------------------------------------------- memory


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


def shared_memory_gib():
    """GiB free in /dev/shm, where torch puts shared tensors on Linux; None where there is none."""
    try:
        fs = os.statvfs("/dev/shm")
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize / 2**30


def check_weight_ring(cfg, shape):
    """async_rollouts (R8) keeps max_staleness + 1 fp32 copies of the pushed weights in shared
    memory (run/async_rollouts.py's ring): they must fit in free RAM and in /dev/shm."""
    if not cfg.async_rollouts:
        return
    h, _, _, _, v = decoder_dims(shape)
    # pushed as the engine loads them: a tied lm_head is a tensor of its own (model.py)
    pushed = count_params(shape) + (v * h if shape.get("tie_word_embeddings", False) else 0)
    size = (cfg.max_staleness + 1) * pushed * 4 / 2**30
    free = [gib for gib in (available_memory_gib(), shared_memory_gib()) if gib is not None]
    if free and size > min(free):
        raise ConfigError(f"async_rollouts with max_staleness={cfg.max_staleness} keeps "
                          f"{cfg.max_staleness + 1} fp32 copies of the {pushed / 1e6:.0f}M weights "
                          f"in shared memory, {size:.1f} GiB, and this machine has "
                          f"{min(free):.1f} GiB free (RAM and /dev/shm); lower max_staleness "
                          "(1 keeps the sampler one step ahead)")


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
    """O6: fail if the KV cache, a prompt and its completion, async_rollouts' weight ring, one
    update or the vLLM share cannot fit; print the memory estimate. device_gb: a GPU's GiB to plan
    against (`python -m infra.preflight --device_memory_gb=80`); None: this machine's GPU."""
    check_cache_switch(cfg)
    check_kv_cache(cfg)
    shape = model_shape(cfg.model)
    if shape is None:
        print(f"pre-flight: cannot read {cfg.model}'s config.json offline; memory estimate skipped")
        return None
    check_context(cfg, shape)
    check_weight_ring(cfg, shape)
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
        check_run(cfg)
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
