"""GRPO, Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath sec. 4), on one node.

    python grpo.py                                   # the default run
    python grpo.py --config config/countdown_3b.py   # Qwen2.5-3B-Instruct on Countdown, one GPU
    python grpo.py --config config/tiny.py --max_steps=4 --engine=hf
    torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py   # 8 GPUs (parallel.py)

Each step: wake the sampling engine and push the policy's weights into it -> sample prompts ->
generate G completions per prompt -> put the engine to sleep (its GPU memory goes to training) ->
score with rule-based verifiers -> advantages relative to each prompt's group -> old and reference
logprobs -> a PPO-clipped policy-gradient update in micro-batches -> log -> eval -> checkpoint.

Where this departs from the GRPO paper (each is a setting in config.py):
 1. Loss averaged over all response tokens of the batch (token-mean, L2) rather than per sequence
    first; the paper's seq-mean and Dr. GRPO's constant normaliser are options.
 2. A small beta (0.001, as seed 002) rather than the paper's 0.04; beta = 0 drops the reference (L4).
 3. Group std is the unbiased one with a floor of 1e-4 (A2); the paper does not say.
 4. One update per batch by default (num_iterations = 1, L7), so the ratio starts at exactly 1.
 5. Weights kept in fp32 with bf16 autocast, logprobs and loss in fp32 (L6, O5).
 6. Optional DAPO pieces (clip-higher, dynamic sampling, overlong masking), GSPO's sequence-level
    ratio, and length shaping; all off by default.
"""

import dataclasses
import glob
import json
import math
import os
import random
import shutil
import sys
import time

import torch
from tqdm import tqdm

import parallel
from advantage import group_advantages, group_stats
from config import ConfigError, config_from_argv, preflight, save_config
from data.sampler import CurriculumSampler, PromptSampler
from data.tasks import chat_messages, load_problems
from loss import adaptive_kl_beta, grpo_loss, logprobs_and_entropy, lr_at, sampler_is_weights
from model import BUILT_HERE, check_model_source, load_policy, model_path, push_weights_iter
from rewards import score_batch
from rollout import HFEngine, VLLMEngine, vllm_available

# ---------------------------------------------------------------- helpers: prompts and rollouts


def tokenize_prompts(tokenizer, problems, max_prompt_len):
    """Chat-formatted prompt token ids; a prompt longer than max_prompt_len is an error, never cut."""
    out = []
    for p in problems:
        text = tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > max_prompt_len:
            raise ConfigError(f"prompt {p['id']} has {len(ids)} tokens > max_prompt_len={max_prompt_len}; raise it")
        out.append(ids)
    return out


def prompt_seeds(base, first, count):
    """One seed per prompt from a base seed and the prompt's place in the (global) batch only.

    Not from the rank or the run's history: a resumed run, or N ranks, sample what one straight run does.
    """
    return [base + (first + i) * 1_000_000_007 for i in range(count)]


def sampling_seeds(cfg, step, first, count):
    """prompt_seeds for a training step: the base is (seed, step), so every step samples afresh."""
    return prompt_seeds(cfg.seed * 1_000_003 + step, first, count)


def rollout(engine, problems, prompt_ids, idx, seeds, cfg, temperature):
    """Generate G completions for each prompt index in idx and score them. Groups are contiguous."""
    groups = engine.generate([prompt_ids[i] for i in idx], cfg.group_size, seeds=seeds, temperature=temperature,
                             top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_completion_len,
                             progress=sys.stdout.isatty())  # a progress bar on a terminal
    if any(g[0].prompt_ids != prompt_ids[i] for g, i in zip(groups, idx)):  # cheap, and a silent mix-up is costly
        raise RuntimeError("the engine returned completions for other prompts than it was given")
    completions = [c for g in groups for c in g]  # (N,) = len(idx) * G
    problem_ids = [i for i in idx for _ in range(cfg.group_size)]
    start = time.perf_counter()
    rewards, components = score_batch([c.text for c in completions], [problems[i] for i in problem_ids],
                                      [len(c.completion_ids) for c in completions], cfg.math_last_number,
                                      cfg.reward_workers, **cfg.reward_weights)
    return {"problem": problem_ids, "completions": completions, "rewards": rewards, "components": components,
            "score_seconds": time.perf_counter() - start}


