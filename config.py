"""Every setting of the project, in one flat dataclass, plus run-file loading and validation.

A run file in config/ is plain Python that assigns names, e.g. `group_size = 16`. It is loaded
first, then `--key=value` overrides from the command line; both are checked against the fields
below and the task file's own settings, its OPTIONS (unknown names fail and suggest the closest
one; values are parsed to the default's type).

This file imports nothing from the project: every module reads its settings from here. The checks
that need other modules (the task file, the model's shape, the memory estimate) run in pre-flight.
"""

import ast
import dataclasses
import difflib
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass, field


@dataclass
class Config:
    """Every setting. The defaults are `python grpo.py`: SmolLM2-135M-Instruct learning 2-digit
    addition in 5-7 minutes on 2 CPU cores; a run file in config/ sets only what differs."""

    # ---- run ----
    model: str = "smollm2-135m"  # HF name or folder; default: SmolLM2-135M-Instruct; "tiny": tests
    chat_template: str = ""  # a Jinja file in place of the tokenizer's chat template; "" = its own
    out_dir: str = "out/default"  # metrics, samples and checkpoints go here
    seed: int = 1337  # one seed for data order, sampling and init (D3)
    max_steps: int = 30  # training steps, a batch each; also the length of the LR schedule (O1)
    engine: str = "auto"  # R1: "vllm" | "hf" (transformers generate) | "auto": vllm where installed
    device: str = "auto"  # "cuda" | "cpu" | "auto" = cuda when available
    resume: bool = False  # go on from out_dir's newest whole checkpoint: same prompts, same metrics
    resume_changed: bool = False  # resume though checkpoint.RUN_SETTINGS changed; False: refuse
    init_from: str = ""  # start from these weights (HF or ckpt_* folder), not `model`; "" = model
    eval_only: bool = False  # M2: evaluate on the test split, append to out_dir/eval.jsonl, exit
    save_every: int = 10  # checkpoint every N steps (and always at the end); 0 = only at the end
    keep_checkpoints: int = 2  # keep the newest K checkpoint folders
    eval_every: int = 10  # M2: eval at step 0 (the base), every N steps, at the end; 0 = end only
    eval_n: int = 4  # M2: samples per eval problem at training temperature: avg@n pass@k maj@n
    eval_in_run_sampled: bool = False  # M2: the evals before the last sample too; False: greedy
    eval_tasks: str = ""  # M2: more eval sets, e.g. "gsm8k_test.jsonl,tasks/larger.py"; "" = none
    sample_every: int = 10  # W6: dump whole groups to out_dir/samples.jsonl every N steps; 0 = off
    sample_groups: int = 2  # W6: groups per dump
    report_to: str = "none"  # M1: more loggers, TRL's names: "wandb", "tensorboard", both, "all"

    # ---- task and data (D1-D3) ----
    task: str = "math"  # D1: tasks/'s (math, countdown, code, ...), a .py file or a data file
    # D4: a weighted mixture, "math:0.7,countdown:0.3" (a run file's dict too), each its own task
    data_path: str = ""  # D1: problems from .jsonl/.parquet/.csv, a datasets folder, or a hub name
    data_name: str = ""  # D1: the hub dataset's config name (GSM8K: "main"); "" = its default
    data_columns: str = ""  # D1: rename columns "old:new,...", e.g. "question:prompt"; "" = none
    data_seed: int = 0  # D1: seeds the problem generators: the same train/test problems every run
    train_size: int = 500  # training problems: generated, or the dataset's train split's first
    test_size: int = 60  # held-out problems for eval (M2); the splits never overlap (data/split.py)
    # a task's own settings (countdown_numbers, math_kinds, ...): its file's OPTIONS, task_options
    curriculum: bool = False  # D2: easy:medium:hard 1:2:3 (pass rate > 0.8, 0.2-0.8, < 0.2)
    curriculum_ramp_steps: int = 100  # D2: steps over which the hard share ramps up to its weight

    # ---- rewards (W2, W3) ----
    wrong_penalty: float = 0.0  # W2: added to a parsed but wrong answer (small, e.g. -0.1); 0 = off
    unparsed_penalty: float = -0.2  # W2: added to no well-formed answer (larger, -0.5); 0 = off
    length_soft_limit: int = 0  # W3: past this many completion tokens, -0.05 per 32 begun; 0 = off
    length_min: int = 0  # W3: completions shorter than this many tokens score 0; 0 = off
    length_reward: float = 0.0  # W3: times Kimi k1.5's length reward (short right answers); 0 = off
    # "correct" (a right answer; code: tests passed) weighs 1, "format" 0.1, a task's own WEIGHTS
    reward_weights: str = ""  # W2: "name:weight,..." of the reward's components (TRL's, by name)
    reward_timeout: float = 10.0  # seconds a reward may run, else 0 (reward/errors); 0 = no limit
    reward_workers: int = 0  # score in N child processes (code rewards wait on sandboxes); 0 = one

    # ---- batch (R3, O3) ----
    group_size: int = 4  # R3: G completions per prompt (TRL num_generations, verl rollout.n); >= 2
    batch_size: int = 128  # R3: completions a step: prompts a step x group_size (a multiple of it)
    max_prompt_len: int = 256  # prompt tokens; longer prompts are an error, not silently cut
    max_completion_len: int = 64  # R6: sampled tokens per completion (TRL max_completion_length)
    micro_batch_tokens: int = 2048  # O3: token budget (prompt + completion) of one micro-batch
    shared_prompt: bool = True  # prompts once a pass, not G times (Prefix Grouper); False = padded
    skip_zero_gradient: bool = True  # O3: rows with a zero gradient get no pass; False = all; exact
    tail_runs: bool = True  # O3: completions in runs of like length (shared_prompt, 1 rank); exact
    fused_logprobs: bool = False  # L6: logprobs from hidden x head in chunks, no (B, T, V) logits
    chunked_logprobs: bool = True  # L6: fp32 logprobs by chunk, exact; False = log_softmax + gather

    # ---- sampling (R1, R4, R5) ----
    temperature: float = 1.0  # R4/R5: sampling temperature, also the trainer's (TRL, verl: 1.0)
    top_p: float = 1.0  # R4: nucleus sampling; 1.0 = off
    top_k: int = -1  # R4: top-k sampling; -1 = off
    temperature_end: float = 0.0  # R4: temperature at max_steps, reached linearly; 0 = constant
    mask_truncated: bool = False  # R6: truncated completions get no loss; False = train on them
    dynamic_sampling: bool = False  # R7: drop equal-reward groups; refill with new prompts (DAPO)
    dynamic_sampling_rounds: int = 3  # R7: at most this many refill rounds per step; 0 = no refill
    gpu_memory_utilization: float = 0.4  # R1: vLLM's share of the GPU (0.3-0.5)
    vllm_cpu_kv_cache_gb: int = 1  # R1: KV cache of vLLM on a CPU (VLLM_CPU_KVCACHE_SPACE), GiB
    vllm_sleep_level: int = 2  # R1: GPU sleep: 1 offloads weights to CPU, 2 drops them; 0 = none
    # R2: pi_old / q (q: the sampler's) past the cap cut to it ("truncate", TIS) or dropped ("mask")
    is_correction: str = "off"  # R2: "token_truncate" | "token_mask" | "sequence_*" | "off"
    is_cap: float = 2.0  # R2: cap on rho, a token's or a completion's (TRL's clip_max: 3 for both)
    is_floor: float = 0.0  # R2, R8: the band's floor: below it raised (truncate) or out; 0 = none
    async_rollouts: bool = False  # R8: a sampler process makes the next batches during updates
    max_staleness: int = 1  # R8: batch t is made with the weights after t - max_staleness updates
    old_logprobs: str = "recompute"  # R8: the ratio's pi_old: the trainer's, or "sampler" (its q)

    # ---- tool calls: tools=True's Python in the text (episodes/tools.py TextTools) ----
    tools: bool = False  # a completion may run Python; its output comes back; False = one turn
    max_tool_calls: int = 2  # tool calls per completion; the turn after the last may not call
    # a tools=True call past it is killed (an error the model reads); an environment's reset or
    # step, or a TOOLS turn's calls together, past it end the episode (scoring 0)
    tool_timeout: float = 5.0  # seconds one call may run: tools=True's, or a task's environment's
    tool_output_chars: int = 500  # every tool or environment result is cut to this many characters
    # a call is the code between the two; generation stops at the second ("```python\n", "\n```\n")
    tool_tags: tuple = ("<python>", "</python>")  # a tool call's open and close tags
    tool_error_penalty: float = 0.0  # minus this per failed call (raised, timeout, killed); 0 = off
    sandbox: str = "full"  # the weakest sandbox accepted (scoring/sandbox.py), else no run

    # ---- episodes: a task file's environment(problem) or TOOLS (episodes/; tool_timeout) ----
    max_turns: int = 4  # model turns per episode; the environment answers each but the last
    tool_parser: str = ""  # TOOLS' calls: vLLM's parser (hermes, llama3_json, ...); "" = template's
    env_reward: str = "sum"  # an episode's reward: its turns' rewards summed, or the "last" one's

    # ---- advantages (A1-A3) ----
    adv_baseline: str = "mean"  # A1: "mean" of the group (GRPO) | "leave-one-out": others' (RLOO)
    adv_scale: str = "group"  # A1: / std of the "group", of the "batch" (TRL), or "none" (Dr. GRPO)
    adv_zero_std_groups: bool = False  # A2: groups with std < 1e-4 (its floor) get advantage 0
    adv_clip: float = 0.0  # A3: clamp to +-this after normalising (5 binary, 3 continuous); 0 = off
    adv_pass_k: int = 0  # A5: advantages for the best of K in a group (Pass@k Training); 0 = off
    adv_per_component: bool = False  # A6: each reward term normalised in its group, summed (GDPO)

    # ---- loss (L1-L8) ----
    clip_eps: float = 0.2  # L1: PPO clip 1 +- eps (TRL epsilon, verl clip_ratio); inert in 1 epoch
    clip_eps_high: float = 0.0  # L1: upper clip 1 + this (DAPO clip-higher, 0.28); 0 = clip_eps
    loss_agg: str = "token-mean"  # L2: "token-mean" | "seq-mean" (paper) | "dr-grpo" (sum / const)
    ratio_level: str = "token"  # L8: "token" | "sequence" (GSPO: with clip_eps ~3e-4, seq-mean)
    policy_loss: str = "clip"  # L1: "clip" (PPO, GRPO) | "cispo" | "sapo" | "gpg" (loss.grpo_loss)
    dual_clip: float = 0.0  # L1: cap a loss with A < 0 at this * |A| ("clip"; verl clip_ratio_c: 3)
    sapo_tau_pos: float = 1.0  # L1: SAPO's gate temperature for A > 0 (verl tau_pos)
    sapo_tau_neg: float = 1.05  # L1: SAPO's gate temperature for A < 0 (verl tau_neg)
    beta: float = 0.0  # L4: the KL term's weight (DeepSeek-R1: 0.001); 0 = no reference, as TRL
    kl_estimator: str = "k3"  # L4: "k3" (unbiased, low var.) | "k1" (log ratio) | "k2" (square / 2)
    entropy_coef: float = 0.0  # L5: entropy bonus 1e-4..1e-3; 0 = off (verl entropy_coeff)
    num_iterations: int = 1  # L7: epochs over a batch (TRL num_iterations); 1 = on-policy, ratio 1
    mini_batches: int = 1  # L7: steps an epoch on 1/N of the groups each (TRL steps_per_generation)
    entropy_top_quantile: float = 0.0  # L5: PG on this top share of tokens by entropy only; 0 = off
    # L9: each sampled token's advantage + distill_coef x log(p_teacher / p_student), a reverse KL
    teacher: str = ""  # L9: the teacher, a model as `model` is (a ckpt_* folder too); "" = off
    distill_coef: float = 1.0  # L9: the weight of the teacher's per-token signal

    # ---- reference model (F1) ----
    ref_offload: bool = False  # F1: keep the reference on the CPU between its once-per-batch passes
    ref_refresh_steps: int = 0  # F1: refresh the reference to the policy every N steps; 0 = never

    # ---- adaptive KL (F2) ----
    adaptive_kl: bool = False  # F2: beta x 1.2 or 0.8 as the mean KL leaves kl_band; False = fixed
    kl_window: int = 20  # F2: steps between beta updates
    kl_band: tuple = (0.01, 0.08)  # F2: mean KL below the band: beta x 0.8, above: x 1.2

    # ---- optimisation (O1, O2, O5) ----
    lr: float = 3e-5  # O1: peak AdamW lr (5e-7..1e-6 for 3B full fine-tuning; 135M takes far more)
    warmup_steps: int = 5  # O1: warm-up steps (linear; 20-50 for long runs), then cosine decay
    min_lr_ratio: float = 0.1  # O1: the cosine's floor, a share of lr; 1.0 = constant after warm-up
    weight_decay: float = 0.0  # AdamW weight decay
    # beta2 0.99, not 0.999: RL gradients shrink as groups saturate (OpenRLHF, DeepSeek: 0.95)
    adam_betas: tuple = (0.9, 0.99)  # AdamW betas (beta1, beta2)
    grad_clip: float = 1.0  # O2: clip the global grad norm to this; 0 = off
    dtype: str = "auto"  # O5: "bfloat16" | "float32" | "auto": bf16 on GPU and on a CPU with bf16
    # arithmetic (AMX, AVX-512 BF16), else fp32; the loss is fp32 either way
    gradient_checkpointing: bool = False  # O5: recompute activations: less memory, ~30% more time
    lora_rank: int = 0  # O5: LoRA rank through peft; 0 = full fine-tuning
    lora_alpha: int = 32  # O5: LoRA scale numerator (the update is scaled by lora_alpha / rank)

    # ---- several GPUs: torchrun --nproc_per_node=N grpo.py (infra/parallel.py) ----
    parallel: str = "fsdp"  # "fsdp": FSDP2, weights, grads, AdamW state sharded | "ddp": copies
    vllm_tensor_parallel: int = 1  # R1: ranks sharing a vLLM engine (big models); 1 = one per rank

    # ---- derived: computed by derive(), never set by hand ----
    prompts_per_step: int = field(default=0, init=False)  # batch_size // group_size
    shaping: dict = field(default_factory=dict, init=False)  # W2-W3 settings: shape_reward's kwargs
    component_weights: dict = field(default_factory=dict, init=False)  # reward_weights as a dict
    data_column_map: dict = field(default_factory=dict, init=False)  # data_columns as {old: new}
    # the task file's own settings: its OPTIONS, each set by name like the rest (load_config)
    task_options: dict = field(default_factory=dict, init=False)  # {name: value}, all its OPTIONS


