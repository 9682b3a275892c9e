"""Each prompt once (shared_prompt): a group's G completions computed on one pass over their prompt.

Without it a group's prompt is computed G times in every pass (the reference, the old policy, the
update), once per padded row. The Prefix Grouper idea (2025; verl use_prefix_grouper): split each
micro-batch into a prompt pass (each group's prompt once, its keys and values kept) and a completion
pass (every row's completion on top of its prompt's keys and values). Exact: the same attention,
positions and tokens as the padded rows (tests/test_perf.py holds it to them).

    plan_micro_batches      whole groups per micro-batch under the token budget (O3), priced as
                            computed
    shared_prompt_logprobs  the two passes
"""

import contextlib

import torch
from transformers import DynamicCache

from infra import parallel
from infra.preflight import CHECKPOINT_CACHE_HINT


def plan_micro_batches(lengths, prompt_lens, groups, cfg):
    """O3: rows (indices into lengths) as micro-batches under cfg.micro_batch_tokens; returns
    (micro-batches, positions the passes compute, real tokens among them)."""
    runs = tail_runs_on(cfg)
    plan = shared_micro_batches(lengths, prompt_lens, groups, cfg.micro_batch_tokens, runs)
    costs = [shared_prompt_cost(mb, lengths, prompt_lens, groups, runs) for mb in plan]
    return plan, sum(n for n, _ in costs), sum(real for _, real in costs)


def shared_prompt_cost(rows, lengths, prompt_lens, groups, runs=True):
    """(positions computed, real tokens among them) of one micro-batch under shared_prompt: each
    group's prompt but its last token once, (groups x longest), then every row's last prompt token +
    completion, each run of rows of similar length (tail_runs) padded to its longest: sum of (run
    rows x run longest)."""
    prompts = {groups[i]: prompt_lens[i] - 1 for i in rows}
    tails = [lengths[i] - prompt_lens[i] + 1 for i in rows]
    completions = sum(len(run) * max(tails[r] for r in run) for run in tail_runs(tails, runs))
    return len(prompts) * max(prompts.values()) + completions, sum(prompts.values()) + sum(tails)


def shared_micro_batches(lengths, prompt_lens, groups, budget, runs=True):
    """O3 under shared_prompt: whole groups together (longest group first) while the two passes fit
    `budget` positions (shared_prompt_cost); a group over the budget alone is split between its
    rows, each part computing the prompt once."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    order = sorted(members.values(), key=lambda rows: -max(lengths[i] for i in rows))
    out, current = [], []
    for i in (i for rows in order for i in sorted(rows, key=lambda i: -lengths[i])):
        if current and shared_prompt_cost(current + [i], lengths, prompt_lens, groups,
                                          runs)[0] > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] if current else out


def tail_runs_on(cfg):
    """Whether the completion pass runs rows of similar length together (several forwards a
    micro-batch): only on one rank, where the number of forwards may differ between micro-batches
    (FSDP and DDP ranks must match)."""
    return cfg.tail_runs and parallel.world() == 1


class PromptCache(DynamicCache):
    """The prompt pass's cache: each layer's keys and values, kept once (a gradient-checkpointing
    replay of the pass runs the same layer again; what it computes is what was kept, so it keeps
    nothing)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class SharedPromptCache(DynamicCache):
    """The completions' cache: the keys and values of each row's prompt, read-only. A layer attends
    over its prompt's and then its own, and nothing is stored, so a replay under gradient
    checkpointing sees the same."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)


@contextlib.contextmanager
def checkpoint_with_cache(model):
    """Let checkpointed decoder layers keep a cache argument: ours are read-only or keep-once, so
    the replay in backward reads the same keys and values (transformers drops past_key_values
    under checkpointing otherwise). A checkpointed layer without the switch would silently attend
    to its own tokens only: an error."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    switch = "_can_checkpoint_with_cache"
    old = [m for m in layers if m.gradient_checkpointing and not hasattr(type(m), switch)]
    if old:
        raise RuntimeError(f"gradient checkpointing with each prompt once (shared_prompt) "
                           f"{CHECKPOINT_CACHE_HINT}: {type(old[0]).__name__} cannot keep its "
                           f"cache argument in this transformers")
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def split_shared_prompts(ids, attention, prompt_lens, groups):
    """The two passes' inputs: (n, P) each group's prompt but its last token, left-padded, and its
    mask; (b, C) each row's last prompt token + completion, right-padded, and its mask; (b,) each
    row's group slot in 0..n-1. A group whose rows' prompts differ is an error."""
    lengths = attention.sum(1)
    # the distinct groups here; (b,) each row's
    slots, slot_of = torch.unique(groups, return_inverse=True)
    first = [int((slot_of == s).nonzero()[0]) for s in range(len(slots))]  # a row of each group
    prefix = prompt_lens[first] - 1  # (n,) tokens each group's prompt pass computes
    P, C = int(prefix.max()), int((lengths - prompt_lens + 1).max())
    prompt_ids, prompt_mask = ids.new_zeros(len(first), P), attention.new_zeros(len(first), P)
    for s, r in enumerate(first):  # left padding: each prompt ends where its completions begin
        prompt_ids[s, P - prefix[s] :] = ids[r, : prefix[s]]
        prompt_mask[s, P - prefix[s] :] = 1
    rows_ids, rows_mask = ids.new_zeros(len(ids), C), attention.new_zeros(len(ids), C)
    # each row against its group's first row: the same prompt length and tokens (one sync)
    lead = torch.tensor(first, device=ids.device)[slot_of]  # (b,)
    in_prompt = torch.arange(ids.shape[1], device=ids.device) < prompt_lens[:, None]  # (b, L)
    same = (prompt_lens == prompt_lens[lead]) & ((ids == ids[lead]) | ~in_prompt).all(1)  # (b,)
    if not bool(same.all()):
        bad = int(groups[int((~same).nonzero()[0])])
        raise ValueError(f"shared_prompt: the rows of group {bad} do not share their prompt "
                         "tokens (an engine that rewrites prompts?); set --shared_prompt=false")
    for r in range(len(ids)):
        n = int(lengths[r] - prompt_lens[r] + 1)
        rows_ids[r, :n] = ids[r, prompt_lens[r] - 1 : lengths[r]]
        rows_mask[r, :n] = 1
    return prompt_ids, prompt_mask, rows_ids, rows_mask, slot_of