def select_groups(batch, groups, G):
    """The rows of the given group indices, in order."""
    rows = [g * G + j for g in groups for j in range(G)]
    return {"problem": [batch["problem"][r] for r in rows], "completions": [batch["completions"][r] for r in rows],
            "rewards": batch["rewards"][rows], "components": {k: v[rows] for k, v in batch["components"].items()},
            "score_seconds": batch["score_seconds"]}


def concat(a, b):
    """Two batches as one (R7's refills), rollout or gathered: lists joined, tensors joined, seconds added."""
    out = {}
    for k, v in a.items():
        if isinstance(v, dict):  # the reward components
            out[k] = {c: torch.cat([v[c], b[k][c]]) for c in v}
        else:
            out[k] = torch.cat([v, b[k]]) if torch.is_tensor(v) else v + b[k]
    return out


def gather_batch(batch):
    """Prompts, rewards, components, lengths of every rank's rollouts, in rank order (= one process's order)."""
    gather = parallel.all_gather_list
    return {"problem": gather(batch["problem"]), "rewards": torch.tensor(gather(batch["rewards"].tolist())),
            "components": {k: torch.tensor(gather(v.tolist())) for k, v in batch["components"].items()},
            "lengths": torch.tensor(gather([float(len(c.completion_ids)) for c in batch["completions"]])),
            "truncated": torch.tensor(gather([float(c.truncated) for c in batch["completions"]]))}


def informative_groups(rewards, G):
    """Indices of groups whose rewards are not all equal (R7: the others have zero advantage)."""
    return [g for g, row in enumerate(rewards.view(-1, G)) if row.max() > row.min()]


# ---------------------------------------------------------------- helpers: tensors and passes


def pad_batch(completions, pad_id):
    """Prompt + completion, right-padded, and the response-token mask in next-token coordinates.

    Returns input_ids (N, L), attention (N, L), mask (N, L-1), sampler_logprobs (N, L-1), where
    position t of mask/logprobs refers to the token input_ids[:, t + 1] (L3: prompt and padding are 0).
    """
    # default=2: a rank left with no rows (R7 under torchrun) still gets (0, 2) tensors to pad (parallel.py)
    L = max((len(c.prompt_ids) + len(c.completion_ids) for c in completions), default=2)
    N = len(completions)
    input_ids = torch.full((N, L), pad_id, dtype=torch.long)
    attention, mask = torch.zeros(N, L, dtype=torch.long), torch.zeros(N, L - 1)
    sampler_lp = torch.zeros(N, L - 1)
    for i, c in enumerate(completions):
        P, C = len(c.prompt_ids), len(c.completion_ids)
        input_ids[i, : P + C] = torch.tensor(c.prompt_ids + c.completion_ids)
        attention[i, : P + C] = 1
        mask[i, P - 1 : P - 1 + C] = 1
        if c.logprobs:
            sampler_lp[i, P - 1 : P - 1 + C] = torch.tensor(c.logprobs)
    return input_ids, attention, mask, sampler_lp


def micro_batches(lengths, budget):
    """O3: group rows, longest first, so each micro-batch's padded size (rows x longest) fits `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # similar lengths together: less padding
    out, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] if current else out


def forward_logprobs(model, ids, attention, cfg, temperature):
    """(logprobs, entropy), each (b, L-1) fp32, for the tokens ids[:, 1:] (L6: bf16 compute, fp32 logprobs)."""
    device_type = ids.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        logits = model(input_ids=ids, attention_mask=attention).logits  # (b, L, V)
    return logprobs_and_entropy(logits[:, :-1], ids[:, 1:], temperature)


@torch.no_grad()
def batch_logprobs(model, tensors, batches, cfg, temperature):
    """Logprobs of the whole batch under `model`, no grad: the old or the reference policy (F1, L7)."""
    ids, attention, mask, _ = tensors
    out = torch.zeros_like(mask)
    for mb in batches:
        L = int(attention[mb].sum(1).max())
        out[mb, : L - 1] = forward_logprobs(model, ids[mb, :L], attention[mb, :L], cfg, temperature)[0]
    return out


def optimizer_step(optimizer, params, loss, grad_clip):
    """O2 + L6: clip the global grad norm and step, unless the loss or the norm is not finite.

    Returns (grad_norm, stepped). A skipped step leaves the weights and the AdamW moments untouched.
    `loss` is the global one, so every rank takes the same decision.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    grad_norm = parallel.grad_norm_value(grad_norm)  # FSDP2: a DTensor holding the global norm
    stepped = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def peak_memory_gb():
    """Peak memory so far: CUDA allocations on a GPU, the process's peak resident set on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_gb():
    """GPU memory in use on this device (all processes), or this process's resident memory on a CPU."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def temperature_at(step, cfg):
    """R4: constant, or linear from cfg.temperature to cfg.temperature_end over the run."""
    if cfg.temperature_end:
        return cfg.temperature + (cfg.temperature_end - cfg.temperature) * step / max(1, cfg.max_steps - 1)
    return cfg.temperature