# R2: the mean |sampler - trainer| logprob gap above which a run warns, by compute dtype: fp32 sides
# agree to ~1e-6; bf16 ones differ by rounding alone, ~0.03 (vLLM's residual stream is bf16)
PARITY_WARN = {"float32": 1e-3, "bfloat16": 0.1}

REWARD_KEYS = ("wrong_penalty", "unparsed_penalty", "length_soft_limit", "length_min")
DERIVED = {f.name for f in dataclasses.fields(Config) if not f.init}
RENAMED = {"eval_k": ("eval_n", "samples per eval problem, for avg@n, pass@k and maj@n")}
# settings deleted (dev/LOG.md says why): (their default, what to write now); checked on resume
DELETED = {
    "drop_zero_std_groups": (False, "--dynamic_sampling=true --dynamic_sampling_rounds=0"),
    "is_seq_cap": (3.0, "is_cap caps rho at either is_correction level, as TRL's clip_max"),
    "cpu_keep_memory": (True, "freed memory always stays in the process on a CPU (perf/cpu.py)"),
    "kl_up": (1.2, "adaptive KL multiplies beta by 1.2 (loss.adaptive_kl_beta's `up`)"),
    "kl_down": (0.8, "adaptive KL multiplies beta by 0.8 (loss.adaptive_kl_beta's `down`)"),
    "parity_warn": (0.0, "the sampler gap warns above config.PARITY_WARN (by compute dtype)"),
    "length_penalty_tokens": (32, "length shaping takes 0.05 per 32 tokens (shape_reward's)"),
    "length_penalty": (0.05, "shaping takes 0.05 per 32 tokens past length_soft_limit"),
    "env_timeout": (5.0, "tool_timeout is an environment's (or TOOLS') call's deadline too"),
    "adv_std_floor": (1e-4, "the std is floored at 1e-4 (advantage.STD_FLOOR); TRL adds 1e-4"),
    "format_weight": (0.1, "the format weight is --reward_weights=format:W (default 0.1)"),
    "correct_weight": (1.0, "the correct weight is --reward_weights=correct:W (default 1)"),
    "max_nonfinite": (5, "a run stops after 5 skipped updates in a row (log.MAX_NONFINITE)"),
    "push_bucket_mb": (256, "weights go to vLLM in 256 MB buckets (push_weights_iter's bucket_mb)"),
    "wandb_project": ("", "--report_to=wandb logs to the project WANDB_PROJECT names, or 'grpo'"),
    "tensorboard": (False, "--report_to=tensorboard writes its events to out_dir/tb"),
    "device_memory_gb": (0.0, "python -m infra.preflight --config X --device_memory_gb=80"),
    "curriculum_bands": ((0.2, 0.8), "curriculum: hard below pass rate 0.2, easy above 0.8"),
    "curriculum_hard_below": (0.2, "the curriculum's hard bucket is below a pass rate of 0.2"),
    "curriculum_easy_above": (0.8, "the curriculum's easy bucket is above a pass rate of 0.8"),
    "is_mode": ("truncate", "is_correction names level and action: token_truncate, ..."),
}
# deleted settings one tuple holds now, (first, second): an older run's values move there (upgrade)
MERGED = {"kl_band": ("kl_low", "kl_high"),
          "tool_tags": ("tool_open", "tool_close")}
