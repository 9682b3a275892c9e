"""GRPO, Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath sec. 4), on one node.

    python grpo.py                                   # the default run, on a laptop CPU
    python grpo.py --config config/countdown_3b.py   # Qwen2.5-3B-Instruct on Countdown, one GPU
    python grpo.py --config config/tiny.py --max_steps=4 --engine=hf
    torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py   # 8 GPUs (infra/)

Each step, as train_step() runs it, one named function a phase:
    engine.wake          wake the sampling engine and push the policy's weights into it (R1, R2)
    evaluate_in_run      every eval_every steps: the evals, before the update (M2)
    collect_rollouts     sample prompts, generate G completions each, score them (R3, R7, W1)
    engine.sleep         its GPU memory goes to the update (R1)
    group_advantages     each completion's reward against its own group's (A1-A3): GRPO's baseline
    prepare_update       padded tensors, response masks, micro-batches, token counts (L2, L3, O3)
    old_and_ref_logprobs the old and the reference policy's logprobs, once per batch (F1, L5, L7)
    update_policy        the clipped policy-gradient epochs, a step per mini-batch (L1-L7, O1, O2)
    adapt_beta           the KL weight follows the measured KL (F2)
    end_step             log (M1), the last step's eval (M2), checkpoint

The ids in brackets (R1, L2, ...) are the rows of the README's Techniques table, most of them a
setting in config.py.

With async_rollouts (R8) a sampler process runs the first four, a batch ahead with weights an
update older (run/async_rollouts.py); the trainer takes the batch and pushes its weights after each
update.

Where this departs from the GRPO paper (each a setting in config.py but the std's floor):
 1. Loss averaged over all response tokens of the batch (token-mean, L2) rather than per sequence
    first; the paper's seq-mean and Dr. GRPO's constant normaliser are options.
 2. No KL term by default (beta = 0, as TRL; DeepSeek-R1 used 0.001) rather than the paper's 0.04,
    so no reference model; beta > 0 brings it back (L4).
 3. Group std is the unbiased one, floored at 1e-4 (advantage.STD_FLOOR, A2); the paper does not
    say.
 4. One update per batch by default (num_iterations = 1, L7), so the ratio starts at exactly 1.
 5. Weights kept in fp32 with bf16 autocast where dtype is bfloat16 (a GPU, or a CPU with bf16
    arithmetic), logprobs and loss in fp32 (L6, O5).
 6. A group whose rewards are all equal has advantage 0: its tokens count in the token-mean, as in
    TRL, and with no KL or entropy term no pass computes it (zero_gradient_rows, exact). DAPO's
    filter and refill (R7), clip-higher, overlong masking, GSPO's sequence-level ratio and length
    shaping are off by default.

Read second, one folder away: run/ (prepare.py sets a run up, evals.py: pass@k, maj@n, eval sets),
episodes/ (the task-file contract; rollouts in turns: tools=True, TOOLS, environments), infra/
(log.py's metrics, checkpoints, torchrun), scoring/ (where a reward runs: a deadline, the sandbox)
and perf/ (each prompt once, chunked and fused logprobs, the CPU settings), each fast path one
setting.
"""

import functools
import math
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from advantage import component_advantages, group_advantages, group_stats, informative_groups
from config import ConfigError
from episodes.task import generate, mixture_metrics, multi_turn, score, split_reward
from infra import log, parallel
from infra.checkpoint import save_checkpoint
from infra.log import Diverged, Logger, diverged, dump_samples, end_step, memory_gb, timed
from loss import adaptive_kl_beta, grpo_loss, high_entropy_mask, lr_at, sampler_is_weights
from model import push_weights_iter, self_attending_mask, sequence_logprobs
from perf import shared_prompt
from rewards import length_rewards
from rollout import Rollouts, row_seeds
from run.async_rollouts import AsyncRollouts, Phases, load_pending
from run.evals import eval_only, evaluate_in_run, wake_and_evaluate
from run.prepare import make_engine, start_run

# ---------------------------------------------------------------- seeds and schedules


def sampling_seeds(cfg, step, first, count):
    """row_seeds of training step `step`: G rows for each of `count` prompts from slot `first`."""
    return row_seeds((cfg.seed, "train", step), first, count, cfg.group_size)


def temperature_at(step, cfg):
    """R4: constant, or linear from cfg.temperature to cfg.temperature_end over the run."""
    if cfg.temperature_end:
        progress = step / max(1, cfg.max_steps - 1)
        return cfg.temperature + (cfg.temperature_end - cfg.temperature) * progress
    return cfg.temperature


