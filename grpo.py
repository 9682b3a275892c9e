"""GRPO, Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath sec. 4), on one node.

    python grpo.py                                   # the default run
    python grpo.py --config config/countdown_3b.py   # Qwen2.5-3B-Instruct on Countdown, one GPU
    python grpo.py --config config/tiny.py --max_steps=4 --engine=hf
    torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py   # 8 GPUs (parallel.py)

Each step, as main() runs it, one named function a phase:
    engine.wake          wake the sampling engine and push the policy's weights into it (R1, R2)
    collect_rollouts     sample prompts, generate G completions each, score them; refills (R3, R7, W1)
    engine.sleep         its GPU memory goes to the update (R1)
    group_advantages     each completion's reward against its own group's (A1-A3): GRPO's baseline
    prepare_update       padded tensors, response masks, micro-batches, global token counts (L2, L3, O3)
    old_and_ref_logprobs the old and the reference policy's logprobs, once per batch (F1, L5, L7)
    update_policy        PPO-clipped policy-gradient epochs; each a step per mini-batch (L1-L7, O1, O2)
    adapt_beta           the KL weight follows the measured KL (F2)
    step_metrics, end_step   log (M1), eval (M2), checkpoint

Where this departs from the GRPO paper (each is a setting in config.py):
 1. Loss averaged over all response tokens of the batch (token-mean, L2) rather than per sequence
    first; the paper's seq-mean and Dr. GRPO's constant normaliser are options.
 2. A small beta (0.001, as ms-swift's GRPO examples use) rather than the paper's 0.04; beta = 0
    drops the reference (L4).
 3. Group std is the unbiased one with a floor of 1e-4 (A2); the paper does not say.
 4. One update per batch by default (num_iterations = 1, L7), so the ratio starts at exactly 1.
 5. Weights kept in fp32 with bf16 autocast on a GPU, logprobs and loss in fp32 (L6, O5).
 6. Optional DAPO pieces (clip-higher, dynamic sampling, overlong masking), GSPO's sequence-level
    ratio, and length shaping; all off by default.
"""

import dataclasses
import errno
import fcntl
import functools
import glob
import json
import math
import os
import random
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

import parallel
from advantage import group_advantages, group_stats
from config import ConfigError, changed_settings, config_from_argv, save_config
from data.sampler import CurriculumSampler, PromptSampler
from loss import adaptive_kl_beta, grpo_loss, high_entropy_mask, lr_at, sampler_is_weights
from model import (
    BUILT_HERE,
    check_model_source,
    fused_head_unsupported,
    grouped_heads_on_cpu,
    load_policy,
    model_path,
    push_weights_iter,
    sequence_logprobs,
    shared_prompt_logprobs,
    tail_runs,
)
from preflight import preflight
from rollout import HFEngine, ToolEngine, VLLMEngine, auto_engine, derive_seed
from sandbox import run_python
from task import check_sandbox, check_task_output, load_problems, load_task, score, tokenize_prompts

# ---------------------------------------------------------------- seeds


def row_seeds(key, first, count, n):
    """One seed per row: n rows for each of `count` prompts at global slots first, first + 1, ...; prompt-major.

    Row j of slot i gets derive_seed(*key, i, j): a hash of the run's seed, the stream (a training step, or
    eval), the prompt's place in the step's global batch and the row's place in its group. Never the rank or
    the run's history: a resumed run, or N ranks, sample what one straight run does, and no two rows of a
    run, nor two turns of a tool rollout (rollout.turn_seed), share a seed.
    """
    return [derive_seed(*key, slot, j) for slot in range(first, first + count) for j in range(n)]


def sampling_seeds(cfg, step, first, count):
    """row_seeds of training step `step`: G rows for each of `count` prompts from global slot `first` on."""
    return row_seeds((cfg.seed, "train", step), first, count, cfg.group_size)


def temperature_at(step, cfg):
    """R4: constant, or linear from cfg.temperature to cfg.temperature_end over the run."""
    if cfg.temperature_end:
        return cfg.temperature + (cfg.temperature_end - cfg.temperature) * step / max(1, cfg.max_steps - 1)
    return cfg.temperature


# ---------------------------------------------------------------- rollouts (R3, R7, W1)


@dataclass
class Rollouts:
    """Scored completions of whole groups: the G rows of a prompt are contiguous. All fields are (N,)."""

    problem: list  # index of each row's problem
    completions: list  # rollout.Completion per row; empty in a gathered() copy (they stay on their rank)
    rewards: torch.Tensor  # shaped reward per row (W2, W3)
    components: dict  # reward component name -> (N,) tensor
    lengths: torch.Tensor  # completion tokens per row
    truncated: torch.Tensor  # 1.0 where the completion hit max_completion_len (R6)
    tools: torch.Tensor  # (N, 3) per row: tool calls, failed calls, tool-output tokens (all 0 without tools)
    score_seconds: float = 0.0
    tool_seconds: float = 0.0

    def __len__(self):
        return len(self.rewards)

    def groups(self, which, G):
        """The rows of the given group indices, in order."""
        rows = [g * G + j for g in which for j in range(G)]
        completions = [self.completions[r] for r in rows] if self.completions else []
        return Rollouts([self.problem[r] for r in rows], completions, self.rewards[rows],
                        {k: v[rows] for k, v in self.components.items()}, self.lengths[rows], self.truncated[rows],
                        self.tools[rows], self.score_seconds, self.tool_seconds)

    def component(self, name):
        """(N,) values of a reward component; 0 on rows that did not report it, as score_batch fills them."""
        return self.components.get(name, torch.zeros(len(self)))

    def __add__(self, other):
        """Both batches' rows, self's first (R7's refills). Components: both batches' names (a task may report
        a component for some problems only, and a batch whose rewards all failed has errors alone)."""
        names = sorted({*self.components, *other.components})
        return Rollouts(self.problem + other.problem, self.completions + other.completions,
                        torch.cat([self.rewards, other.rewards]),
                        {k: torch.cat([self.component(k), other.component(k)]) for k in names},
                        torch.cat([self.lengths, other.lengths]), torch.cat([self.truncated, other.truncated]),
                        torch.cat([self.tools, other.tools]), self.score_seconds + other.score_seconds,
                        self.tool_seconds + other.tool_seconds)

    def gathered(self):
        """Every rank's rows in rank order (= one process's order), without the completions themselves."""
        def gather(t):
            return torch.tensor(parallel.all_gather_list(t.tolist()))

        # every rank gathers the union of the ranks' component names, in one order: each gather pairs alike
        names = sorted(set(parallel.all_gather_list(sorted(self.components))))
        return Rollouts(parallel.all_gather_list(self.problem), [], gather(self.rewards),
                        {k: gather(self.component(k)) for k in names}, gather(self.lengths),
                        gather(self.truncated), gather(self.tools).view(-1, 3), self.score_seconds, self.tool_seconds)