for _now, _pair in MERGED.items():  # each old name's entry: its default, what holds it now
    _defaults = Config.__dataclass_fields__[_now].default
    DELETED.update({old: (default, f"{_now} = ({', '.join(_pair)}) holds both, e.g. "
                                   f"--{_now}='{','.join(map(str, _defaults))}'")
                    for old, default in zip(_pair, _defaults)})
CHOICES = {
    "adv_scale": ("group", "batch", "none"), "adv_baseline": ("mean", "leave-one-out"),
    "policy_loss": ("clip", "cispo", "sapo", "gpg"), "kl_estimator": ("k3", "k1", "k2"),
    "loss_agg": ("token-mean", "seq-mean", "dr-grpo"), "ratio_level": ("token", "sequence"),
    "dtype": ("auto", "bfloat16", "float32"), "engine": ("auto", "vllm", "hf"),
    "device": ("auto", "cuda", "cpu"), "vllm_sleep_level": (0, 1, 2),
    "is_correction": ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "parallel": ("fsdp", "ddp"), "sandbox": ("full", "namespaces", "none"),
    "old_logprobs": ("recompute", "sampler")}
# R4/R5: vLLM raises any temperature below this to it (lower ones give nan or inf): the trainer not
MIN_TEMPERATURE = 0.01
MAX_VLLM_TEMPERATURE = 2.0  # vLLM 0.33's SamplingParams refuse more
# O1: the learning rates pre-flight accepts without a warning (the tiny test model takes 2e-2)
LR_USUAL = (1e-8, 0.1)