# ---------------------------------------------------------------- eval (M2)


def evaluate(engine, problems, prompt_ids, cfg, seed):
    """pass@1 with greedy decoding, pass@k from k samples at the training temperature, format, length.

    parsed: the share of greedy answers given in a tag or a box (what unparsed_penalty rewards).
    Returns (metrics, greedy completion texts). Under torchrun every rank evaluates the whole test set
    the same way (FSDP needs the ranks in step; test sets are small); rank 0 logs it.
    """
    idx = list(range(len(problems)))
    seeds = prompt_seeds(seed, 0, len(idx))
    greedy = engine.generate([prompt_ids[i] for i in idx], 1, seeds=seeds, temperature=0.0, top_p=1.0, top_k=-1,
                             max_tokens=cfg.max_completion_len)
    texts = [g[0].text for g in greedy]
    _, comps = score_batch(texts, problems, [len(g[0].completion_ids) for g in greedy], cfg.math_last_number,
                           **cfg.reward_weights)
    sampled = engine.generate([prompt_ids[i] for i in idx], cfg.eval_k, seeds=seeds, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_completion_len)
    flat = [c for g in sampled for c in g]
    _, sampled_comps = score_batch([c.text for c in flat], [problems[i] for i in idx for _ in range(cfg.eval_k)],
                                   [len(c.completion_ids) for c in flat], cfg.math_last_number, **cfg.reward_weights)
    solved = (sampled_comps["correct"].view(-1, cfg.eval_k) >= 1).any(dim=1)
    return {"eval/pass@1_greedy": (comps["correct"] >= 1).float().mean().item(),
            f"eval/pass@{cfg.eval_k}": solved.float().mean().item(),
            "eval/mean_correct_sampled": sampled_comps["correct"].mean().item(),
            "eval/format": comps["format"].mean().item(), "eval/parsed": comps["parsed"].mean().item(),
            "eval/response_length": sum(len(g[0].completion_ids) for g in greedy) / len(greedy)}, texts


# ---------------------------------------------------------------- checkpoints


def checkpoints(out_dir):
    """Complete checkpoint folders, oldest first (an interrupted save is a .tmp folder and never listed)."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*")))


def save_checkpoint(cfg, step, policy, ref, tokenizer, optimizer, sampler, state):
    """Write everything to a temp folder, then rename it: a kill at any moment leaves the last one whole.

    Called on every rank: the full (unsharded) states are gathered to rank 0, which alone writes. The
    same files whatever the number of ranks, so any number can resume them, and from_pretrained reads them.
    """
    model_state, optimizer_state = parallel.full_state(policy, optimizer)  # optimizer keyed by parameter name
    ref_state = parallel.full_state(ref)[0] if cfg.ref_refresh_steps and ref is not None else None
    if parallel.rank() > 0:
        parallel.barrier()
        return
    final = os.path.join(cfg.out_dir, f"ckpt_{step:06d}")
    tmp = os.path.join(cfg.out_dir, f".tmp_ckpt_{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=model_state)  # with LoRA: the adapter only
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, os.path.join(tmp, "rng.pt"))
    if ref_state is not None:
        torch.save(ref_state, os.path.join(tmp, "reference.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": step, "sampler": sampler.state_dict(), **state}, f)
    save_config(cfg, os.path.join(tmp, "grpo_config.json"))  # config.json is the HF model config
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic on one file system
    for old in checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old)
    parallel.barrier()  # the other ranks wait until the checkpoint is whole


def truncate_log(path, step):
    """Drop the lines of steps >= step from a JSONL log: they were written after the checkpoint we resume from."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] < step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- logging (M1)