def generate_and_score(engine, task, problems, prompt_ids, idx, seeds, cfg, temperature):
    """G completions for each prompt index in idx, scored by the task's reward (W1)."""
    groups = engine.generate([prompt_ids[i] for i in idx], cfg.group_size, seeds=seeds, temperature=temperature,
                             top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_completion_len,
                             progress=sys.stdout.isatty())  # a progress bar on a terminal
    if any(g[0].prompt_ids != prompt_ids[i] for g, i in zip(groups, idx)):  # cheap, and a silent mix-up is costly
        raise RuntimeError("the engine returned completions for other prompts than it was given")
    completions = [c for g in groups for c in g]  # (N,) = len(idx) * G
    problem = [i for i in idx for _ in range(cfg.group_size)]
    lengths = [len(c.completion_ids) for c in completions]
    start = time.perf_counter()
    rewards, components = score(task, [c.text for c in completions], [problems[i] for i in problem], lengths, cfg)
    tools = torch.tensor([[c.tool_calls, c.tool_errors, c.mask.count(0) if c.mask else 0] for c in completions],
                         dtype=torch.float).view(-1, 3)  # the tool's output tokens are the mask's zeros
    if cfg.tool_error_penalty:  # a failed tool call costs a little, so the model learns to write code that runs
        rewards = rewards - cfg.tool_error_penalty * tools[:, 1]
    return Rollouts(problem, completions, rewards, components, torch.tensor(lengths, dtype=torch.float),
                    torch.tensor([float(c.truncated) for c in completions]), tools, time.perf_counter() - start,
                    sum(c.tool_seconds for c in completions))


def informative_groups(rewards, G):
    """Indices of groups whose rewards are not all equal (R7: the others have zero advantage)."""
    return [g for g, row in enumerate(rewards.view(-1, G)) if row.max() > row.min()]