class ConfigError(ValueError):
    """A setting that cannot work; the message says what to change."""


def derive(cfg):
    """Compute the derived values, once, right after loading."""
    cfg.prompts_per_step = cfg.batch_size // cfg.group_size
    cfg.shaping = {k: getattr(cfg, k) for k in REWARD_KEYS}
    cfg.component_weights = reward_weights(cfg.reward_weights)
    cfg.data_column_map = pairs("data_columns", cfg.data_columns)
    if cfg.dtype == "auto":  # O5: resolved once here: the engine, the trainer and pre-flight agree
        cfg.dtype = "bfloat16" if on_gpu(cfg) or cpu_bf16(cfg) else "float32"
    return cfg


def pairs(name, text):
    """'a:1,b:2' -> {"a": "1", "b": "2"}; anything else is a ConfigError naming the setting."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{name}={text!r} must look like key:value,key:value")
        out[key.strip()] = value.strip()
    return out


REPORTERS = ("wandb", "tensorboard")  # M1: the loggers report_to may name


def reporters(text):
    """report_to's loggers: TRL's names ("none"; "all": those installed, as transformers reads it),
    several joined by commas."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["all"]:
        return tuple(name for name in REPORTERS if importlib.util.find_spec(name) is not None)
    unknown = [name for name in names if name not in REPORTERS + ("none",)]
    need(not unknown and ("none" not in names or names == ["none"]),
         f"report_to={text!r}: name loggers from {', '.join(REPORTERS)} (comma-separated), "
         "or 'all', or 'none'")
    return tuple(name for name in dict.fromkeys(names) if name != "none")