class Logger:
    """One console line per step, every metric appended to metrics.jsonl, wandb/tensorboard on request."""

    def __init__(self, cfg, run_id):
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.wandb = self.tb = None
        if cfg.wandb_project:
            import wandb

            # run_id is kept in every checkpoint, so a resumed run continues the same wandb run
            self.wandb = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg), resume="allow",
                                    id=run_id)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(cfg.out_dir, "tb"))

    def log(self, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        line = " | ".join(f"{k} {metrics[k]:.4g}" for k in ("reward", "acc", "format", "kl", "response_length",
                                                              "loss", "grad_norm", "time/step") if metrics.get(k) is not None)
        print(f"step {step} | {line}", flush=True)


def rollout_metrics(drawn, stats, kept, G):
    """M1 and A4 over every rollout drawn this step (all ranks); with R7, the kept batch's under kept/."""
    out = {
        "reward": drawn["rewards"].mean().item(),
        "reward_std": drawn["rewards"].std().item(),
        **{f"reward/{k}": v.mean().item() for k, v in drawn["components"].items() if k != "errors"},
        "reward/errors": int(drawn["components"]["errors"].sum()),  # completions whose verifier raised
        "acc": drawn["components"]["correct"].mean().item(),
        "format": drawn["components"]["format"].mean().item(),
        "response_length": drawn["lengths"].mean().item(),
        "truncated": drawn["truncated"].mean().item(),
        "gen_tokens": int(drawn["lengths"].sum()),
        "group_std": stats["group_std"],
        "effective_group_ratio": stats["effective_group_ratio"],
        "frac_reward_zero_std": stats["frac_reward_zero_std"],
    }
    if kept is not None:  # R7: what the update trained on
        out["kept/prompts"] = len(kept["rewards"]) // G
        out["kept/reward"] = kept["rewards"].mean().item() if len(kept["rewards"]) else None
        out["kept/acc"] = kept["components"]["correct"].mean().item() if len(kept["rewards"]) else None
        out["drawn/prompts"] = len(drawn["rewards"]) // G
    return out


def end_step(cfg, step, metrics, t_step, engine, policy, test_problems, test_prompts, logger, save):
    """M2 after the last update, the log line (written before the checkpoint, so a resume never loses it), and
    the checkpoint when one is due. Returns the checkpoint's seconds (logged with the next step)."""
    last = step == cfg.max_steps - 1
    if last:
        t0 = time.perf_counter()
        engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))
        metrics.update(evaluate(engine, test_problems, test_prompts, cfg, seed=cfg.seed)[0])
        metrics["eval/updates"] = step + 1
        metrics["time/eval"] = metrics.get("time/eval", 0.0) + time.perf_counter() - t0
    metrics["time/step"] = time.perf_counter() - t_step
    if logger is not None:  # rank 0
        logger.log(metrics)
    t0 = time.perf_counter()
    if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
        save(step + 1)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- the run