def eval_is_due(cfg, step):
    """M2 before this step's update: every eval_every steps (step 0: the base model); the last one
    comes after the last update, in end_step."""
    return bool(cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.max_steps - 1


# ---------------------------------------------------------------- rollouts (R3, R7, W1)

def generate_and_score(engine, train, idx, seeds, cfg, temperature):
    """G completions for each prompt index in idx, scored by the task's reward (W1)."""
    prompts = [train.prompt_ids[i] for i in idx]
    # the task's STOP ends a completion at its answer (kept in it): a base model does not sample
    # to max_completion_len past it and train on that with the answer's advantage
    try:
        groups = generate(engine, train.task, prompts, [train.problems[i] for i in idx],
                          cfg.group_size, seeds, temperature=temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, max_tokens=cfg.max_completion_len,
                          progress=sys.stdout.isatty())  # a progress bar on a terminal
    except FloatingPointError as e:  # the HF engine's logits (rollout.sample_next)
        raise diverged(cfg, str(e)) from None
    # cheap, and a silent mix-up would be costly
    if any(g[0].prompt_ids != p for g, p in zip(groups, prompts)):
        raise RuntimeError("the engine returned completions for other prompts than it was given")
    completions = [c for g in groups for c in g]  # (N,) = len(idx) * G
    # vLLM samples on from NaN logits (token 0 every time): its logprobs tell
    if any(not math.isfinite(x) for c in completions for x in c.logprobs):
        raise diverged(cfg, "the sampler's logprobs are not finite")
    problem = [i for i in idx for _ in range(cfg.group_size)]
    lengths = [len(c.completion_ids) for c in completions]
    start = time.perf_counter()
    rewards, components = score(train.task, [c.text for c in completions],
                                [train.problems[i] for i in problem], lengths, cfg,
                                [c.completion_ids for c in completions],
                                [c.env_rewards for c in completions])
    score_seconds = time.perf_counter() - start
    tool_errors = torch.tensor([float(c.tool_errors) for c in completions])
    # a failed call costs a little: the model learns to write code that runs
    if cfg.tool_error_penalty:
        rewards = rewards - cfg.tool_error_penalty * tool_errors
    if cfg.length_reward:  # W3, Kimi k1.5: within the group, shorter right answers earn more
        components["length_reward"] = length_rewards(torch.tensor(lengths), components.get(
            "correct", torch.zeros(len(lengths))), cfg.group_size) * (1 - components["errors"])
        rewards = rewards + cfg.length_reward * components["length_reward"]
    return Rollouts(
        problem=problem,
        completions=completions,
        rewards=rewards,
        components=components,
        lengths=torch.tensor(lengths, dtype=torch.float),
        truncated=torch.tensor([float(c.truncated) for c in completions]),
        tool_calls=torch.tensor([float(c.tool_calls) for c in completions]),
        tool_errors=tool_errors,
        # the tool's output tokens are the mask's zeros
        tool_tokens=torch.tensor([float(c.mask.count(0)) if c.mask else 0.0 for c in completions]),
        score_seconds=score_seconds,
        tool_seconds=sum(c.tool_seconds for c in completions),
    )


def zero_gradient_rows(batch, cfg):
    """The rows of groups whose rewards are all equal, where their gradient is exactly 0: their
    advantage is 0 and, with no KL term and no entropy term, nothing else weighs their tokens. No
    pass need compute them; their tokens still count in the token-mean (L2), as TRL counts them."""
    # A6 can give a group of equal sums a spread, and a teacher (L9) weighs every token
    weighed = cfg.beta or cfg.entropy_coef or cfg.entropy_top_quantile or cfg.teacher
    if weighed or cfg.adv_per_component:
        return set()
    busy = set(informative_groups(batch.rewards, cfg.group_size))
    return {i for i in range(len(batch)) if i // cfg.group_size not in busy}


def collect_rollouts(engine, prompt_sampler, train, cfg, step, temperature, times):
    """Sample prompts, generate G completions each, score them, refill (R7), feed the curriculum
    (D2): (batch, drawn, rounds).

    Every rank draws the same global prompts (same prompt sampler, same seed) and keeps its
    contiguous slice, so a group never straddles ranks. batch: this rank's rows to train on.
    drawn: every row drawn on every rank, the first draw and the refills, before R7's filter: what
    the log and the curriculum see.
    """
    G, world, rank = cfg.group_size, parallel.world(), parallel.rank()
    share = cfg.prompts_per_step // world  # prompts per rank, each with all its G completions
    t0 = time.perf_counter()
    idx = parallel.my_slice(prompt_sampler.sample(cfg.prompts_per_step, step))
    seeds = sampling_seeds(cfg, step, rank * share, share)
    batch = generate_and_score(engine, train, idx, seeds, cfg, temperature)
    drawn = batch.gathered()
    rounds, num_drawn = 0, cfg.prompts_per_step
    if cfg.dynamic_sampling:  # R7: keep only groups with a reward spread; refill (rounds > 0)
        batch = batch.groups(informative_groups(batch.rewards, G), G)
        # refill rounds follow the global minimum, so every rank draws the same prompts
        while rounds < cfg.dynamic_sampling_rounds:
            fewest = int(parallel.all_min(len(batch) // G))
            if fewest >= share:
                break
            need = share - fewest  # per rank; world * need fresh prompts in all
            idx = parallel.my_slice(prompt_sampler.sample(need * world, step))
            seeds = sampling_seeds(cfg, step, num_drawn + rank * need, need)
            more = generate_and_score(engine, train, idx, seeds, cfg, temperature)
            drawn = drawn + more.gathered()
            batch = batch + more.groups(informative_groups(more.rewards, G), G)
            rounds += 1
            num_drawn += need * world
        batch = batch.groups(range(min(share, len(batch) // G)), G)
    times["time/score"] = batch.score_seconds
    if multi_turn(cfg, train.task):  # the tool or environment calls, inside generation's turns
        times["time/tools"] = batch.tool_seconds
    spent = time.perf_counter() - t0
    times["time/generate"] = spent - times["time/score"] - times.get("time/tools", 0.0)
    if cfg.curriculum:  # D2: every group drawn, with its pass rate, feeds the curriculum
        stats = group_stats(drawn.rewards, G, correct=drawn.components.get("correct"))
        prompt_sampler.update(drawn.problem[::G], stats["pass_rate"].tolist())
    return batch, drawn, rounds


# ---------------------------------------------------------------- the update's tensors (L2, L3, O3)


def pad_batch(completions, pad_id):
    """Prompt + completion, right-padded, and the response-token mask in next-token coordinates.

    Returns input_ids (N, L), attention (N, L), mask (N, L-1), sampler_logprobs (N, L-1), where
    position t of mask/logprobs refers to the token input_ids[:, t + 1] (L3: prompt and padding are
    0). With tool calls the mask is also 0 on the tool's output tokens: they are context, not the
    model's actions, so they get no gradient, no KL, no entropy and no place in the token-mean.
    """
    # default=2: a rank left with no rows (R7 under torchrun) still gets (0, 2) tensors to pad
    L = max((len(c.prompt_ids) + len(c.completion_ids) for c in completions), default=2)
    N = len(completions)
    input_ids = torch.full((N, L), pad_id, dtype=torch.long)
    attention = torch.zeros(N, L, dtype=torch.long)
    mask = torch.zeros(N, L - 1)
    sampler_lp = torch.zeros(N, L - 1)
    for i, c in enumerate(completions):
        P, C = len(c.prompt_ids), len(c.completion_ids)
        input_ids[i, : P + C] = torch.tensor(c.prompt_ids + c.completion_ids)
        attention[i, : P + C] = 1
        own = torch.tensor(c.mask, dtype=torch.float) if c.mask is not None else 1
        mask[i, P - 1 : P - 1 + C] = own
        if c.logprobs:
            sampler_lp[i, P - 1 : P - 1 + C] = torch.tensor(c.logprobs)
    return input_ids, attention, mask, sampler_lp


def micro_batches(lengths, budget):
    """O3: rows, longest first, in micro-batches whose padded size (rows x longest) fits budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # similar lengths: less padding
    out, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] if current else out


@dataclass
class MiniBatch:
    """One optimizer step's rows: their micro-batches, the global counts its loss divides by."""

    micro: list  # micro-batches: lists of row indices (O3)
    num_tokens: int  # response tokens of the global mini-batch: the token-mean denominator (L2)
    num_seqs: int  # completions of the global mini-batch (seq-mean, dr-grpo)


@dataclass
class UpdateBatch:
    """This rank's rows as the update consumes them."""

    ids: torch.Tensor  # (N, L) prompt + completion, right-padded
    attention: torch.Tensor  # (N, L)
    mask: torch.Tensor  # (N, L-1) 1 on response tokens (L3, R6)
    sampler_lp: torch.Tensor  # (N, L-1) the engine's logprobs of the sampled tokens (R2)
    advantages: torch.Tensor  # (N,)
    prompt_lens: torch.Tensor  # (N,) prompt tokens of each row
    groups: torch.Tensor  # (N,) each row's group: its rows share their prompt (shared_prompt)
    minis: list  # MiniBatch per optimizer step of an epoch: one, or mini_batches of them (L7)
    tokens: float  # real tokens (prompt + completion) of the global batch: throughput, logged only
    # positions a pass over the global batch computes: padding in, shared prompts once
    computed: float
    computed_real: float  # the real tokens among them (pad_frac = 1 - computed_real / computed)
    has_sampler_logprobs: bool  # False for greedy samples, or an engine without logprobs

    @property
    def micro(self):
        """Every micro-batch of the batch, for the no-grad passes over all of it."""
        return [mb for mini in self.minis for mb in mini.micro]

    @property
    def num_tokens(self):
        """Response tokens of the global batch."""
        return sum(mini.num_tokens for mini in self.minis)


def mini_batch_rows(num_rows, G, mini_batches, first_group):
    """Row indices of each mini-batch: global group g goes to mini-batch g % mini_batches, so any
    number of ranks split the batch as one process does (first_group: the global index of this
    rank's first group)."""
    groups = range(num_rows // G)
    return [[g * G + j for g in groups if (first_group + g) % mini_batches == k for j in range(G)]
            for k in range(mini_batches)]


def plan_micro_batches(rows, lengths, prompt_lens, groups, cfg):
    """O3: one mini-batch's rows as micro-batches under the token budget:
    (micro-batches of row indices, positions a pass computes, real tokens among them)."""
    sub = [lengths[r] for r in rows]
    if cfg.shared_prompt:  # whole groups per micro-batch, each prompt computed once
        sizes = sub, [prompt_lens[r] for r in rows], [groups[r] for r in rows]
        plan, computed, real = shared_prompt.plan_micro_batches(*sizes, cfg)
    else:  # padded rows: rows x longest
        plan = micro_batches(sub, cfg.micro_batch_tokens)
        computed = sum(len(mb) * max(sub[i] for i in mb) for mb in plan)
        real = sum(sub)
    return [[rows[i] for i in mb] for mb in plan], computed, real  # back to the batch's rows


def prepare_update(batch, advantages, cfg, pad_id, device, idle=frozenset()):
    """Padded tensors, response masks, mini- and micro-batches under the token budget, global
    token counts. idle: rows counted in the token counts that reach no pass (zero_gradient_rows)."""
    ids, attention, mask, sampler_lp = pad_batch(batch.completions, pad_id)
    if cfg.mask_truncated:  # R6: a cut-off completion has no final answer to judge; no loss for it
        mask = mask * (1 - batch.truncated)[:, None]
    t = dict(ids=ids, attention=attention, mask=mask, sampler_lp=sampler_lp, advantages=advantages,
             prompt_lens=torch.tensor([len(c.prompt_ids) for c in batch.completions]),
             groups=torch.arange(len(batch)) // cfg.group_size)
    t = {k: v.to(device) for k, v in t.items()}
    sizes = t["attention"].sum(1).tolist(), t["prompt_lens"].tolist(), t["groups"].tolist()
    first_group = parallel.rank() * (cfg.prompts_per_step // parallel.world())
    minis, computed, computed_real = [], 0, 0
    for rows in mini_batch_rows(len(batch), cfg.group_size, cfg.mini_batches, first_group):
        micro, n, real = plan_micro_batches([r for r in rows if r not in idle], *sizes, cfg)
        computed += n
        computed_real += real
        # L2: token-mean over the response tokens of the whole (global) mini-batch
        num_tokens = int(parallel.all_sum(t["mask"][rows].sum()))
        minis.append(MiniBatch(micro, num_tokens, int(parallel.all_sum(len(rows)))))
    if parallel.world() > 1:  # FSDP gathers weights in every forward, DDP reduces in backward
        for mini in minis:
            t, mini.micro = parallel.even_micro_batches(t, mini.micro)
        t["prompt_lens"][len(batch):] = t["ids"].shape[1]  # an added row is all prompt
        t["groups"][len(batch):] = torch.arange(len(batch), len(t["groups"]), device=device)
    return UpdateBatch(**t, minis=minis, tokens=parallel.all_sum(attention.sum()),
                       computed=parallel.all_sum(computed),
                       computed_real=parallel.all_sum(computed_real),
                       has_sampler_logprobs=bool(batch.completions
                                                 and batch.completions[0].logprobs))


# ---------------------------------------------------------------- the passes (F1, L5-L7)


def forward_logprobs(model, ids, attention, cfg, temperature):
    """(logprobs, entropy), each (b, L-1) fp32, of the tokens ids[:, 1:] of right-padded rows (L6:
    bf16 compute under autocast, fp32 logprobs)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        return sequence_logprobs(model, ids, temperature, cfg, attention_mask=attention)


def micro_batch_logprobs(model, ub, mb, cfg, temperature):
    """(logprobs, entropy) of micro-batch mb (row indices), cut to its longest row L: each
    (b, L-1); padded rows (forward_logprobs), or each prompt once (shared_prompt)."""
    L = int(ub.attention[mb].sum(1).max())
    ids, attention = ub.ids[mb, :L], ub.attention[mb, :L]
    # on by default: a group's G completions on one pass over their prompt, not G; the same
    # logprobs as the padded forward_logprobs below to fp32 rounding (perf/shared_prompt.py). Read
    # forward_logprobs first
    if cfg.shared_prompt:
        return shared_prompt.shared_prompt_logprobs(
            model, ids, attention, ub.prompt_lens[mb], ub.groups[mb], temperature, cfg,
            sequence_logprobs=sequence_logprobs, self_attending_mask=self_attending_mask)
    return forward_logprobs(model, ids, attention, cfg, temperature)


@torch.no_grad()
def batch_logprobs(model, ub, cfg, temperature):
    """(N, L-1) logprobs and entropies of the whole batch under `model`, no grad (F1, L7)."""
    logprobs, entropy = torch.zeros_like(ub.mask), torch.zeros_like(ub.mask)
    for mb in ub.micro:
        lp, ent = micro_batch_logprobs(model, ub, mb, cfg, temperature)
        logprobs[mb, : lp.shape[1]] = lp
        entropy[mb, : lp.shape[1]] = ent
    return logprobs, entropy


@dataclass
class Passes:
    """What the update needs from no-grad passes over the batch first; None where not needed."""

    # (N, L-1) pi_old: the trainer's logprobs under the weights that sampled the batch, before
    # its first update (L7); None with one update a batch, where pi_old is the policy itself
    old: torch.Tensor = None
    ref: torch.Tensor = None  # (N, L-1) the reference's (F1, L4)
    pg_mask: torch.Tensor = None  # (N, L-1) the tokens that get the policy gradient (L5, "80/20")
    teacher: torch.Tensor = None  # (N, L-1) the teacher's (on-policy distillation, L9)


def old_and_ref_logprobs(policy, ref, ub, cfg, beta, temperature, times, teacher=None):
    """The old policy's logprobs, the reference's (only with beta > 0), entropy_top_quantile's mask,
    the teacher's (on-policy distillation).

    The old pass runs only when a batch gets more than one optimizer step (num_iterations or
    mini_batches > 1: from the second step on the policy is no longer the one that sampled), or when
    the batch's entropies are needed first. With one step per batch the old policy is the current
    one (accumulate_gradients).
    """
    passes = Passes()
    with timed(times, "time/old"):
        if cfg.num_iterations > 1 or cfg.mini_batches > 1 or cfg.entropy_top_quantile:
            passes.old, entropy = batch_logprobs(policy, ub, cfg, temperature)
            if cfg.entropy_top_quantile:  # only the highest-entropy tokens get the policy gradient
                passes.pg_mask = high_entropy_mask(entropy, ub.mask, cfg.entropy_top_quantile,
                                                   gather=parallel.all_gather_list)
    with timed(times, "time/ref"):
        if beta > 0 and cfg.lora_rank:  # F1: with LoRA the reference is the base, adapters off
            with policy.disable_adapter():
                passes.ref = batch_logprobs(policy, ub, cfg, temperature)[0]
        elif beta > 0:
            passes.ref = frozen_logprobs(ref, ub, cfg, temperature)
    with timed(times, "time/teacher"):
        if teacher is not None:  # L9: the teacher's logprobs of the student's own tokens
            passes.teacher = frozen_logprobs(teacher, ub, cfg, temperature)
    return passes


def frozen_logprobs(model, ub, cfg, temperature):
    """A frozen model's logprobs of the batch (the reference, a teacher), as the policy's are: on
    the device for the pass, on the CPU again after it with ref_offload."""
    model.to(ub.ids.device)
    logprobs = batch_logprobs(model, ub, cfg, temperature)[0]
    model.to("cpu" if cfg.ref_offload else ub.ids.device)
    return logprobs


# ---------------------------------------------------------------- the update (L1-L7, O1, O2)


def set_lr(optimizer, step, cfg):
    """O1: the learning rate of this step (warm-up, then cosine), set on every parameter group."""
    lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
               min_lr_ratio=cfg.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


@dataclass
class Update:
    """What update_policy reports: the last epoch's mean global loss, the last grad norm, sums."""

    loss: float
    grad_norm: torch.Tensor
    skipped: int  # optimizer steps skipped for a non-finite loss or grad norm (L6)
    steps: int  # optimizer steps taken: num_iterations x mini_batches, less the skipped ones
    zero_gradient: int  # of those, the steps whose every row had a zero gradient (momentum only)
    sums: dict  # loss metrics summed over micro-batches, each weighted by its token count
    parity: list  # (sum, max, tokens) of |pi_old - sampler| logprob per micro-batch (R2)


def update_policy(train_model, optimizer, params, ub, passes, cfg, temperature, state):
    """num_iterations epochs over the batch, each one optimizer step per mini-batch (L1-L7, O2)."""
    sums, parity, skipped, zero_gradient = {}, [], 0, 0
    for epoch in range(cfg.num_iterations):
        losses = []
        # mini_batches > 1: TRL's steps_per_generation, verl's ppo_mini_batch_size
        for k, mini in enumerate(ub.minis):
            desc = f"update {epoch + 1}/{cfg.num_iterations}"
            if len(ub.minis) > 1:
                desc += f", mini-batch {k + 1}/{len(ub.minis)}"
            loss = accumulate_gradients(train_model, ub, mini, passes, cfg, temperature, state,
                                        sums, parity if epoch == 0 else None, desc)
            # no row with a gradient on any rank (even_micro_batches gives all ranks work or none)
            if not mini.micro:
                zero_gradients(params)
                zero_gradient += 1
            loss = parallel.all_sum(loss)  # the global loss: every rank skips or steps alike
            grad_norm, stepped = optimizer_step(optimizer, params, loss, cfg.grad_clip)
            skipped += log.count_nonfinite(stepped, state, cfg, loss, grad_norm)
            losses.append(loss)
    steps = cfg.num_iterations * len(ub.minis) - skipped
    return Update(sum(losses) / len(losses), grad_norm, skipped, steps, zero_gradient, sums,
                  parity)


def zero_gradients(params):
    """The gradient a backward over rows whose gradient is 0 would leave: zeros, not None. AdamW
    skips a parameter whose grad is None; with a zero gradient it still steps, as TRL and verl do
    after such a batch: its momentum (and weight decay) move the weights, and its step count and
    second moment advance."""
    for p in params:
        p.grad = torch.zeros_like(p)


def accumulate_gradients(train_model, ub, mini, passes, cfg, temperature, state, sums, parity,
                         desc):
    """Forward and backward over one mini-batch's micro-batches; returns this rank's loss."""
    loss_total, world = 0.0, parallel.world()
    bar = tqdm(mini.micro, desc=desc, leave=False, disable=not sys.stdout.isatty())
    for i, mb in enumerate(bar):
        # DDP decides in the forward whether the backward all-reduces: on the last micro-batch
        with parallel.no_grad_sync(train_model, last=i == len(mini.micro) - 1):
            lp, entropy = micro_batch_logprobs(train_model, ub, mb, cfg, temperature)
        T = lp.shape[1]
        mask, sampler_lp = ub.mask[mb, :T], ub.sampler_lp[mb, :T]
        # with one optimizer step per batch the old policy is the current one: its own logprobs,
        # detached, no extra pass. The ratio exp(lp - lp.detach()) is then 1, but its gradient is
        # grad log pi: the loss's gradient is -A grad log pi, the policy gradient with the group as
        # baseline.
        # From a batch's second step on (L7), the ratio moves off 1 and the clip acts
        old = passes.old[mb, :T] if passes.old is not None else lp.detach()
        is_weights, is_metrics = None, {}
        if cfg.is_correction != "off":  # R2: correct for sampling from vLLM's q rather than pi_old
            level, action = cfg.is_correction.split("_")  # e.g. token_truncate: TIS
            is_weights, is_metrics = sampler_is_weights(old, sampler_lp, mask, cap=cfg.is_cap,
                                                        level=level, action=action,
                                                        floor=cfg.is_floor)
        behaviour = old  # pi_old of the ratio
        if cfg.old_logprobs == "sampler":  # R8: the ratio against the policy that sampled, q
            behaviour = sampler_lp
        loss, mb_metrics = grpo_loss(  # the loss's settings by their names: cfg has every one
            lp, behaviour, ub.advantages[mb], mask, cfg,
            ref_logprobs=passes.ref[mb, :T] if passes.ref is not None else None,
            beta=state.beta,
            entropy=entropy,
            num_tokens=mini.num_tokens,
            num_seqs=mini.num_seqs,
            is_weights=is_weights,
            pg_mask=passes.pg_mask[mb, :T] if passes.pg_mask is not None else None,
            teacher_logprobs=passes.teacher[mb, :T] if passes.teacher is not None else None,
        )
        # micro-batch losses share the global mini-batch's denominator, so gradients add up (L2);
        # DDP and FSDP average gradients over ranks, where the batch's gradient is their sum:
        # x world
        (loss * world).backward()
        loss_total += loss.item()
        add_token_weighted(sums, {**mb_metrics, **is_metrics})
        if parity is not None and ub.has_sampler_logprobs:  # R2: the sampler against pi_old
            diff = (old - sampler_lp).abs() * mask
            # over the computed rows' tokens: the idle rows (zero_gradient_rows) have no pi_old
            parity.append((diff.sum().item(), diff.max().item(), mask.sum().item()))
    return loss_total


def optimizer_step(optimizer, params, loss, grad_clip):
    """O2 + L6: clip the global grad norm and step, unless the loss or the norm is not finite.

    Returns (grad_norm, stepped). A skipped step leaves the weights and AdamW's moments untouched.
    `loss` is the global one, so every rank takes the same decision.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    grad_norm = parallel.grad_norm_value(grad_norm)  # FSDP2: a DTensor holding the global norm
    stepped = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def add_token_weighted(sums, metrics):
    """Add a micro-batch's token-mean metrics to running sums, weighted by its token count (counts,
    num_tokens and rows*, add as they are)."""
    for k, v in metrics.items():
        count = k == "num_tokens" or k.startswith("rows")
        sums[k] = sums.get(k, 0.0) + (v if count else v * metrics["num_tokens"])


def adapt_beta(state, kl, cfg):
    """F2: every kl_window steps, beta x 1.2 if the window's mean token KL is above kl_band, x 0.8
    if below."""
    if kl is None:  # no KL term this step
        return
    state.kl_history.append(kl)
    if len(state.kl_history) >= cfg.kl_window:
        mean_kl = sum(state.kl_history) / len(state.kl_history)
        state.beta = adaptive_kl_beta(state.beta, mean_kl, low=cfg.kl_band[0],
                                      high=cfg.kl_band[1])
        state.kl_history = []


# ---------------------------------------------------------------- the run


def main(argv, wrap_engine=lambda engine: engine):
    """Train (or with eval_only, evaluate). wrap_engine lets a test observe the engine's calls."""
    run = start_run(argv)  # the config and pre-flight, models, data, a resume (run/prepare.py)
    cfg = run.cfg
    if cfg.async_rollouts and not cfg.eval_only:  # R8: a sampler process makes the rollouts
        phases = Phases(collect_rollouts, temperature_at, eval_is_due)
        run.rollouts = AsyncRollouts(cfg, run.path, run.device, run.policy, run.prompt_sampler,
                                     run.state.step, phases, load_pending(run.resume_from))
        run.engine_name = f"{cfg.engine} in a sampler process"
        run.final_eval = run.rollouts.final_eval
        extra = run.rollouts.checkpoint_files  # the batches made for the steps after a checkpoint
    else:
        engine, run.engine_name = make_engine(cfg, run.path, run.device, run.policy, run.tokenizer,
                                              run.train.task)
        run.engine = wrap_engine(engine)
        run.final_eval = functools.partial(wake_and_evaluate, run.engine, run.policy,
                                           run.eval_sets, cfg)
        extra = None
    if cfg.eval_only:
        eval_only(cfg, run.engine, run.policy, run.eval_sets)
        return run.policy
    run.logger = Logger(cfg, run.state.run_id) if parallel.rank() == 0 else None
    # save() writes a checkpoint of the run as it stands when called (state is one object)
    run.save = functools.partial(save_checkpoint, cfg, run.policy, run.ref, run.tokenizer,
                                 run.optimizer, run.prompt_sampler, run.state, extra=extra)
    print(f"GRPO: {cfg.model} on {cfg.task}, engine {run.engine_name}, device {run.device} "
          f"({cfg.dtype}), ranks {parallel.world()}, steps {run.state.step}..{cfg.max_steps}")
    for step in range(run.state.step, cfg.max_steps):
        train_step(run, step)
    return run.policy


def train_step(run, step):
    """One step of GRPO, its phases in run order (the module's docstring lists them)."""
    cfg, state, policy, G = run.cfg, run.state, run.policy, run.cfg.group_size
    t_step, times, memory = time.perf_counter(), {}, {}
    temperature = temperature_at(step, cfg)
    batch, drawn, rounds, evals = rollout_phase(run, step, temperature, times, memory)

    # ---- group statistics of every group drawn (A4)
    stats = group_stats(drawn.rewards, G, correct=drawn.components.get("correct"))
    metrics = log.rollout_metrics(step, drawn, stats, batch, rounds, state.beta, temperature,
                                  cfg, multi_turn(cfg, run.train.task))
    metrics.update({**times, **memory, **evals, **mixture_metrics(run.train, drawn, G)})
    if parallel.all_sum(len(batch)) == 0:  # R7's filter dropped every group: nothing to train
        if cfg.dynamic_sampling_rounds:  # without refills a step like this is no surprise
            print(f"step {step}: no group with a reward spread after {rounds} refill rounds; "
                  "skipping the update")
        state.step = step + 1
        if cfg.async_rollouts:  # R8: the sampler waits for this version's tag
            run.rollouts.push(policy, state.step)
        metrics["skipped_empty_batch"] = 1
        run.checkpoint_seconds = end_step(cfg, step, metrics, t_step, run.final_eval, run.logger,
                                          run.save)
        return

    # ---- advantages against each prompt's group (A1-A3): GRPO's replacement for a critic
    if cfg.adv_per_component:  # A6, GDPO: each reward term against its group, then summed
        terms, weights = split_reward(run.train.task, cfg, batch.rewards, batch.components)
        advantages = component_advantages(terms, weights, G, cfg, batch_sum=parallel.all_sum)
    else:
        advantages = group_advantages(batch.rewards, G, cfg,  # the adv_* settings, by name
                                      batch_sum=parallel.all_sum)  # (N,) this rank's rows

    # ---- tensors, masks, micro-batches; the old and reference logprobs once (F1, L7)
    idle = set()
    if cfg.skip_zero_gradient:  # exact: no pass over rows whose gradient is 0; they still count
        idle = zero_gradient_rows(batch, cfg)
    ub = prepare_update(batch, advantages, cfg, run.tokenizer.pad_token_id, run.device, idle)
    passes = old_and_ref_logprobs(policy, run.ref, ub, cfg, state.beta, temperature, times,
                                  run.teacher)

    # ---- the update: num_iterations epochs, one optimizer step per mini-batch (L1-L7, O1, O2)
    lr = set_lr(run.optimizer, step, cfg)
    with timed(times, "time/update"):
        update = update_policy(run.train_model, run.optimizer, run.params, ub, passes, cfg,
                               temperature, state)
    if cfg.ref_refresh_steps and (step + 1) % cfg.ref_refresh_steps == 0:  # F1: catch up
        run.ref.load_state_dict(policy.state_dict())  # under FSDP2: shard to shard
    state.step = step + 1
    if cfg.async_rollouts:  # R8: the new weights to the sampler, for the batches to come
        run.rollouts.push(policy, state.step)

    # ---- log (M1) and check parity (R2); adaptive KL (F2); sample dumps (W6)
    metrics.update(log.step_metrics(update, ub, lr))
    metrics.update({"time/checkpoint": run.checkpoint_seconds, **times})
    run.next_parity_warning = log.warn_on_parity(metrics, cfg, step, run.next_parity_warning)
    if cfg.adaptive_kl:
        adapt_beta(state, metrics["kl"], cfg)
    if cfg.sample_every and step % cfg.sample_every == 0:
        dump_samples(cfg, step, batch, advantages, run.train.problems, run.tokenizer)

    # ---- eval after the last update (M2), the log line, checkpoint
    run.checkpoint_seconds = end_step(cfg, step, metrics, t_step, run.final_eval, run.logger,
                                      run.save)


def rollout_phase(run, step, temperature, times, memory):
    """The step's batch, (batch, drawn, rounds) as collect_rollouts gives them, and the evals."""
    if run.cfg.async_rollouts:  # R8: made meanwhile by the sampler process, with older weights
        return run.rollouts.next(step, times)
    # ---- wake the engine, push the policy into it (R1, R2); eval every eval_every steps
    with timed(times, "time/push"):
        run.engine.wake(push_weights_iter(run.policy))  # weights, push, KV
    memory["mem/after_wake_gb"] = memory_gb()
    evals = {}
    if eval_is_due(run.cfg, step):  # M2: every eval_every steps, before the update
        evals = evaluate_in_run(run.engine, run.eval_sets, run.cfg, step)

    # ---- sample prompts, generate G completions each, score them; R7 refills; D2
    batch, drawn, rounds = collect_rollouts(run.engine, run.prompt_sampler, run.train, run.cfg,
                                            step, temperature, times)

    # ---- put the engine to sleep: its GPU memory goes to the update (R1)
    with timed(times, "time/sleep"):
        run.engine.sleep()
    memory["mem/after_sleep_gb"] = memory_gb()
    return batch, drawn, rounds, evals


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except Diverged as e:  # metrics.jsonl and the checkpoints hold every step before it
        sys.exit(f"stopped: {e}")