def task_parts(task):
    """D4: a mixture's tasks and weights, "math:0.7,countdown:0.3" -> {"math": 0.7, "countdown":
    0.3}; one task (no ':') -> {task: 1.0}."""
    out = {}
    for name, value in (pairs("task", task) if ":" in task else {task: "1"}).items():
        try:
            out[name] = float(value)
        except ValueError:
            out[name] = -1.0
        need(math.isfinite(out[name]) and out[name] > 0,
             f"task={task!r}: {name}:{value}: a weight must be a positive number")
    return out


def reward_weights(text):
    """reward_weights' 'name:w,...' as {name: float}, each a number and a component's weight."""
    weights = pairs("reward_weights", text)
    if "parsed" in weights:
        raise ConfigError("reward_weights: parsed has no weight; it picks wrong_penalty (a "
                          "parsed, wrong answer) or unparsed_penalty: set those")
    out = {}
    for key, value in weights.items():
        try:
            out[key] = float(value)
        except ValueError:
            raise ConfigError(f"reward_weights: {key}:{value} is not a number") from None
    return out


def cpu_bf16(cfg):
    """True if the run computes on a CPU that does bf16 arithmetic itself (AMX, or AVX-512 with its
    bf16 instructions): there a bf16 matmul is ~8x an fp32 one (~2.2 against ~0.26 TFLOP/s on a
    2-core AMX VM); elsewhere PyTorch emulates bf16, ~6x slower than fp32, so "auto" keeps fp32.
    torch.cpu's probes have private names, hence the getattr: a build without them answers False."""
    if cfg.device == "cuda":
        return False
    import torch

    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def on_gpu(cfg):
    """True if the run will compute on a GPU (device "cuda", or "auto" with one present)."""
    if cfg.device == "cpu":
        return False
    import torch

    return cfg.device == "cuda" or torch.cuda.is_available()


# ---------------------------------------------------------------- loading


def _closest(name, options=()):
    """A hint for an unknown name: the built-in tasks that declare it, or the nearest name."""
    owners = [task for task in builtin_tasks() if name in declared_options(task_path(task))]
    if owners:
        return (f" It is an option of task {' and '.join(owners)} (tasks/): set task to one of "
                "them, or, in a task file that uses its configure, declare it in OPTIONS as "
                "that file does.")
    names = [f.name for f in dataclasses.fields(Config) if f.init] + list(options)
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def coerce(name, value, default):
    """Check a value from a run file against the default's type; ints may stand for floats."""
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if want is tuple and isinstance(value, list):
        value = tuple(value)
    if name == "task" and isinstance(value, dict):  # D4: {"math": 0.7, "countdown": 0.3}
        value = ",".join(f"{k}:{w}" for k, w in value.items())
    if type(value) is not want:
        raise ConfigError(f"{name} must be {want.__name__} (default {default!r}), got {value!r}")
    item = type(default[0]) if want is tuple else None
    if want is tuple and any(type(v) is not item and (type(v), item) != (int, float)
                             for v in value):
        raise ConfigError(f"{name} must hold {item.__name__} items like {default!r}, got {value!r}")
    return value


def _parse_bool(text):
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
    return text.lower() in ("true", "1", "yes")


PARSERS = {
    bool: _parse_bool,
    int: int,
    float: float,
    str: str,
    tuple: lambda text: tuple(_literal(x.strip()) for x in text.strip().strip("()").split(",")
                              if x.strip()),
}


def _literal(text):
    """'0.9' -> 0.9, '3' -> 3, 'add' -> 'add': one item of a comma-separated tuple."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text.strip("'\"")


def parse_value(name, text, default):
    """Parse a command-line string to the type of the field's default."""
    try:
        value = PARSERS[type(default)](text)
    except (ValueError, SyntaxError, TypeError):
        raise ConfigError(f"--{name}={text}: cannot parse as {type(default).__name__} "
                          f"(default {default!r})") from None
    return coerce(name, value, default)


def _check_name(name, where):
    """True for a Config field; False for a name the task file may declare (checked once the task is
    known); a ConfigError for a renamed, deleted or derived one."""
    if name in RENAMED:
        new, what = RENAMED[name]
        raise ConfigError(f"{where}: '{name}' is now '{new}' ({what}); write {new} instead")
    if name in DELETED:
        raise ConfigError(f"{where}: '{name}' is no longer a setting: {DELETED[name][1]}")
    if name in DERIVED:
        raise ConfigError(f"{where}: '{name}' is derived from other settings and cannot be set")
    return name in Config.__dataclass_fields__


TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def builtin_tasks():
    """Names of the task files in tasks/."""
    return sorted(f[:-3] for f in os.listdir(TASK_DIR) if f.endswith(".py"))