def main(argv, wrap_engine=lambda engine: engine):
    """Train (or with eval_only, evaluate). wrap_engine lets a test observe the real engine's calls."""
    # ---- config, pre-flight, data: everything that can fail fails before a model loads (O6)
    cfg = config_from_argv(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    rank, world, device = parallel.setup(device)  # under torchrun: join the process group; else (0, 1, device)
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # one console: rank 0's (errors still reach stderr)
    if cfg.model not in BUILT_HERE:  # a hub name that cannot be fetched fails now, not after 10 retries
        check_model_source(cfg.model)
    preflight(cfg)
    engine_name = ("vllm" if vllm_available() else "hf") if cfg.engine == "auto" else cfg.engine
    with parallel.local_rank0_first():  # one rank per machine builds or converts the model folder, tidies out_dir
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = model_path(cfg)
        for partial in glob.glob(os.path.join(cfg.out_dir, ".tmp_ckpt_*")):  # a save that was killed midway
            shutil.rmtree(partial, ignore_errors=True)  # (out_dir may be shared by several machines)
    check_model_source(path)
    resume_from = None
    if cfg.init_from:
        check_model_source(cfg.init_from)
    if cfg.resume:
        if not checkpoints(cfg.out_dir):
            raise ConfigError(f"resume=True but {cfg.out_dir} has no complete checkpoint (ckpt_*)")
        resume_from = checkpoints(cfg.out_dir)[-1]
    try:
        train_problems, test_problems = load_problems(cfg, "train"), load_problems(cfg, "test")
    except ValueError as e:  # a malformed JSONL line, or fewer distinct problems than asked for
        raise ConfigError(str(e)) from e
    if rank == 0:
        save_config(cfg, os.path.join(cfg.out_dir, "config.json"))

    # ---- models: the policy (fp32 master weights), the reference (F1), the optimizer (O1)
    torch.manual_seed(cfg.seed)
    weights = resume_from if resume_from and not cfg.lora_rank else (cfg.init_from or path)
    tokenizer, policy = load_policy(cfg, weights, device, adapter=resume_from if cfg.lora_rank else None)
    policy.train()
    # under torchrun: FSDP2 shards `policy` in place (train_model is policy); DDP wraps it for the update
    train_model = parallel.wrap(policy, cfg.parallel, cfg.dtype)
    ref = None
    if cfg.beta > 0 and not cfg.lora_rank:  # with LoRA the reference is the base: adapters disabled (F1)
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        ref = parallel.wrap(ref.to("cpu" if cfg.ref_offload else device), cfg.parallel, cfg.dtype, trainable=False)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # after wrapping: FSDP2 swaps in sharded ones
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    sampler = (CurriculumSampler(len(train_problems), cfg.seed, easy_above=cfg.curriculum_easy_above,
                                 hard_below=cfg.curriculum_hard_below, ramp_steps=cfg.curriculum_ramp_steps)
               if cfg.curriculum else PromptSampler(len(train_problems), cfg.seed))  # D2 / D3
    train_prompts = tokenize_prompts(tokenizer, train_problems, cfg.max_prompt_len)
    test_prompts = tokenize_prompts(tokenizer, test_problems, cfg.max_prompt_len)

    start_step, beta, kl_history, nonfinite_in_a_row = 0, cfg.beta, [], 0
    run_id = f"{random.Random().getrandbits(64):016x}"  # names the wandb run; a resume keeps the old one
    if resume_from:
        with open(os.path.join(resume_from, "trainer_state.json")) as f:
            state = json.load(f)
        start_step, beta, kl_history = state["step"], state["beta"], state["kl_history"]
        nonfinite_in_a_row = state["nonfinite_in_a_row"]
        run_id = state.get("run_id", run_id)
        sampler.load_state_dict(state["sampler"])
        parallel.load_optimizer(policy, optimizer, torch.load(os.path.join(resume_from, "optimizer.pt")))
        rng = torch.load(os.path.join(resume_from, "rng.pt"), weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if ref is not None and cfg.ref_refresh_steps:
            parallel.load_model(ref, torch.load(os.path.join(resume_from, "reference.pt")))
        for log in ("metrics.jsonl", "samples.jsonl") if rank == 0 else ():
            truncate_log(os.path.join(cfg.out_dir, log), start_step)
        print(f"resumed from {resume_from} at step {start_step}")

    engine = wrap_engine(VLLMEngine(path, cfg, device) if engine_name == "vllm" else
                         HFEngine(policy, tokenizer, synced_gpus=world > 1 and cfg.parallel == "fsdp"))
    if cfg.eval_only:  # M2: the same eval as during training, on the model (or the init_from weights) as it is
        engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))
        metrics, texts = evaluate(engine, test_problems, test_prompts, cfg, cfg.seed)
        examples = [{"prompt": p["prompt"], "completion": t} for p, t in zip(test_problems[:4], texts)]  # to read
        results = {"weights": cfg.init_from or cfg.model, **metrics, "examples": examples}
        if rank == 0:
            with open(os.path.join(cfg.out_dir, "eval.jsonl"), "a") as f:
                f.write(json.dumps(results) + "\n")
        print(json.dumps(results, indent=1))
        return policy
    logger = Logger(cfg, run_id) if rank == 0 else None  # metrics, wandb and tensorboard: rank 0 only

    def save(updates):
        """A checkpoint after `updates` steps, with everything a resume needs (the values when it is called)."""
        save_checkpoint(cfg, updates, policy, ref, tokenizer, optimizer, sampler,
                        {"beta": beta, "kl_history": kl_history, "nonfinite_in_a_row": nonfinite_in_a_row,
                         "run_id": run_id})

    G, checkpoint_seconds, next_parity_warning = cfg.group_size, 0.0, 0
    share = cfg.prompts_per_step // world  # prompts per rank, each with all its G completions
    quiet = not sys.stdout.isatty()  # progress bars only on a terminal
    print(f"GRPO: {cfg.model} on {cfg.task}, engine {engine_name}, device {device}, ranks {world}, "
          f"steps {start_step}..{cfg.max_steps}")

    for step in range(start_step, cfg.max_steps):
        t_step, times = time.perf_counter(), {}

        # ---- wake the engine and push the current policy into it (R1, R2)
        t0 = time.perf_counter()
        engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))  # wake weights -> push -> wake KV cache
        times["time/push"], memory = time.perf_counter() - t0, {"mem/after_wake_gb": memory_gb()}
        evals = {}
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps - 1:  # M2: after `step` updates
            t0 = time.perf_counter()
            evals = {**evaluate(engine, test_problems, test_prompts, cfg, seed=cfg.seed)[0], "eval/updates": step,
                     "time/eval": time.perf_counter() - t0}
        temperature = temperature_at(step, cfg)

        # ---- sample prompts, generate G completions each, score them. Every rank draws the same global
        # prompts (same sampler, same seed) and keeps its contiguous slice: groups never straddle ranks
        t0 = time.perf_counter()
        idx = parallel.my_slice(sampler.sample(cfg.prompts_per_step))
        batch = rollout(engine, train_problems, train_prompts, idx, sampling_seeds(cfg, step, rank * share, share),
                        cfg, temperature)
        drawn_all = gather_batch(batch)  # every rollout drawn (all ranks): what the log and the curriculum see
        rounds, drawn = 0, cfg.prompts_per_step
        if cfg.dynamic_sampling:  # R7: keep only groups with a reward spread; refill with fresh prompts
            batch = select_groups(batch, informative_groups(batch["rewards"], G), G)
            # refill rounds are decided on the global minimum, so every rank draws from the sampler alike
            while (fewest := int(parallel.all_min(len(batch["rewards"]) // G))) < share \
                    and rounds < cfg.dynamic_sampling_rounds:
                need = share - fewest  # per rank; world * need fresh prompts in all
                more = rollout(engine, train_problems, train_prompts, parallel.my_slice(sampler.sample(need * world)),
                               sampling_seeds(cfg, step, drawn + rank * need, need), cfg, temperature)
                drawn_all = concat(drawn_all, gather_batch(more))
                batch = concat(batch, select_groups(more, informative_groups(more["rewards"], G), G))
                rounds, drawn = rounds + 1, drawn + need * world
            batch = select_groups(batch, range(min(share, len(batch["rewards"]) // G)), G)
        times["time/score"] = batch["score_seconds"]
        times["time/generate"] = time.perf_counter() - t0 - times["time/score"]

        # ---- put the engine to sleep: its GPU memory goes to the update (R1)
        t0 = time.perf_counter()
        engine.sleep()
        times["time/sleep"], memory["mem/after_sleep_gb"] = time.perf_counter() - t0, memory_gb()
        completions, rewards = batch["completions"], batch["rewards"]
        # A4 and D2 from every group drawn, before R7's filter (as DAPO and verl log them): after it every group
        # has a spread by construction, and the curriculum would never see an all-solved or all-failed prompt
        stats = group_stats(drawn_all["rewards"], G, correct=drawn_all["components"]["correct"])
        sampler.update(drawn_all["problem"][::G], stats["pass_rate"].tolist())  # D2 (a no-op for plain shuffling)
        num_seqs = int(parallel.all_sum(len(completions)))  # the global batch
        if num_seqs == 0:
            print(f"step {step}: no group with a reward spread after {rounds} refill rounds; skipping the update")
            metrics = {"step": step, **rollout_metrics(drawn_all, stats, gather_batch(batch), G),
                       "skipped_updates": 1, "refill_rounds": rounds, "beta": beta, "temperature": temperature,
                       **times, **memory, **evals}
            checkpoint_seconds = end_step(cfg, step, metrics, t_step, engine, policy, test_problems, test_prompts,
                                          logger, save)
            continue

        # ---- advantages relative to each prompt's group (A1-A4)
        advantages = group_advantages(rewards, G, scale=cfg.adv_scale, std_floor=cfg.adv_std_floor,
                                      zero_std_groups=cfg.adv_zero_std_groups, clip=cfg.adv_clip)  # this rank's groups

        # ---- tensors: response mask (L3), micro-batches under the token budget (O3)
        ids, attention, mask, sampler_lp = pad_batch(completions, tokenizer.pad_token_id)
        truncated = torch.tensor([float(c.truncated) for c in completions])
        if cfg.mask_truncated:  # R6: a cut-off completion has no final answer to judge; give it no loss
            mask = mask * (1 - truncated)[:, None]
        ids, attention, mask, sampler_lp, advantages = (t.to(device) for t in (ids, attention, mask, sampler_lp,
                                                                                advantages))
        batches = micro_batches(attention.sum(1).tolist(), cfg.micro_batch_tokens)
        tokens = parallel.all_sum(attention.sum())
        padded = parallel.all_sum(sum(len(mb) * int(attention[mb].sum(1).max()) for mb in batches))  # tokens computed
        num_tokens = int(parallel.all_sum(mask.sum()))  # L2: token-mean over the whole (global) batch's response tokens
        if world > 1:  # FSDP gathers weights in every forward, DDP reduces in backward: equal pass counts
            (ids, attention, mask, sampler_lp, advantages), batches = parallel.even_micro_batches(
                (ids, attention, mask, sampler_lp, advantages), batches)
        tensors = (ids, attention, mask, sampler_lp)

        # ---- old and reference logprobs, once per batch (F1, L7)
        t0 = time.perf_counter()
        old_lp = None  # with one update per batch the old policy is the current one: detach its own logprobs
        if cfg.num_iterations > 1:
            old_lp = batch_logprobs(policy, tensors, batches, cfg, temperature)
        times["time/old"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_lp = None
        if beta > 0 and cfg.lora_rank:
            with policy.disable_adapter():
                ref_lp = batch_logprobs(policy, tensors, batches, cfg, temperature)
        elif beta > 0:
            ref.to(device)
            ref_lp = batch_logprobs(ref, tensors, batches, cfg, temperature)
            ref.to("cpu" if cfg.ref_offload else device)
        times["time/ref"] = time.perf_counter() - t0

        # ---- the update: num_iterations epochs of micro-batches, one optimizer step each (L1-L7, O1-O2)
        t0 = time.perf_counter()
        lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums, parity, skipped = {}, [], 0
        for epoch in range(cfg.num_iterations):
            loss_total = 0.0
            for i, mb in enumerate(tqdm(batches, desc=f"update {epoch + 1}/{cfg.num_iterations}", leave=False,
                                        disable=quiet)):
                L = int(attention[mb].sum(1).max())
                with parallel.no_grad_sync(train_model, last=i == len(batches) - 1):  # DDP decides in the forward
                    lp, entropy = forward_logprobs(train_model, ids[mb, :L], attention[mb, :L], cfg, temperature)
                m_mask, old = mask[mb, : L - 1], old_lp[mb, : L - 1] if old_lp is not None else lp.detach()
                is_weights, is_metrics = None, {}
                if cfg.is_correction != "off":  # R2: correct for sampling from vLLM's q rather than pi_old
                    cap = cfg.is_cap if cfg.is_correction == "token" else cfg.is_seq_cap
                    is_weights, is_metrics = sampler_is_weights(old, sampler_lp[mb, : L - 1], m_mask,
                                                                level=cfg.is_correction, action=cfg.is_mode, cap=cap)
                loss, mb_metrics = grpo_loss(
                    lp, old, advantages[mb], m_mask,
                    ref_logprobs=ref_lp[mb, : L - 1] if ref_lp is not None else None, beta=beta,
                    clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high_eff, agg=cfg.loss_agg,
                    num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_completion_len,
                    entropy=entropy, entropy_coef=cfg.entropy_coef, ratio_level=cfg.ratio_level, is_weights=is_weights)
                mb_metrics.update(is_metrics)
                # micro-batch losses share the global batch's denominator, so gradients add up (L2); DDP and
                # FSDP average gradients over ranks, where the batch's gradient is their sum: hence x world
                (loss * world).backward()
                loss_total += loss.item()
                for k, v in mb_metrics.items():  # token-weighted sums over micro-batches
                    sums[k] = sums.get(k, 0.0) + (v * mb_metrics["num_tokens"] if k != "num_tokens" else v)
                if epoch == 0 and completions and completions[0].logprobs:  # R2: sampler vs trainer, same weights
                    diff = (lp.detach() - sampler_lp[mb, : L - 1]).abs() * m_mask
                    parity.append((diff.sum().item(), diff.max().item()))
            loss_total = parallel.all_sum(loss_total)  # the global loss: every rank skips or steps alike
            grad_norm, stepped = optimizer_step(optimizer, trainable, loss_total, cfg.grad_clip)
            nonfinite_in_a_row = 0 if stepped else nonfinite_in_a_row + 1
            if not stepped:  # L6: the step was skipped; count it, and stop when it keeps happening
                skipped += 1
                print(f"step {step}: non-finite loss {loss_total} or grad norm {grad_norm.item()}; update skipped")
                if nonfinite_in_a_row >= cfg.max_nonfinite:
                    raise RuntimeError(f"{nonfinite_in_a_row} non-finite updates in a row; lower lr or check the data")
        times["time/update"] = time.perf_counter() - t0

        if cfg.ref_refresh_steps and (step + 1) % cfg.ref_refresh_steps == 0:  # F1: the reference catches up
            ref.load_state_dict(policy.state_dict())  # under FSDP2: shard to shard, both sharded alike

        # ---- log (M1): global figures (sums over ranks), written by rank 0
        sums = {k: parallel.all_sum(v) for k, v in sums.items()}
        n_tok = max(sums.get("num_tokens", 0.0), 1.0)
        kl = sums["kl"] / n_tok if "kl" in sums else None
        has_parity = parallel.all_max(len(parity)) > 0
        metrics = {
            "step": step, **rollout_metrics(drawn_all, stats, gather_batch(batch) if cfg.dynamic_sampling else None, G),
            "loss": loss_total, "kl": kl, "grad_norm": grad_norm.item(), "lr": lr, "beta": beta,
            "temperature": temperature, "skipped_updates": skipped, "refill_rounds": rounds,
            **{k: sums[k] / n_tok for k in ("clip_frac_low", "clip_frac_high", "approx_kl_old", "ratio", "entropy",
                                            "is_weight_mean", "is_limited_frac") if k in sums},
            "sampler_logprob_diff_mean": parallel.all_sum(sum(s for s, _ in parity)) / max(num_tokens, 1)
            if has_parity else None,
            "sampler_logprob_diff_max": parallel.all_max(max((m for _, m in parity), default=0.0)) if has_parity else None,
            "tokens": int(tokens), "pad_frac": 1 - tokens / padded,
            "mem/peak_gb": peak_memory_gb(),
            "time/checkpoint": checkpoint_seconds, **times, **memory, **evals,
        }
        gap = metrics["sampler_logprob_diff_mean"]
        if gap is not None and gap > cfg.parity_warn_eff and step >= next_parity_warning:  # R2, at most every 10 steps
            next_parity_warning = step + 10
            print(f"warning: step {step}: sampler vs trainer logprob gap {gap:.2e} > {cfg.parity_warn_eff} "
                  f"(parity_warn, {cfg.dtype}); "
                  "usual causes: stale weights (a push skipped, or weights reloaded from disk), a temperature "
                  "mismatch, or top_p/top_k < 1 (the trainer does not truncate)")
        if cfg.adaptive_kl and kl is not None:  # F2: every kl_window steps, scale beta by the mean token KL
            kl_history.append(kl)
            if len(kl_history) >= cfg.kl_window:
                beta = adaptive_kl_beta(beta, sum(kl_history) / len(kl_history), high=cfg.kl_high, low=cfg.kl_low,
                                        up=cfg.kl_up, down=cfg.kl_down)
                kl_history = []
        if cfg.sample_every and step % cfg.sample_every == 0 and rank == 0:  # W6: rank 0's groups, for --replay
            with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
                for r in range(min(cfg.sample_groups * G, len(completions))):
                    c = completions[r]
                    f.write(json.dumps({
                        "step": step, "problem": train_problems[batch["problem"][r]], "completion": c.text,
                        "reward": rewards[r].item(), "advantage": advantages[r].item(), "length": len(c.completion_ids),
                        "components": {k: v[r].item() for k, v in batch["components"].items()},
                        "weights": cfg.reward_weights, "last_number": cfg.math_last_number}) + "\n")

        # ---- eval at the end (M2), log, checkpoint
        checkpoint_seconds = end_step(cfg, step, metrics, t_step, engine, policy, test_problems, test_prompts,
                                      logger, save)
    return policy


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