def tail_runs(tails, split=True):
    """The completion pass's rows (indices into tails) in runs of similar length, each run padded
    only to its own longest: sorted longest first, a run ends before the first row at most half as
    long as the run's longest, so no run is more than half padding. split=False: one run of every
    row, in order (the pass padded to the longest)."""
    if not split:
        return [list(range(len(tails)))]
    runs = []
    for r in sorted(range(len(tails)), key=lambda r: -tails[r]):
        if not runs or 2 * tails[r] <= tails[runs[-1][0]]:
            runs.append([])
        runs[-1].append(r)
    return runs


def shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, temperature, cfg, *,
                           sequence_logprobs, self_attending_mask):
    """sequence_logprobs of right-padded rows whose groups share a prompt,
    computing each prompt once.

    sequence_logprobs, self_attending_mask: model.py's, passed in by the caller (perf/ sits below
    model.py and imports none of it).

    ids, attention: (b, L) prompt + completion, right-padded; prompt_lens: (b,); groups: (b,) group
    ids. Rows with the same group id must have the same prompt. Two kinds of forward, gradients
    through all:
      1. the prompt pass: each group's prompt but its last token, once: (n, P) left-padded, its keys
         and values kept (PromptCache);
      2. the completion pass: every row's last prompt token + completion, right-padded, on top of
         its group's keys and values (SharedPromptCache), at positions P_r - 1, P_r, ...; with runs,
         rows of similar length together (tail_runs), one forward per run padded to that run's
         longest.
    The last prompt token goes with the completions because its output predicts the first completion
    token. Returns (logprobs, entropy), each (b, L-1), in the padded coordinates of
    sequence_logprobs(ids).
    Exact: the same attention, positions and tokens as the padded forward;
    only each prompt's repeats go.
    cfg: the run's Config (fused_logprobs, chunked_logprobs, tail_runs). Every call makes the same
    number of forwards only without tail runs (FSDP and DDP ranks must match): tail_runs_on.
    """
    L = ids.shape[1]
    device = ids.device
    prompt_ids, prompt_mask, rows_ids, rows_mask, slot_of = split_shared_prompts(
        ids, attention, prompt_lens, groups)
    P = prompt_ids.shape[1]
    prompt_kv, tie = None, 0.0
    # L6: bf16 compute under autocast, as grpo.forward_logprobs; fp32 leaves a caller's autocast
    # as it is (a test's, around a Config whose dtype is not derived)
    bf16 = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
            else contextlib.nullcontext())
    with bf16, checkpoint_with_cache(model):
        if P > 0:
            cache = PromptCache()
            positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
            attend = self_attending_mask(model, prompt_mask)  # left-padded: no fully masked row
            # only the keys and values are wanted
            out = model(input_ids=prompt_ids, attention_mask=attend, position_ids=positions,
                        past_key_values=cache, use_cache=False, logits_to_keep=1)
            # FSDP2 gathers a layer's weights for backward when the gradient of the layer's output
            # arrives; the prompt's keys and values bypass the outputs, so the pass's output joins
            # the result with weight 0
            tie = 0.0 * out.logits.float().sum()
            prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
        tails = rows_mask.sum(1)  # (b,) each row's last prompt token + completion
        order, parts = [], []
        for run in tail_runs(tails.tolist(), tail_runs_on(cfg)):
            C = int(tails[run].max())
            slots = slot_of[run]
            positions = (prompt_lens[run] - 1)[:, None] + torch.arange(C, device=device)  # (r, C)
            mask = (torch.cat([prompt_mask[slots], rows_mask[run, :C]], 1) if P > 0
                    else rows_mask[run, :C])
            run_cache = (SharedPromptCache([(k[slots], v[slots]) for k, v in prompt_kv]) if P > 0
                         else None)
            lp, entropy = sequence_logprobs(model, rows_ids[run, :C], temperature, cfg,
                                            attention_mask=mask,
                                            position_ids=positions, past_key_values=run_cache,
                                            use_cache=False)
            # (r, C-1) -> (r, L-1): completion-pass position j predicts the token at padded
            # position P_r + j
            cols = (prompt_lens[run] - 1)[:, None] + torch.arange(C - 1, device=device)  # (r, C-1)
            valid = rows_mask[run, 1:C].bool()
            parts.append([padded_columns(v, cols, valid, L - 1) for v in (lp + tie, entropy)])
            order += run
    # the runs' rows back in the input's order
    back = torch.argsort(torch.tensor(order, device=device))
    return tuple(torch.cat([p[i] for p in parts])[back] for i in range(2))


def padded_columns(values, cols, valid, width):
    """(r, C) values placed at columns cols (r, C) of (r, width) zeros; invalid positions stay 0."""
    # room for every row's columns, cut below
    full = values.new_zeros(len(values), width + values.shape[1])
    full.scatter_(1, cols, torch.where(valid, values, 0.0))
    return full[:, :width]