def task_path(task):
    """The task file that `task` names: tasks/NAME.py for a built-in name, a .py path as it is,
    else tasks/dataset.py (the task is a data file; episodes.task.task_file checks it is one)."""
    if task in builtin_tasks():
        return os.path.join(TASK_DIR, task + ".py")
    return task if task.endswith(".py") else os.path.join(TASK_DIR, "dataset.py")


def declared_options(path):
    """The task file's own settings, {name: default}: its OPTIONS, read from its text (a task file
    is imported once, in pre-flight). {} without OPTIONS, or for a file absent or unparsable."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if [getattr(t, "id", "") for t in targets] == ["OPTIONS"] and node.value is not None:
            try:
                options = ast.literal_eval(node.value)
            except ValueError:
                options = None
            if not isinstance(options, dict) or not all(
                    isinstance(k, str) and _is_flat(v) for k, v in options.items()):
                raise ConfigError(f"task file {path}: OPTIONS must be a dict of setting names and "
                                  "literal defaults (bool, int, float, str, or a tuple of them, "
                                  "not empty), e.g. {'max_number': 99}")
            taken = set(Config.__dataclass_fields__) | set(RENAMED) | set(DELETED)
            clash = sorted(set(options) & taken)
            need(not clash, f"task file {path}: OPTIONS {clash} are (or were) the names of "
                            "settings; name them after the task (countdown_numbers)")
            return options
    return {}


def run_options(cfg):
    """The options a run may set, {name: default}: those of its task file and of its eval sets'
    (eval_tasks, M2); where two declare one name, the run's task's default."""
    options = {}
    for spec in reversed([*task_parts(cfg.task),
                          *filter(None, map(str.strip, cfg.eval_tasks.split(",")))]):
        options.update(declared_options(task_path(spec)))
    return options


def _is_flat(value):
    """A default a command line can write: a scalar, or a tuple of scalars, not empty."""
    scalars = (bool, int, float, str)
    return type(value) in scalars or (type(value) is tuple and bool(value)
                                      and all(type(v) in scalars for v in value))


def _unread(path):
    """Why the task file at `path` cannot be read for its OPTIONS, or ""."""
    try:
        with open(path) as f:
            ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def load_config(path=None, overrides=()):
    """Defaults <- run file at `path` <- `--key=value` overrides; a derived, validated Config. A
    name no Config field has is one of the task file's OPTIONS, set once the task is known."""
    cfg, task_given = Config(), []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"run file {path} not found (run files live in config/, e.g. "
                              "config/tiny.py)")
        scope = {}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)  # trusted Python, like nanoGPT's
        for name, value in scope.items():
            if name.startswith("_") or type(value).__name__ == "module":
                continue
            if _check_name(name, path):
                setattr(cfg, name, coerce(name, value, getattr(Config(), name)))
            else:
                task_given.append((path, name, value))
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override '{arg}' must look like --key=value")
        name, text = arg[2:].split("=", 1)
        if not _check_name(name, "command line"):
            task_given.append(("command line", name, text))
            continue
        value = parse_value(name, text, getattr(Config(), name))
        print(f"override: {name} = {value!r}")
        setattr(cfg, name, value)
    options = run_options(cfg)
    cfg.task_options = dict(options)
    for where, name, value in task_given:
        why = "" if name in options else _unread(task_path(cfg.task))
        if why:
            raise ConfigError(f"{where}: unknown setting '{name}': the task file "
                              f"{task_path(cfg.task)} that may declare it cannot be read ({why})")
        if name not in options:
            raise ConfigError(f"{where}: unknown setting '{name}'.{_closest(name, options)}")
        if where == "command line":
            value = parse_value(name, value, options[name])
            print(f"override: {name} = {value!r}")
        cfg.task_options[name] = coerce(name, value, options[name])
    return validate(derive(cfg))


def config_from_argv(argv):
    """`--config FILE` (or `--config=FILE`) plus `--key=value` overrides, as grpo.py takes them."""
    argv, path = list(argv), None
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a run file, e.g. --config config/tiny.py")
            path = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
            del argv[i]
            break
    return load_config(path, argv)


# ---------------------------------------------------------------- pre-flight (O6)


def need(ok, message):
    """Raise a ConfigError with `message` (what to change) unless ok."""
    if not ok:
        raise ConfigError(message)


def validate(cfg):
    """Settings that cannot work: fail before any model loads, saying what to change (O6). What
    this machine lacks, and settings that run but mislead, are pre-flight's (infra/preflight.py)."""
    check_values(cfg)
    check_batch(cfg)
    check_update(cfg)
    check_sampling(cfg)
    return cfg