def collect_rollouts(engine, sampler, train, cfg, step, temperature, times):
    """Sample prompts, generate G completions each, score them, and refill (R7). Returns (batch, drawn, rounds).

    Every rank draws the same global prompts (same sampler, same seed) and keeps its contiguous slice, so a
    group never straddles ranks. batch: this rank's rows to train on. drawn: every row drawn on every rank,
    the first draw and the refills, before R7's filter: what the log and the curriculum see.
    """
    G, world, rank = cfg.group_size, parallel.world(), parallel.rank()
    share = cfg.prompts_per_step // world  # prompts per rank, each with all its G completions
    t0 = time.perf_counter()
    idx = parallel.my_slice(sampler.sample(cfg.prompts_per_step, step))
    batch = generate_and_score(engine, *train, idx, sampling_seeds(cfg, step, rank * share, share), cfg, temperature)
    drawn, rounds, num_drawn = batch.gathered(), 0, cfg.prompts_per_step
    if cfg.dynamic_sampling:  # R7: keep only groups with a reward spread; refill with fresh prompts
        batch = batch.groups(informative_groups(batch.rewards, G), G)
        # refill rounds are decided on the global minimum, so every rank draws from the sampler alike
        while (fewest := int(parallel.all_min(len(batch) // G))) < share and rounds < cfg.dynamic_sampling_rounds:
            need = share - fewest  # per rank; world * need fresh prompts in all
            idx = parallel.my_slice(sampler.sample(need * world, step))
            seeds = sampling_seeds(cfg, step, num_drawn + rank * need, need)
            more = generate_and_score(engine, *train, idx, seeds, cfg, temperature)
            drawn = drawn + more.gathered()
            batch = batch + more.groups(informative_groups(more.rewards, G), G)
            rounds, num_drawn = rounds + 1, num_drawn + need * world
        batch = batch.groups(range(min(share, len(batch) // G)), G)
    times["time/score"] = batch.score_seconds
    if cfg.tools:
        times["time/tools"] = batch.tool_seconds  # the sandboxed calls, inside the turns of generation
    times["time/generate"] = time.perf_counter() - t0 - times["time/score"] - times.get("time/tools", 0.0)
    return batch, drawn, rounds


# ---------------------------------------------------------------- the update's tensors and passes (L1-L7)


def pad_batch(completions, pad_id):
    """Prompt + completion, right-padded, and the response-token mask in next-token coordinates.

    Returns input_ids (N, L), attention (N, L), mask (N, L-1), sampler_logprobs (N, L-1), where
    position t of mask/logprobs refers to the token input_ids[:, t + 1] (L3: prompt and padding are 0).
    With tool calls the mask is also 0 on the tool's output tokens: they are context, not the model's
    actions, so they get no gradient, no KL, no entropy and are not counted in the token-mean.
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
        mask[i, P - 1 : P - 1 + C] = torch.tensor(c.mask, dtype=torch.float) if c.mask is not None else 1
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


def shared_prompt_cost(rows, lengths, prompt_lens, groups, runs=True):
    """(positions computed, real tokens among them) of one micro-batch under shared_prompt: each group's prompt
    but its last token once, (groups x longest), then every row's last prompt token + completion, each run of
    rows of similar length (tail_runs) padded to its longest: sum of (run rows x run longest)."""
    prompts = {groups[i]: prompt_lens[i] - 1 for i in rows}
    tails = [lengths[i] - prompt_lens[i] + 1 for i in rows]
    completions = sum(len(run) * max(tails[r] for r in run) for run in tail_runs(tails, runs))
    return len(prompts) * max(prompts.values()) + completions, sum(prompts.values()) + sum(tails)


def shared_micro_batches(lengths, prompt_lens, groups, budget, runs=True):
    """O3 under shared_prompt: whole groups together (longest group first) while the two passes fit `budget`
    positions (shared_prompt_cost); a group over the budget alone is split between its rows, each part
    computing the prompt once."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    order = sorted(members.values(), key=lambda rows: -max(lengths[i] for i in rows))
    out, current = [], []
    for i in (i for rows in order for i in sorted(rows, key=lambda i: -lengths[i])):
        if current and shared_prompt_cost(current + [i], lengths, prompt_lens, groups, runs)[0] > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] if current else out


@dataclass
class MiniBatch:
    """The rows of one optimizer step: their micro-batches, and the global counts its loss divides by."""

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
    groups: torch.Tensor  # (N,) each row's group: rows of a group share their prompt (shared_prompt)
    minis: list  # MiniBatch per optimizer step of an epoch: one, or mini_batches of them (L7)
    tokens: float  # real tokens (prompt + completion) of the global batch's rows
    computed: float  # positions a pass over the global batch computes: padding included, shared prompts once
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
    """Row indices of each mini-batch: global group g goes to mini-batch g % mini_batches, so N ranks split the
    batch exactly as one process does (first_group: the global index of this rank's first group)."""
    return [[g * G + j for g in range(num_rows // G) if (first_group + g) % mini_batches == k for j in range(G)]
            for k in range(mini_batches)]


def prepare_update(batch, advantages, cfg, pad_id, device):
    """Padded tensors, response masks, mini- and micro-batches under the token budget, global token counts."""
    ids, attention, mask, sampler_lp = pad_batch(batch.completions, pad_id)
    if cfg.mask_truncated:  # R6: a cut-off completion has no final answer to judge; give it no loss
        mask = mask * (1 - batch.truncated)[:, None]
    prompt_lens = torch.tensor([len(c.prompt_ids) for c in batch.completions], dtype=torch.long)
    groups = torch.arange(len(batch)) // cfg.group_size
    if cfg.shared_prompt:
        check_shared_prompts(batch.completions, cfg.group_size)
    ids, attention, mask, sampler_lp, advantages, prompt_lens, groups = (
        t.to(device) for t in (ids, attention, mask, sampler_lp, advantages, prompt_lens, groups))
    sizes = attention.sum(1).tolist(), prompt_lens.tolist(), groups.tolist()
    first_group = parallel.rank() * (cfg.prompts_per_step // parallel.world())
    minis, computed, computed_real = [], 0, 0
    for rows in mini_batch_rows(len(batch), cfg.group_size, cfg.mini_batches, first_group):
        micro, n, real = plan_micro_batches(rows, *sizes, cfg)
        computed, computed_real = computed + n, computed_real + real
        # L2: token-mean over the response tokens of the whole (global) mini-batch; the batch when mini_batches = 1
        minis.append(MiniBatch(micro, int(parallel.all_sum(mask[rows].sum())), int(parallel.all_sum(len(rows)))))
    tokens = parallel.all_sum(attention.sum())
    computed, computed_real = parallel.all_sum(computed), parallel.all_sum(computed_real)
    tensors = (ids, attention, mask, sampler_lp, advantages, prompt_lens, groups)
    if parallel.world() > 1:  # FSDP gathers weights in every forward, DDP reduces in backward: equal pass counts
        for mini in minis:
            tensors, mini.micro = parallel.even_micro_batches(tensors, mini.micro)
        tensors[5][len(batch):] = tensors[0].shape[1]  # an added row is all prompt, its own group
        tensors[6][len(batch):] = torch.arange(len(batch), len(tensors[6]), device=device)
    has_sampler_logprobs = bool(batch.completions and batch.completions[0].logprobs)
    return UpdateBatch(*tensors, minis, tokens, computed, computed_real, has_sampler_logprobs)


def plan_micro_batches(rows, lengths, prompt_lens, groups, cfg):
    """O3: one mini-batch's rows as micro-batches under the token budget; (micro, positions computed, real tokens)."""
    sub = [lengths[r] for r in rows], [prompt_lens[r] for r in rows], [groups[r] for r in rows]
    if cfg.shared_prompt:  # whole groups per micro-batch, each prompt computed once
        plan = shared_micro_batches(*sub, cfg.micro_batch_tokens, tail_runs_on(cfg))
        costs = [shared_prompt_cost(mb, *sub, tail_runs_on(cfg)) for mb in plan]
    else:  # padded rows: rows x longest
        plan = micro_batches(sub[0], cfg.micro_batch_tokens)
        costs = [(len(mb) * max(sub[0][i] for i in mb), sum(sub[0][i] for i in mb)) for mb in plan]
    micro = [[rows[i] for i in mb] for mb in plan]  # back to the batch's row indices
    return micro, sum(n for n, _ in costs), sum(real for _, real in costs)


def check_shared_prompts(completions, G):
    """shared_prompt computes a group's prompt once: its G rows must have the same prompt tokens."""
    for start in range(0, len(completions), G):
        if any(c.prompt_ids != completions[start].prompt_ids for c in completions[start : start + G]):
            raise ValueError(f"shared_prompt: the completions of group {start // G} do not share their prompt "
                             f"tokens (an engine that rewrites prompts?); set --shared_prompt=false")


def tail_runs_on(cfg):
    """Whether the completion pass runs rows of similar length together (several forwards a micro-batch): only on
    one rank, where the number of forwards may differ between micro-batches (FSDP and DDP ranks must match)."""
    return cfg.tail_runs and parallel.world() == 1


def forward_logprobs(model, ids, attention, cfg, temperature, prompt_lens=None, groups=None):
    """(logprobs, entropy), each (b, L-1) fp32, for the tokens ids[:, 1:] (L6: bf16 compute, fp32 logprobs).

    With prompt_lens and groups (b,), rows of a group share their prompt and it is computed once.
    """
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
        if prompt_lens is not None:
            return shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, temperature, cfg.fused_logprobs,
                                          tail_runs_on(cfg))
        return sequence_logprobs(model, ids, temperature, cfg.fused_logprobs, attention_mask=attention)


def micro_batch_logprobs(model, ub, mb, cfg, temperature):
    """forward_logprobs of micro-batch mb (row indices), cut to its longest row L: each (b, L-1)."""
    L = int(ub.attention[mb].sum(1).max())
    ids, attention = ub.ids[mb, :L], ub.attention[mb, :L]
    if cfg.shared_prompt:  # a group's G completions on one pass over their prompt, not G (Prefix Grouper)
        return forward_logprobs(model, ids, attention, cfg, temperature, ub.prompt_lens[mb], ub.groups[mb])
    return forward_logprobs(model, ids, attention, cfg, temperature)


@torch.no_grad()
def batch_logprobs(model, ub, cfg, temperature):
    """(N, L-1) logprobs and entropies of the whole batch under `model`, no grad: the old or the reference (F1, L7)."""
    logprobs, entropy = torch.zeros_like(ub.mask), torch.zeros_like(ub.mask)
    for mb in ub.micro:
        lp, ent = micro_batch_logprobs(model, ub, mb, cfg, temperature)
        logprobs[mb, : lp.shape[1]], entropy[mb, : lp.shape[1]] = lp, ent
    return logprobs, entropy


@dataclass
class Passes:
    """What the update needs from no-grad passes over the batch before it starts; None where not needed."""

    old: torch.Tensor = None  # (N, L-1) the sampling policy's logprobs (L7)
    ref: torch.Tensor = None  # (N, L-1) the reference's (F1, L4)
    pg_mask: torch.Tensor = None  # (N, L-1) the tokens that get the policy gradient (entropy_top_quantile)


def old_and_ref_logprobs(policy, ref, ub, cfg, beta, temperature, times):
    """The old policy's logprobs, the reference's (only with beta > 0), and entropy_top_quantile's token mask.

    The old pass runs only when a batch gets more than one optimizer step (num_iterations or mini_batches > 1:
    from the second step on the policy is no longer the one that sampled), or when the batch's entropies are
    needed before the update. With one step per batch the old policy is the current one (update_policy).
    """
    passes = Passes()
    with timed(times, "time/old"):
        if cfg.num_iterations > 1 or cfg.mini_batches > 1 or cfg.entropy_top_quantile:
            passes.old, entropy = batch_logprobs(policy, ub, cfg, temperature)
            if cfg.entropy_top_quantile:  # "80/20": only the batch's highest-entropy tokens get the policy gradient
                passes.pg_mask = high_entropy_mask(entropy, ub.mask, cfg.entropy_top_quantile,
                                                   gather=parallel.all_gather_list)
    with timed(times, "time/ref"):
        if beta > 0 and cfg.lora_rank:  # F1: with LoRA the reference is the base model, adapters disabled
            with policy.disable_adapter():
                passes.ref = batch_logprobs(policy, ub, cfg, temperature)[0]
        elif beta > 0:
            ref.to(ub.ids.device)
            passes.ref = batch_logprobs(ref, ub, cfg, temperature)[0]
            ref.to("cpu" if cfg.ref_offload else ub.ids.device)
    return passes


def set_lr(optimizer, step, cfg):
    """O1: the learning rate of this step (warm-up, then cosine), set on every parameter group."""
    lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


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


@dataclass
class Update:
    """What update_policy reports: the last epoch's mean global loss, the last grad norm, sums over all epochs."""

    loss: float
    grad_norm: torch.Tensor
    skipped: int  # optimizer steps skipped for a non-finite loss or grad norm (L6)
    steps: int  # optimizer steps taken: num_iterations x mini_batches, less the skipped ones
    sums: dict  # loss metrics summed over micro-batches, each weighted by its token count
    parity: list  # (sum, max) of |pi_old - sampler| logprob per micro-batch (R2)


def update_policy(train_model, optimizer, params, ub, passes, cfg, temperature, state):
    """num_iterations epochs over the batch, each one optimizer step per mini-batch (L1-L7, O2)."""
    sums, parity, skipped = {}, [], 0
    for epoch in range(cfg.num_iterations):
        losses = []
        for k, mini in enumerate(ub.minis):  # mini_batches > 1: TRL's steps_per_generation, verl's ppo_mini_batch
            desc = f"update {epoch + 1}/{cfg.num_iterations}"
            if len(ub.minis) > 1:
                desc += f", mini-batch {k + 1}/{len(ub.minis)}"
            loss = accumulate_gradients(train_model, ub, mini, passes, cfg, temperature, state, sums,
                                        parity if epoch == 0 else None, desc)
            loss = parallel.all_sum(loss)  # the global loss: every rank skips or steps alike
            grad_norm, stepped = optimizer_step(optimizer, params, loss, cfg.grad_clip)
            skipped += count_nonfinite(stepped, state, cfg, loss, grad_norm)
            losses.append(loss)
    steps = cfg.num_iterations * len(ub.minis) - skipped
    return Update(sum(losses) / len(losses), grad_norm, skipped, steps, sums, parity)


def accumulate_gradients(train_model, ub, mini, passes, cfg, temperature, state, sums, parity, desc):
    """Forward and backward over one mini-batch's micro-batches; returns this rank's share of its loss."""
    loss_total, world = 0.0, parallel.world()
    for i, mb in enumerate(tqdm(mini.micro, desc=desc, leave=False, disable=not sys.stdout.isatty())):
        with parallel.no_grad_sync(train_model, last=i == len(mini.micro) - 1):  # DDP decides in the forward
            lp, entropy = micro_batch_logprobs(train_model, ub, mb, cfg, temperature)
        L = lp.shape[1] + 1
        mask, sampler_lp = ub.mask[mb, : L - 1], ub.sampler_lp[mb, : L - 1]
        # with one optimizer step per batch the old policy is the current one: its own logprobs, detached, with
        # no extra pass; from the second step on (num_iterations or mini_batches > 1) the ratio and the clip act
        old = passes.old[mb, : L - 1] if passes.old is not None else lp.detach()
        is_weights, is_metrics = None, {}
        if cfg.is_correction != "off":  # R2: correct for sampling from vLLM's q rather than pi_old
            cap = cfg.is_cap if cfg.is_correction == "token" else cfg.is_seq_cap
            is_weights, is_metrics = sampler_is_weights(old, sampler_lp, mask, level=cfg.is_correction,
                                                        action=cfg.is_mode, cap=cap)
        loss, mb_metrics = grpo_loss(
            lp, old, ub.advantages[mb], mask,
            ref_logprobs=passes.ref[mb, : L - 1] if passes.ref is not None else None, beta=state.beta,
            clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high_eff, agg=cfg.loss_agg,
            num_tokens=mini.num_tokens, num_seqs=mini.num_seqs, max_len=cfg.max_completion_len,
            entropy=entropy, entropy_coef=cfg.entropy_coef, ratio_level=cfg.ratio_level, is_weights=is_weights,
            policy_loss=cfg.policy_loss, dual_clip=cfg.dual_clip, sapo_tau_pos=cfg.sapo_tau_pos,
            sapo_tau_neg=cfg.sapo_tau_neg, kl_estimator=cfg.kl_estimator,
            pg_mask=passes.pg_mask[mb, : L - 1] if passes.pg_mask is not None else None)
        # micro-batch losses share the global mini-batch's denominator, so gradients add up (L2); DDP and
        # FSDP average gradients over ranks, where the mini-batch's gradient is their sum: hence x world
        (loss * world).backward()
        loss_total += loss.item()
        add_token_weighted(sums, {**mb_metrics, **is_metrics})
        if parity is not None and ub.has_sampler_logprobs:  # R2: the sampler against pi_old, on the same weights
            diff = (old - sampler_lp).abs() * mask
            parity.append((diff.sum().item(), diff.max().item()))
    return loss_total


def add_token_weighted(sums, metrics):
    """Add a micro-batch's token-mean metrics to running sums, weighted by its token count."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + (v * metrics["num_tokens"] if k != "num_tokens" else v)


def count_nonfinite(stepped, state, cfg, loss, grad_norm):
    """L6: 1 if the step was skipped (non-finite loss or grad norm), else 0; too many in a row stop the run."""
    state.nonfinite_in_a_row = 0 if stepped else state.nonfinite_in_a_row + 1
    if stepped:
        return 0
    print(f"step {state.step}: non-finite loss {loss} or grad norm {grad_norm.item()}; update skipped")
    if state.nonfinite_in_a_row >= cfg.max_nonfinite:
        raise RuntimeError(f"{state.nonfinite_in_a_row} non-finite updates in a row; lower lr or check the data")
    return 1


# ---------------------------------------------------------------- adaptive KL (F2)


def adapt_beta(state, kl, cfg):
    """F2: every kl_window steps, scale beta by the window's mean token KL (a no-op when off)."""
    if not cfg.adaptive_kl or kl is None:
        return
    state.kl_history.append(kl)
    if len(state.kl_history) >= cfg.kl_window:
        mean_kl = sum(state.kl_history) / len(state.kl_history)
        state.beta = adaptive_kl_beta(state.beta, mean_kl, high=cfg.kl_high, low=cfg.kl_low, up=cfg.kl_up,
                                      down=cfg.kl_down)
        state.kl_history = []


# ---------------------------------------------------------------- log (M1), parity (R2), samples (W6)


@contextmanager
def timed(times, key):
    """Add the seconds of the with-block to times[key] (the keys are bench.PHASES')."""
    start = time.perf_counter()
    yield
    times[key] = times.get(key, 0.0) + time.perf_counter() - start


def peak_memory_gb():
    """Peak memory so far: CUDA allocations on a GPU, the process's peak resident set on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def keep_freed_memory():
    """On a CPU, glibc keeps freed memory in the process for the next allocation (cpu_keep_memory); True if set.

    By default each block over a threshold (32 MB at most) gets its own mapping and goes back to the kernel
    when freed, so every micro-batch's logits, gradients and activations are faulted back in and zeroed page
    by page (the default run's update took 40 s with it off, 32 s on, on a 2-core VM). Without mappings, and
    with the heap's top kept, the next micro-batch reuses the same memory; the resident set then stays near
    its peak between steps.
    """
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):  # not glibc (macOS, musl): its allocator is left as it is
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def memory_gb():
    """GPU memory in use on this device (all processes), or this process's resident memory on a CPU."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def mean_of(components, name):
    """The mean of a reward component, or None when the task does not report it."""
    return components[name].mean().item() if name in components else None


def rollout_metrics(drawn, stats, kept, G, tools=False):
    """M1 and A4 over every rollout drawn this step (all ranks); with R7, the kept batch's under kept/."""
    out = {
        "reward": drawn.rewards.mean().item(),
        "reward_std": drawn.rewards.std().item(),
        **{f"reward/{k}": v.mean().item() for k, v in drawn.components.items() if k not in ("errors", "timeouts")},
        "reward/errors": int(drawn.components["errors"].sum()),  # completions whose reward raised or hung
        "reward/timeouts": int(drawn.components["timeouts"].sum()),  # of those, the ones past reward_timeout
        "acc": mean_of(drawn.components, "correct"),  # None for a task without a notion of correct
        "format": mean_of(drawn.components, "format"),
        "response_length": drawn.lengths.mean().item(),
        "truncated": drawn.truncated.mean().item(),
        "gen_tokens": int(drawn.lengths.sum()),
        "group_std": stats["group_std"],
        "effective_group_ratio": stats["effective_group_ratio"],
        "frac_reward_zero_std": stats["frac_reward_zero_std"],
    }
    if tools:  # multi-turn rollouts: how much the model uses the tool, and how well
        calls, errors, output_tokens = drawn.tools.sum(0).tolist()
        out["tools/calls_per_completion"] = calls / len(drawn)
        out["tools/error_rate"] = errors / calls if calls else None  # failed calls / calls
        out["tools/share_using"] = (drawn.tools[:, 0] > 0).float().mean().item()  # completions with a call
        out["tools/output_tokens"] = int(output_tokens)  # tool-output tokens this step: context, not trained on
    if kept is not None:  # R7: what the update trained on
        out["kept/prompts"] = len(kept) // G
        out["kept/reward"] = kept.rewards.mean().item() if len(kept) else None
        out["kept/acc"] = mean_of(kept.components, "correct") if len(kept) else None
        out["drawn/prompts"] = len(drawn) // G
    return out


def step_metrics(update, ub, lr):
    """M1 of the update: global sums over ranks, token means, parity, token counts, memory."""
    sums = {k: parallel.all_sum(v) for k, v in update.sums.items()}
    n_tok = max(sums.get("num_tokens", 0.0), 1.0)
    out = {
        "loss": update.loss,
        "kl": sums["kl"] / n_tok if "kl" in sums else None,
        "grad_norm": update.grad_norm.item(),
        "lr": lr,
        "skipped_updates": update.skipped,
        "optimizer_steps": update.steps,
    }
    for k in ("clip_frac_low", "clip_frac_high", "approx_kl_old", "ratio", "entropy", "is_weight_mean",
              "is_limited_frac", "dual_clip_frac", "pg_token_frac"):
        if k in sums:
            out[k] = sums[k] / n_tok
    has_parity = parallel.all_max(len(update.parity)) > 0
    out["sampler_logprob_diff_mean"] = None
    out["sampler_logprob_diff_max"] = None
    if has_parity:
        out["sampler_logprob_diff_mean"] = parallel.all_sum(sum(s for s, _ in update.parity)) / max(ub.num_tokens, 1)
        out["sampler_logprob_diff_max"] = parallel.all_max(max((m for _, m in update.parity), default=0.0))
    out["tokens"] = int(ub.tokens)
    out["tokens_computed"] = int(ub.computed)  # positions one pass runs; below `tokens` when prompts are shared
    out["pad_frac"] = 1 - ub.computed_real / ub.computed
    out["mem/peak_gb"] = peak_memory_gb()
    return out


def warn_on_parity(metrics, cfg, step, next_warning):
    """R2: warn, at most every 10 steps, when the sampler's logprobs stray from the trainer's; the next step due."""
    gap = metrics["sampler_logprob_diff_mean"]
    if gap is None or gap <= cfg.parity_warn_eff or step < next_warning:
        return next_warning
    print(f"warning: step {step}: sampler vs trainer logprob gap {gap:.2e} > {cfg.parity_warn_eff} "
          f"(parity_warn, {cfg.dtype}); usual causes: stale weights (a push skipped, or weights reloaded from "
          "disk), a temperature mismatch, or top_p/top_k < 1 (the trainer does not truncate)")
    return step + 10


def dump_samples(cfg, step, batch, advantages, problems, tokenizer):
    """W6: every sample_every steps, a few of rank 0's whole groups to samples.jsonl (rewards.py --replay re-scores)."""
    if not cfg.sample_every or step % cfg.sample_every or parallel.rank() > 0:
        return
    with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
        for r in range(min(cfg.sample_groups * cfg.group_size, len(batch))):
            c = batch.completions[r]
            f.write(json.dumps({
                "step": step, "problem": problems[batch.problem[r]], "completion": c.text,
                "reward": batch.rewards[r].item(), "advantage": advantages[r].item(), "length": len(c.completion_ids),
                "components": {k: v[r].item() for k, v in batch.components.items()},
                **({"turns": turns(c, tokenizer), "tool_errors": c.tool_errors} if c.mask is not None else {})}) + "\n")


def turns(completion, tokenizer):
    """A tool rollout's completion as its turns: [["model", text], ["tool", text], ...] from the token mask."""
    out, ids = [], completion.completion_ids
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or completion.mask[t] != completion.mask[start]:
            out.append(["model" if completion.mask[start] else "tool", tokenizer.decode(ids[start:t])])
            start = t
    return out


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
        shown = ("reward", "acc", "format", "kl", "response_length", "loss", "grad_norm", "time/step")
        line = " | ".join(f"{k} {metrics[k]:.4g}" for k in shown if metrics.get(k) is not None)
        print(f"step {step} | {line}", flush=True)


# ---------------------------------------------------------------- eval (M2)


def evaluate(engine, task, problems, prompt_ids, cfg, seed):
    """pass@1 with greedy decoding, pass@k from k samples at the training temperature, format, length.

    reward: the greedy answers' mean shaped reward. parsed: the share of greedy answers given in a tag or
    a box (what unparsed_penalty rewards). pass@k, format and parsed need the task to report "correct",
    "format", "parsed". Returns (metrics, greedy completion texts). Under torchrun every rank evaluates the
    whole test set the same way (FSDP needs the ranks in step; test sets are small); rank 0 logs it.
    """
    idx = list(range(len(problems)))
    # the eval stream's own seeds, the same at every eval: evals differ by the weights alone
    seeds = row_seeds((seed, "eval"), 0, len(idx), cfg.eval_k)
    greedy = engine.generate([prompt_ids[i] for i in idx], 1, seeds=seeds[:: cfg.eval_k], temperature=0.0, top_p=1.0,
                             top_k=-1, max_tokens=cfg.max_completion_len)
    texts = [g[0].text for g in greedy]
    rewards, comps = score(task, texts, problems, [len(g[0].completion_ids) for g in greedy], cfg)
    # every rank generates the same calls whatever the rewards say (FSDP's HF engine generates in lockstep)
    sampled = engine.generate([prompt_ids[i] for i in idx], cfg.eval_k, seeds=seeds, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_completion_len)
    flat = [c for g in sampled for c in g]
    _, sampled_comps = score(task, [c.text for c in flat], [problems[i] for i in idx for _ in range(cfg.eval_k)],
                             [len(c.completion_ids) for c in flat], cfg)
    out = {"eval/reward": rewards.mean().item()}
    if "correct" in comps:
        correct = sampled_comps.get("correct", torch.zeros(len(flat)))
        out["eval/pass@1_greedy"] = (comps["correct"] >= 1).float().mean().item()
        out[f"eval/pass@{cfg.eval_k}"] = (correct.view(-1, cfg.eval_k) >= 1).any(dim=1).float().mean().item()
        out["eval/mean_correct_sampled"] = correct.mean().item()
    for name in ("format", "parsed"):
        if name in comps:
            out[f"eval/{name}"] = comps[name].mean().item()
    out["eval/response_length"] = sum(len(g[0].completion_ids) for g in greedy) / len(greedy)
    if cfg.tools:  # the greedy answers that called the tool
        out["eval/tools/share_using"] = sum(g[0].tool_calls > 0 for g in greedy) / len(greedy)
    return out, texts


def eval_due(engine, test, cfg, step):
    """M2 before the step's update every eval_every steps (step 0: the base model); the last comes in end_step."""
    if not cfg.eval_every or step % cfg.eval_every or step >= cfg.max_steps - 1:
        return {}
    start = time.perf_counter()
    metrics = evaluate(engine, *test, cfg, seed=cfg.seed)[0]
    return {**metrics, "eval/updates": step, "time/eval": time.perf_counter() - start}


def eval_only(cfg, engine, policy, task, test_problems, test_prompts):
    """M2 on the weights as they are (the model, or init_from): print, and append to out_dir/eval.jsonl."""
    engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))
    metrics, texts = evaluate(engine, task, test_problems, test_prompts, cfg, cfg.seed)
    examples = [{"prompt": task.prompt(p), "completion": t} for p, t in zip(test_problems[:4], texts)]  # to read
    results = {"weights": cfg.init_from or cfg.model, **metrics, "examples": examples}
    if parallel.rank() == 0:
        with open(os.path.join(cfg.out_dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(results) + "\n")
    print(json.dumps(results, indent=1))


# ---------------------------------------------------------------- checkpoints


@dataclass
class TrainState:
    """Everything of the run besides models, optimizer and sampler that a resume needs (trainer_state.json)."""

    step: int = 0  # updates done
    beta: float = 0.0  # the KL weight now (F2 moves it)
    kl_history: list = dataclasses.field(default_factory=list)  # F2: the current window's mean token KLs
    nonfinite_in_a_row: int = 0  # L6
    run_id: str = ""  # names the wandb run; a resume keeps it


def checkpoints(out_dir):
    """Complete checkpoint folders, oldest first (an interrupted save is a .tmp folder and never listed)."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*")))


def save_checkpoint(cfg, policy, ref, tokenizer, optimizer, sampler, state):
    """Write everything to a temp folder, then rename it: a kill at any moment leaves the last one whole.

    Called on every rank: the full (unsharded) states are gathered to rank 0, which alone writes. The
    same files whatever the number of ranks, so any number can resume them, and from_pretrained reads them.
    """
    model_state, optimizer_state = parallel.full_state(policy, optimizer)  # optimizer keyed by parameter name
    ref_state = parallel.full_state(ref)[0] if cfg.ref_refresh_steps and ref is not None else None
    if parallel.rank() > 0:
        parallel.barrier()
        return
    final = os.path.join(cfg.out_dir, f"ckpt_{state.step:06d}")
    tmp = os.path.join(cfg.out_dir, f".tmp_ckpt_{state.step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=model_state)  # with LoRA: the adapter only
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
    torch.save(rng_states(), os.path.join(tmp, "rng.pt"))
    if ref_state is not None:
        torch.save(ref_state, os.path.join(tmp, "reference.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({**dataclasses.asdict(state), "sampler": sampler.state_dict()}, f)
    save_config(cfg, os.path.join(tmp, "grpo_config.json"))  # config.json is the HF model config
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic on one file system
    for old in checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old)
    parallel.barrier()  # the other ranks wait until the checkpoint is whole


def load_checkpoint(folder, cfg, policy, ref, optimizer, sampler):
    """Restore what save_checkpoint wrote (the policy's weights are loaded with the model); the TrainState."""
    with open(os.path.join(folder, "trainer_state.json")) as f:
        saved = json.load(f)
    sampler.load_state_dict(saved.pop("sampler"))
    state = TrainState(**{k: saved[k] for k in ("step", "beta", "kl_history", "nonfinite_in_a_row")},
                       run_id=saved.get("run_id", ""))
    parallel.load_optimizer(policy, optimizer, torch.load(os.path.join(folder, "optimizer.pt")))
    restore_rng(torch.load(os.path.join(folder, "rng.pt"), weights_only=False))
    if ref is not None and cfg.ref_refresh_steps:
        parallel.load_model(ref, torch.load(os.path.join(folder, "reference.pt")))
    print(f"resumed from {folder} at step {state.step}")
    return state


def rng_states():
    """The RNG states a checkpoint keeps. CUDA's is this process's device's only: the run may resume
    on fewer GPUs than it was saved on."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": cuda}


def restore_rng(rng):
    """Restore rng_states(); the CUDA state goes to this process's device."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    cuda = rng["cuda"]
    if isinstance(cuda, list):  # an older checkpoint's: every visible device's, rank 0's own first
        cuda = cuda[0] if cuda else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def truncate_log(path, step):
    """Drop the lines of steps >= step from a JSONL log: they were written after the checkpoint we
    resume from. A torn last line (a kill or a full disk mid-write) is dropped too, and said; a
    damaged line elsewhere is an error naming it."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        lines = f.read().splitlines() if step else []  # from step 0 nothing is kept
    keep = []
    for lineno, line in enumerate(lines, 1):
        try:
            logged = json.loads(line)["step"] if line.strip() else step
        except (ValueError, KeyError, TypeError):
            if lineno < len(lines):
                raise ConfigError(f"{path}, line {lineno} is not a log record; delete that line, "
                                  "or every line from it on, and resume again") from None
            print(f"{path}: its last line was cut off mid-write (the run was killed, or the disk "
                  "filled); dropped it")
            continue
        if logged < step:
            keep.append(line + b"\n")
    with open(path + ".tmp", "wb") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def end_step(cfg, step, metrics, t_step, engine, policy, test, logger, save):
    """M2 after the last update, the log line (written before the checkpoint, so a resume never loses it), and
    the checkpoint when one is due. Returns the checkpoint's seconds (logged with the next step)."""
    last = step == cfg.max_steps - 1
    if last:
        t0 = time.perf_counter()
        engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))
        metrics.update(evaluate(engine, *test, cfg, seed=cfg.seed)[0])
        metrics["eval/updates"] = step + 1
        metrics["time/eval"] = metrics.get("time/eval", 0.0) + time.perf_counter() - t0
    metrics["time/step"] = time.perf_counter() - t_step
    if logger is not None:  # rank 0
        logger.log(metrics)
    t0 = time.perf_counter()
    if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
        save()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- setting up a run


OUT_DIR_LOCKS = {}  # out_dir/.lock -> its open file: the lock lasts while the file stays open


def lock_out_dir(out_dir):
    """Hold out_dir/.lock for the life of this process, or fail at once naming the one holding it.

    A POSIX lock (lockf): the kernel drops it when its process ends, however it ends, so a killed
    run's lock never blocks; and unlike flock's, the processes forked later do not hold it too.
    """
    path = os.path.join(out_dir, ".lock")
    held = OUT_DIR_LOCKS.get(os.path.realpath(path))
    if held and os.path.exists(path) and os.path.samestat(os.fstat(held.fileno()), os.stat(path)):
        return  # this process holds it (main called again)
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second run on "
                  "this out_dir")
            return
        raise ConfigError(f"out_dir {out_dir} is in use by {holder}: one run per out_dir; wait for "
                          "it or stop it, or give this run another --out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    OUT_DIR_LOCKS[os.path.realpath(path)] = f


def run_files(out_dir):
    """What a run leaves in out_dir: its logs (when not empty) and its checkpoint folders."""
    logs = [os.path.join(out_dir, name) for name in ("metrics.jsonl", "samples.jsonl")]
    logs = [os.path.basename(p) for p in logs if os.path.isfile(p) and os.path.getsize(p)]
    return logs + [os.path.basename(c) for c in checkpoints(out_dir)]


def claim_out_dir(cfg, rank):
    """Make out_dir this run's: locked while it runs, no other run's files in a fresh run; on resume
    the checkpoint's settings, the logs cut back to its step. Returns the checkpoint, or None."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir={cfg.out_dir!r} cannot be created: {e.strerror}") from None
    if rank == 0:
        lock_out_dir(cfg.out_dir)
    found = run_files(cfg.out_dir)
    if not cfg.resume:
        if found and not cfg.eval_only:  # eval_only only appends to eval.jsonl
            raise ConfigError(f"{cfg.out_dir} already holds a run ({', '.join(found)}), which a "
                              "fresh run would mix with; continue it with --resume=true, or give "
                              "this run another --out_dir (or delete those)")
        return None
    resume_from = (checkpoints(cfg.out_dir) or [None])[-1]
    if cfg.eval_only:  # evaluates the checkpoint; the run's logs stay as they are
        return resume_from
    if resume_from:
        step = checkpoint_step(resume_from)
        check_same_run(cfg, resume_from)
    else:  # killed before its first checkpoint
        step = 0
        cleared = ", its logs cleared" if found else ""
        print(f"resume=True, but {cfg.out_dir} holds no complete checkpoint yet: starting from "
              f"step 0{cleared}")
    for log in ("metrics.jsonl", "samples.jsonl") if rank == 0 else ():
        truncate_log(os.path.join(cfg.out_dir, log), step)
    return resume_from


def checkpoint_step(folder):
    """The step a checkpoint was saved after (its trainer_state.json)."""
    path = os.path.join(folder, "trainer_state.json")
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} cannot be read ({e}): {folder} is not a checkpoint of grpo.py; "
                          "move it out of out_dir") from None


def check_same_run(cfg, folder):
    """A resume goes on with the checkpoint's run: its RUN_SETTINGS (unless resume_changed)."""
    path = os.path.join(folder, "grpo_config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}): {folder} is not a checkpoint of grpo.py; "
                          "move it out of out_dir") from None
    changed = ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in changed_settings(cfg, saved))
    if changed and not cfg.resume_changed:
        raise ConfigError(f"settings changed since {folder} was saved: {changed}. Resume with the "
                          "checkpoint's settings, pass --resume_changed=true to go on with the new "
                          "ones, or start a new run in another --out_dir")
    if changed:
        print(f"resume_changed=True: going on from {folder} with changed settings: {changed}")


def prepare_run(argv):
    """Config, pre-flight, the model folder, the data: everything that can fail fails before a model loads (O6)."""
    cfg = config_from_argv(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    rank, _, device = parallel.setup(device)  # under torchrun: join the process group; else (0, 1, device)
    if device == "cpu" and cfg.cpu_keep_memory and not keep_freed_memory():
        print("cpu_keep_memory: this C library has no mallopt (not glibc); its allocator is left as it is")
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # one console: rank 0's (errors still reach stderr)
    if cfg.model not in BUILT_HERE:  # a hub name that cannot be fetched fails now, not after 10 retries
        check_model_source(cfg.model)
    preflight(cfg)
    task = load_task(cfg)  # a task file that lacks a function fails here
    try:
        problems = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    except ValueError as e:  # a malformed dataset row (DataError), or fewer distinct problems than asked for
        raise ConfigError(str(e)) from e
    check_sandbox(cfg, task, problems[0] + problems[1])  # the model's code runs only sandboxed
    check_task_output(task, problems[0], cfg)  # a prompt() or reward() of the wrong type fails before a model loads
    resume_from = claim_out_dir(cfg, rank)  # a second run, another run's files, changed settings
    with parallel.local_rank0_first():  # one rank per machine builds or converts the model folder, tidies out_dir
        path = model_path(cfg)
        for partial in glob.glob(os.path.join(cfg.out_dir, ".tmp_ckpt_*")):  # a save that was killed midway
            shutil.rmtree(partial, ignore_errors=True)  # (out_dir may be shared by several machines)
    check_model_source(path)
    if cfg.init_from:
        check_model_source(cfg.init_from)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.out_dir, "config.json"))
    return cfg, device, path, resume_from, task, problems


def build_models(cfg, path, device, resume_from):
    """The policy (fp32 master weights), its update wrapper, the reference (F1), the optimizer (O1)."""
    torch.manual_seed(cfg.seed)
    weights = resume_from if resume_from and not cfg.lora_rank else (cfg.init_from or path)
    tokenizer, policy = load_policy(cfg, weights, device, adapter=resume_from if cfg.lora_rank else None)
    policy.train()
    why = fused_head_unsupported(policy) if cfg.fused_logprobs else None
    if why:  # the plain logits path is always exact
        print(f"fused_logprobs off: {why}; logprobs come from the full logits")
        cfg.fused_logprobs = False
    # under torchrun: FSDP2 shards `policy` in place (train_model is policy); DDP wraps it for the update
    train_model = parallel.wrap(policy, cfg.parallel, cfg.dtype)
    ref = None
    if cfg.beta > 0 and not cfg.lora_rank:  # with LoRA the reference is the base: adapters disabled (F1)
        from transformers import AutoModelForCausalLM

        # the weights the run starts from (init_from, as TRL and verl take the reference), as with LoRA, whose
        # base is init_from: at step 0 the KL is 0 either way
        start = cfg.init_from or path
        ref = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval().requires_grad_(False)
        if device == "cpu":
            grouped_heads_on_cpu(ref)
        ref = parallel.wrap(ref.to("cpu" if cfg.ref_offload else device), cfg.parallel, cfg.dtype, trainable=False)
    params = [p for p in policy.parameters() if p.requires_grad]  # after wrapping: FSDP2 swaps in sharded ones
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    return tokenizer, policy, train_model, ref, params, optimizer


def make_sampler(cfg, num_prompts):
    """D2's curriculum, or D3's shuffled epochs."""
    if cfg.curriculum:
        return CurriculumSampler(num_prompts, cfg.seed, easy_above=cfg.curriculum_easy_above,
                                 hard_below=cfg.curriculum_hard_below, ramp_steps=cfg.curriculum_ramp_steps)
    return PromptSampler(num_prompts, cfg.seed)


# ---------------------------------------------------------------- the run


def main(argv, wrap_engine=lambda engine: engine):
    """Train (or with eval_only, evaluate). wrap_engine lets a test observe the real engine's calls."""
    cfg, device, path, resume_from, task, (train_problems, test_problems) = prepare_run(argv)
    tokenizer, policy, train_model, ref, params, optimizer = build_models(cfg, path, device, resume_from)
    sampler = make_sampler(cfg, len(train_problems))
    train = task, train_problems, tokenize_prompts(tokenizer, task, train_problems, cfg.max_prompt_len)
    test = task, test_problems, tokenize_prompts(tokenizer, task, test_problems, cfg.max_prompt_len)
    state = TrainState(beta=cfg.beta, run_id=f"{random.Random().getrandbits(64):016x}")
    if resume_from:
        state = load_checkpoint(resume_from, cfg, policy, ref, optimizer, sampler)
    engine_name = auto_engine() if cfg.engine == "auto" else cfg.engine  # auto: vLLM if it imports
    synced = parallel.world() > 1 and cfg.parallel == "fsdp"  # FSDP2: every rank steps until the slowest is done
    if engine_name == "vllm":
        engine = VLLMEngine(path, cfg, device)
    else:  # the policy itself samples, in the trainer's compute dtype
        engine = HFEngine(policy, tokenizer, synced_gpus=synced, dtype=cfg.dtype)
    if cfg.tools:  # multi-turn rollouts: the model may run Python mid-completion, in the sandbox
        run = functools.partial(run_python, timeout=cfg.tool_timeout, max_output=cfg.tool_output_chars)
        engine = ToolEngine(engine, tokenizer, cfg.max_tool_calls, run, (cfg.tool_open, cfg.tool_close))
    engine = wrap_engine(engine)
    if cfg.eval_only:
        eval_only(cfg, engine, policy, *test)
        return policy
    logger = Logger(cfg, state.run_id) if parallel.rank() == 0 else None  # metrics, wandb, tensorboard
    # save() writes a checkpoint of the run as it stands when called (state is the same object throughout)
    save = functools.partial(save_checkpoint, cfg, policy, ref, tokenizer, optimizer, sampler, state)
    G, checkpoint_seconds, next_parity_warning = cfg.group_size, 0.0, 0
    print(f"GRPO: {cfg.model} on {cfg.task}, engine {engine_name}, device {device}, ranks {parallel.world()}, "
          f"steps {state.step}..{cfg.max_steps}")

    for step in range(state.step, cfg.max_steps):
        t_step, times = time.perf_counter(), {}
        # ---- wake the engine and push the current policy into it (R1, R2), eval every eval_every steps (M2)
        with timed(times, "time/push"):
            engine.wake(push_weights_iter(policy, cfg.push_bucket_mb))  # wake weights -> push -> wake KV cache
        memory = {"mem/after_wake_gb": memory_gb()}
        evals = eval_due(engine, test, cfg, step)
        temperature = temperature_at(step, cfg)

        # ---- sample prompts, generate G completions each, score them; R7 refills
        batch, drawn, rounds = collect_rollouts(engine, sampler, train, cfg, step, temperature, times)

        # ---- put the engine to sleep: its GPU memory goes to the update (R1)
        with timed(times, "time/sleep"):
            engine.sleep()
        memory["mem/after_sleep_gb"] = memory_gb()

        # ---- group statistics of every group drawn (A4), which also feed the curriculum (D2)
        stats = group_stats(drawn.rewards, G, correct=drawn.components.get("correct"))
        sampler.update(drawn.problem[::G], stats["pass_rate"].tolist())  # a no-op for plain shuffling
        metrics = {"step": step, **rollout_metrics(drawn, stats, batch.gathered() if cfg.dynamic_sampling else None, G,
                                                    cfg.tools),
                   "beta": state.beta, "temperature": temperature, "refill_rounds": rounds}
        if parallel.all_sum(len(batch)) == 0:  # R7: no group with a reward spread, even after the refills
            print(f"step {step}: no group with a reward spread after {rounds} refill rounds; skipping the update")
            state.step = step + 1
            metrics.update({"skipped_updates": 1, **times, **memory, **evals})
            checkpoint_seconds = end_step(cfg, step, metrics, t_step, engine, policy, test, logger, save)
            continue

        # ---- advantages relative to each prompt's group (A1-A3): GRPO's replacement for a value network
        advantages = group_advantages(batch.rewards, G, baseline=cfg.adv_baseline, scale=cfg.adv_scale,
                                      std_floor=cfg.adv_std_floor, zero_std_groups=cfg.adv_zero_std_groups,
                                      clip=cfg.adv_clip, batch_sum=parallel.all_sum)  # (N,) this rank's

        # ---- tensors, masks, mini- and micro-batches; the old and reference logprobs once per batch (F1, L7)
        ub = prepare_update(batch, advantages, cfg, tokenizer.pad_token_id, device)
        passes = old_and_ref_logprobs(policy, ref, ub, cfg, state.beta, temperature, times)

        # ---- the update: num_iterations epochs, one optimizer step per mini-batch (L1-L7, O1, O2)
        lr = set_lr(optimizer, step, cfg)
        with timed(times, "time/update"):
            update = update_policy(train_model, optimizer, params, ub, passes, cfg, temperature, state)
        if cfg.ref_refresh_steps and (step + 1) % cfg.ref_refresh_steps == 0:  # F1: the reference catches up
            ref.load_state_dict(policy.state_dict())  # under FSDP2: shard to shard, both sharded alike
        state.step = step + 1

        # ---- log (M1) and check parity (R2); adaptive KL (F2); sample dumps (W6)
        metrics.update(step_metrics(update, ub, lr))
        metrics.update({"time/checkpoint": checkpoint_seconds, **times, **memory, **evals})
        next_parity_warning = warn_on_parity(metrics, cfg, step, next_parity_warning)
        adapt_beta(state, metrics["kl"], cfg)
        dump_samples(cfg, step, batch, advantages, train_problems, tokenizer)

        # ---- eval after the last update (M2), the log line, checkpoint
        checkpoint_seconds = end_step(cfg, step, metrics, t_step, engine, policy, test, logger, save)
    return policy


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