def check_values(cfg):
    """Each setting alone: one of its choices, finite, in its range."""
    for name, allowed in CHOICES.items():
        value = getattr(cfg, name)
        need(value in allowed, f"{name}={value!r}; choose one of {allowed}")
    # nan passes every comparison below (nan < 0 is False); inf overflows the sampler and optimizer
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        items = value if isinstance(value, tuple) else (value,)
        need(not f.init or all(not isinstance(v, float) or math.isfinite(v) for v in items),
             f"{f.name}={value} must be a finite number (default {f.default})")
    need(not cfg.chat_template or os.path.isfile(cfg.chat_template), f"chat_template="
         f"{cfg.chat_template!r} is not a file; name a Jinja file, e.g. config/tools_chatml.jinja")
    for name in ("seed", "data_seed"):  # vLLM keeps its seed as an int64, torch as a uint64
        need(0 <= getattr(cfg, name) < 2**63, f"{name}={getattr(cfg, name)} must be in 0..2**63-1")
    for name in ("max_steps", "max_prompt_len", "max_completion_len", "num_iterations",
                 "mini_batches", "kl_window", "train_size", "eval_n",
                 "keep_checkpoints", "vllm_cpu_kv_cache_gb", "lora_alpha",
                 "test_size", "max_tool_calls", "tool_output_chars"):
        need(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("adv_clip", "entropy_coef", "warmup_steps", "weight_decay",
                 "grad_clip", "lora_rank", "length_soft_limit", "length_min",
                 "curriculum_ramp_steps", "save_every", "eval_every", "sample_every",
                 "sample_groups", "temperature_end", "dynamic_sampling_rounds",
                 "ref_refresh_steps", "reward_workers", "reward_timeout", "tool_error_penalty",
                 "length_reward"):
        need(getattr(cfg, name) >= 0, f"{name}={getattr(cfg, name)} must be >= 0")


def check_batch(cfg):
    """The batch: whole groups, split evenly over ranks, mini-batches and micro-batches."""
    G = cfg.group_size
    need(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be >= 1: the completions of a "
                              f"step, a multiple of group_size={G} (e.g. {8 * G})")
    need(G >= 2, f"group_size={G}: GRPO needs >= 2 completions per prompt to form a baseline (R3)")
    need(0 <= cfg.adv_pass_k < G, f"adv_pass_k={cfg.adv_pass_k} must be in 0..group_size - 1 "
         f"= {G - 1}: a group's best of K, K below the group's size (A5); 0 = off")
    plain = cfg.adv_baseline == "mean" and cfg.adv_scale == "group"
    need(not cfg.adv_pass_k or plain and not cfg.adv_per_component, "adv_pass_k sets the "
         "advantage itself: leave adv_baseline, adv_scale at mean, group, adv_per_component off")
    need(not cfg.adv_per_component or cfg.adv_scale == "group", "adv_per_component normalises each "
         f"term in its group, then by the batch's std: adv_scale={cfg.adv_scale!r} must be 'group'")
    if G < 4:
        warnings.warn(f"group_size={G} < 4: group baselines are very noisy; 8 is usual (R3)")
    lower = cfg.batch_size // G * G
    need(not cfg.batch_size % G, f"batch_size={cfg.batch_size} is not divisible by group_size={G}; "
                                 f"use batch_size={lower or G} or {lower + G}")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    need(not cfg.prompts_per_step % world,
         f"{cfg.prompts_per_step} prompts per step (batch_size / group_size) cannot be split over "
         f"{world} ranks; use batch_size={G * world * max(1, cfg.prompts_per_step // world)} or a "
         "multiple of it")
    tp = cfg.vllm_tensor_parallel  # ranks sharing one vLLM engine; RANK: set by torchrun
    need(tp <= 1 or ("RANK" in os.environ and cfg.engine != "hf"),
         f"vllm_tensor_parallel={tp} needs the vLLM engine under torchrun; 1 = one engine per rank")
    need(tp >= 1 and not world % tp,
         f"vllm_tensor_parallel={tp}: use a multiple of it as the number of ranks (now {world})")
    need(not (world > 1 and cfg.parallel == "fsdp" and cfg.ref_offload),
         "ref_offload is for one process; under FSDP the reference is already sharded over ranks")
    dataset = cfg.task.endswith((".jsonl", ".parquet", ".csv")) or os.path.isdir(cfg.task)
    need(not (cfg.data_path and dataset), f"task={cfg.task!r} is a dataset and "
                                          f"data_path={cfg.data_path!r} another; set one of them")
    need(len(task_parts(cfg.task)) == 1 or not (cfg.data_path or cfg.adv_per_component), "a task "
         "mixture (D4) takes each dataset as a part (data/x.jsonl:0.5), not data_path, and its "
         "tasks' components differ: leave adv_per_component off")
    need(not cfg.prompts_per_step % cfg.mini_batches,
         f"mini_batches={cfg.mini_batches} must divide the {cfg.prompts_per_step} prompts of a "
         "step (batch_size / group_size): each mini-batch takes whole groups")
    need(not cfg.async_rollouts or cfg.vllm_tensor_parallel == 1,
         "async_rollouts runs one sampler process on one device; vllm_tensor_parallel must be 1")
    longest = cfg.max_prompt_len + cfg.max_completion_len
    need(cfg.micro_batch_tokens >= longest,
         f"micro_batch_tokens={cfg.micro_batch_tokens} cannot hold one prompt plus its longest "
         f"completion ({cfg.max_prompt_len} + {cfg.max_completion_len} = {longest}); raise "
         f"micro_batch_tokens to >= {longest} or lower max_completion_len")


def check_update(cfg):
    """The loss, the reference, the optimizer and the importance weights (L1-L8, F1, F2, R8)."""
    need(not (cfg.ref_refresh_steps and cfg.beta == 0),
         f"ref_refresh_steps={cfg.ref_refresh_steps} refreshes the reference, but beta=0 means "
         "there is none; set beta > 0 (e.g. 0.001) or ref_refresh_steps=0 (F1)")
    need(not (cfg.lora_rank and cfg.ref_refresh_steps),
         "ref_refresh_steps needs full fine-tuning: with LoRA the reference is the base model (F1)")
    betas = cfg.adam_betas
    need(len(betas) == 2, f"adam_betas={betas} must be two numbers, e.g. 0.9,0.99")
    need(all(0 <= b < 1 for b in betas),
         f"adam_betas={betas}: each must be in [0, 1), e.g. 0.9,0.99 (AdamW's decay rates)")
    need(0 < cfg.clip_eps < 1, f"clip_eps={cfg.clip_eps} must be in (0, 1); 0.2 is standard (L1)")
    need(not cfg.clip_eps_high or cfg.clip_eps <= cfg.clip_eps_high < 10,
         f"clip_eps_high={cfg.clip_eps_high} must be >= clip_eps={cfg.clip_eps} (or 0 = same)")
    need(0 <= cfg.entropy_top_quantile < 1,
         f"entropy_top_quantile={cfg.entropy_top_quantile} must be in [0, 1); 0.2 keeps the top "
         "20% of tokens by entropy, 0 = off")
    need(not cfg.dual_clip or (cfg.dual_clip > 1 and cfg.policy_loss == "clip"),
         f"dual_clip={cfg.dual_clip} bounds PPO's clipped loss: use a value > 1 (3 is usual) with "
         f"policy_loss='clip' (now {cfg.policy_loss!r}), or 0 = off")
    need(cfg.sapo_tau_pos > 0 and cfg.sapo_tau_neg > 0, f"sapo_tau_pos={cfg.sapo_tau_pos}, "
         f"sapo_tau_neg={cfg.sapo_tau_neg} must be > 0 (1.0, 1.05)")
    need(0 <= cfg.beta <= 1,
         f"beta={cfg.beta} must be in [0, 1]; 0.001-0.04 is usual, 0 drops the reference (L4)")
    need(not (cfg.adaptive_kl and cfg.beta == 0), "adaptive_kl=True scales beta, but beta=0; set "
                                                  "beta > 0 (e.g. 0.001) or adaptive_kl=False")
    need(len(cfg.kl_band) == 2 and cfg.kl_band[0] < cfg.kl_band[1],
         f"kl_band={cfg.kl_band} must be two KLs, the first below the second, e.g. 0.01,0.08 (F2)")
    need(cfg.is_cap > 1, f"is_cap={cfg.is_cap} must be > 1 (TRL uses 2-3)")
    need(0 <= cfg.is_floor < 1, f"is_floor={cfg.is_floor} must be in [0, 1) (IcePop: 0.5)")
    need(cfg.max_staleness >= 1, f"max_staleness={cfg.max_staleness} must be >= 1 (R8: 1 is one "
                                 "batch ahead)")
    need(not cfg.teacher or cfg.distill_coef > 0, f"teacher={cfg.teacher!r} with distill_coef="
         f"{cfg.distill_coef}: its logprobs would weigh nothing; set distill_coef > 0 (1 is usual)")
    need(cfg.lr > 0, f"lr={cfg.lr} must be > 0")
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")


def check_sampling(cfg):
    """The sampler and the turns: temperatures, tool tags and deadlines (R1, R4)."""
    need(0 < cfg.gpu_memory_utilization < 1, f"gpu_memory_utilization="
         f"{cfg.gpu_memory_utilization} must be in (0, 1); 0.3-0.5 (R1)")
    need(0 < cfg.temperature and 0 < cfg.top_p <= 1,
         f"temperature={cfg.temperature} must be > 0 and top_p={cfg.top_p} in (0, 1]")
    for name in ("temperature", "temperature_end"):  # temperature_end 0 = constant
        need(not 0 < getattr(cfg, name) < MIN_TEMPERATURE,
             f"{name}={getattr(cfg, name)} is below {MIN_TEMPERATURE}, where logits / temperature "
             f"give nan or inf (vLLM raises it to {MIN_TEMPERATURE}, the trainer would not); "
             "sample at 0.7-1.0 (R4)")
        need(getattr(cfg, name) <= MAX_VLLM_TEMPERATURE or cfg.engine == "hf",
             f"{name}={getattr(cfg, name)}: vLLM refuses a temperature above "
             f"{MAX_VLLM_TEMPERATURE} (its SamplingParams); lower it, or set engine='hf'")
    tags = cfg.tool_tags
    need(len(tags) == 2 and all(tags) and tags[1] not in tags[0],
         f"tool_tags={tags!r}: two non-empty tags, open and close, and the close not "
         "inside the open (generation stops at the close), e.g. --tool_tags='<python>,</python>'")
    need(cfg.tool_timeout > 0, f"tool_timeout={cfg.tool_timeout} must be > 0 seconds (a call past "
                               "it fails); 5 is usual")
    need(cfg.max_turns >= 1, f"max_turns={cfg.max_turns}: an episode has at least one model turn")
    need(cfg.env_reward in ("sum", "last"), f"env_reward={cfg.env_reward!r}: 'sum' (the turns' "
                                             "rewards added) or 'last' (the last turn's)")
