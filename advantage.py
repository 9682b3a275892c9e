"""Group-relative advantages (A1-A4): the part of GRPO that replaces PPO's value network.

Rewards come as one flat tensor of N = num_prompts x G values, the G completions of each prompt
contiguous: [p0c0, p0c1, ..., p0c(G-1), p1c0, ...]. Every completion's advantage is its reward
measured against its own group, and the same advantage is used for every token it produced.
"""

import math
from dataclasses import dataclass

import torch

# A2: the std is floored at this before dividing, and zero_std_groups' threshold: 1e-4, TRL's
# epsilon used as a floor (TRL adds 1e-4 to the std, verl 1e-6; neither makes it a setting)
STD_FLOOR = 1e-4


@dataclass(frozen=True)
class AdvantageSettings:
    """group_advantages' settings, by their config.py names and with its defaults (a test holds
    the two equal). A run passes its Config, which has every one; a test or a fork builds one."""
    adv_baseline: str = "mean"
    adv_scale: str = "group"
    adv_zero_std_groups: bool = False
    adv_clip: float = 0.0
    adv_pass_k: int = 0


def _groups(rewards, group_size):
    """(N,) -> (P, G), at least float32; a clear error when N is not a whole number of groups."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (num_prompts * {group_size},), "
                         f"got shape {tuple(rewards.shape)}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)


def group_advantages(rewards, group_size, settings=AdvantageSettings(), *, batch_sum=None):
    """Advantage of each completion relative to its group: (r - baseline) / scale.

    rewards:  (N,) float, N = num_prompts * group_size, groups contiguous.
    settings: AdvantageSettings, or the run's Config; below by their names less the adv_ prefix.
    baseline: "mean" (A1, GRPO) -> b = the group's mean reward
              "leave-one-out" (RLOO, Ahmadian et al. 2024) -> b_i = the mean of the other G - 1
              rewards; r_i - b_i = G / (G - 1) * (r_i - mean): GRPO's centred reward, scaled up
    scale:    "group" (A1, the GRPO paper's z-score) -> / max(std of the group's rewards,
              STD_FLOOR) (A2; TRL's std + 1e-4 agrees to ~2e-4: the code says where).
              "batch" (TRL scale_rewards="batch") -> / max(std of every reward in the batch,
              STD_FLOOR): TRL's, the unbiased std of the whole batch's raw rewards over all
              processes (batch_sum), floored at STD_FLOOR where TRL adds 1e-4 to it. Not
              REINFORCE++-baseline's whitening (token-level, verl).
              "none" (A1, Dr. GRPO: no std division) -> as it is
    zero_std_groups: groups whose reward std < STD_FLOOR get advantage 0 (A2, a common variant).
    clip:     clamp to [-clip, clip] after normalising; 0 = off (A3).
    batch_sum: with scale="batch" under torchrun, a function that sums a number over the ranks
              (parallel.all_sum), so the std is the global batch's; None = these rewards alone.
    A NaN reward (a completion every TRL reward function left unscored) is left out of its group's
    mean and std and gets 0, as TRL's nanmean, nanstd and nan_to_num do; so does every row of a
    group with fewer than two scored rewards. [1, NaN, NaN, 0] -> [0.707, 0, 0, -0.707].
    pass_k:   K > 0 (Pass@k Training, Chen et al. 2025): pass_k_advantages' in place of baseline
              and scale (the run's check refuses them set too); clip still applies. 0 = off.
    Returns (N,) float32 (float64 for float64 rewards).

    Example, one group of G = 4, rewards [1, 0, 0, 0] (mean 0.25, unbiased std 0.5):
                    scale "group"            "batch"                  "none"
      "mean"          [1.5, -0.5, -0.5, -0.5]  [1.5, -0.5, -0.5, -0.5]  [0.75, -0.25, -0.25, -0.25]
      "leave-one-out" [2, -2/3, -2/3, -2/3]    [2, -2/3, -2/3, -2/3]    [1, -1/3, -1/3, -1/3]
    (The batch is this one group, so "batch" is "group"; leave-one-out is "mean" times G / (G - 1).)
    """
    baseline, scale = settings.adv_baseline, settings.adv_scale
    zero_std_groups, clip = settings.adv_zero_std_groups, settings.adv_clip
    groups = _groups(rewards, group_size)  # (P, G)
    if settings.adv_pass_k:  # Pass@k Training: the advantage of a group's best of K
        adv = pass_k_advantages(rewards, group_size, settings.adv_pass_k)
        return adv.clamp(-clip, clip) if clip > 0 else adv
    if baseline not in ("mean", "leave-one-out") or scale not in ("group", "batch", "none"):
        raise ValueError(f"baseline must be 'mean' or 'leave-one-out' and scale 'group', 'batch' "
                         f"or 'none', got {baseline!r}, {scale!r}")
    if groups.isnan().any():  # TRL's unscored completions
        adv = scored_only(groups, baseline, scale, zero_std_groups, batch_sum)
        return (adv.clamp(-clip, clip) if clip > 0 else adv).reshape(-1)
    mean = groups.mean(dim=1, keepdim=True)  # (P, 1)
    # Unbiased (Bessel, divide by G-1) std, as TRL and verl use; the paper does not say which.
    std = groups.std(dim=1, keepdim=True)  # (P, 1)
    if baseline == "mean":
        adv = groups - mean  # (P, G)
    else:  # leave-one-out (RLOO): no completion is its own baseline: unbiased
        adv = groups - (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    if scale == "group":
        # A2: a floor rather than "+ eps", so a std of 1e-6 cannot blow a 1e-6 reward gap up to 1.
        # TRL divides by std + 1e-4: for a 0/1 group of 4 with one success the same to 2e-4 (1.5
        # here, 1.4997 there); they differ most at std = STD_FLOOR, where TRL's is half this
        # (1e-4 + 1e-4), and far below it agree again (both ~/ 1e-4)
        adv = adv / std.clamp(min=STD_FLOOR)
    elif scale == "batch":
        # the std of the rewards, not of the centred r - b (those are smaller with a group baseline)
        adv = adv / batch_std(groups, batch_sum).clamp(min=STD_FLOOR)
    # A group whose rewards are all equal carries no signal: exactly 0. The formula alone gives ~0
    # in float32: mean(eight rewards of 1.05) is one ulp off 1.05, so r - mean is ~1e-7 and the
    # 1e-4 floor turns it into 1.2e-3 (TRL, which adds 1e-4 to the std, gives the same).
    same = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # (P, 1)
    adv = torch.where(same, torch.zeros_like(adv), adv)
    if zero_std_groups:
        # A2: groups of equal rewards are 0 either way (above); this only changes groups of
        # nearly-equal continuous rewards, whose tiny differences are usually noise.
        adv = torch.where(std < STD_FLOOR, torch.zeros_like(adv), adv)
    if clip > 0:
        adv = adv.clamp(-clip, clip)  # A3: after normalising, so the bound is in std units
    return adv.reshape(-1)


def pass_k_advantages(rewards, group_size, k):
    """Pass@k Training (Chen et al. 2025): advantages that optimise a group's best of k, not each
    completion alone; the analytic form of their bootstrap over k-subsets of the group.

    Think of every k-subset of a group as one try at pass@k, scored by its best reward (max). The
    subsets' scores have mean mu and (population) std sigma; a completion's advantage is the mean,
    over the subsets that hold it, of (score - mu) / sigma. With the rewards sorted ascending,
    r_0 <= ... <= r_(n-1):
        P(a k-subset's best is r_j) = C(j, k-1) / C(n, k)                       -> mu, sigma
        E[best | the subset holds r_i] = (C(i, k-1) r_i + sum_{j>i} C(j-1, k-2) r_j) / C(n-1, k-1)
    (its own reward when the other k-1 are below it, else r_j when r_j is the best of them).
    For 0/1 rewards with c correct this is the paper's closed form: mu = 1 - C(n-c, k)/C(n, k),
    sigma = sqrt(mu (1 - mu)), a correct completion (1 - mu) / sigma, a wrong one
    (1 - mu - C(n-c-1, k-1) / C(n-1, k-1)) / sigma. Any reward works (the best of k is the max).

    rewards: (N,) groups contiguous; NaN (unscored) rows are left out, as in group_advantages, and
        get 0. k: 1 <= k < group_size; a group whose k-subsets all score the same (fewer than k
        rewards below its best: all equal, or pass@k already 1) gets exactly 0.
    k = 1 is GRPO's z-score with the population std. Returns (N,) like group_advantages.

    Example, G = 4, k = 2, rewards [1, 0, 0, 0]: mu = 1/2, sigma = 1/2; the correct one is in 3
    pairs, all scoring 1: (1 - 1/2) / (1/2) = 1; a wrong one is in 1 pair of 3 that scores 1:
    (1/3 - 1/2) / (1/2) = -1/3. -> [1, -1/3, -1/3, -1/3] (GRPO: [1.5, -0.5, -0.5, -0.5]).
    """
    groups = _groups(rewards, group_size)  # (P, G)
    out = torch.zeros_like(groups)
    for p, row in enumerate(groups):
        scored = (~row.isnan()).nonzero().flatten()
        n = len(scored)
        r, order = row[scored].double().sort()  # ascending
        # fewer than k below the best: every k-subset holds a best one, all score the same
        if n == 0 or (r < r[-1]).sum() < k:
            continue
        best = torch.tensor([comb(j, k - 1) for j in range(n)], dtype=torch.float64) / comb(n, k)
        mu = (best * r).sum()
        sigma = ((best * r * r).sum() - mu * mu).clamp(min=0).sqrt()
        above = torch.tensor([comb(j - 1, k - 2) for j in range(n)], dtype=torch.float64) * r
        above = above.flip(0).cumsum(0).flip(0) - above  # sum over j > i
        own = torch.tensor([comb(i, k - 1) for i in range(n)], dtype=torch.float64) * r
        expected = (own + above) / comb(n - 1, k - 1)
        out[p, scored[order]] = ((expected - mu) / sigma.clamp(min=STD_FLOOR)).to(out.dtype)
    return out.reshape(-1)


def comb(n, r):
    """C(n, r), 0 where r < 0 (math.comb refuses it) or r > n."""
    return math.comb(n, r) if 0 <= r <= n else 0


def component_advantages(terms, weights, group_size, settings=AdvantageSettings(), *,
                         batch_sum=None):
    """GDPO (Liu et al. 2026; TRL's multi_objective_aggregation="normalize_then_sum"): each reward
    term normalised in its group on its own, weighed, summed, then divided by the batch's std.

    Summing first (GRPO) lets a term with a wide spread drown one with a narrow spread: in
    10 * length_score + correct, the z-score is nearly all length. Here each term's group z-score
    counts once, times its weight.
    terms: (N, K) the reward's terms, unweighted (rewards.reward_terms); weights: (K,).
    settings: each term's group_advantages (its baseline, zero_std_groups; scale "group"); clip
        after the batch scaling, as group_advantages clips.
    batch_sum: as group_advantages', so the batch std is the global batch's.
    Each term's z-score is centred in its group, so the sum has mean 0 in every group already; TRL
    subtracts the batch mean too, which is that 0 up to rounding and leaves a group of equal
    rewards a residual advantage: here it stays exactly 0. A row with a NaN term gets 0.

    Example, G = 4, correct [1, 0, 0, 0] and format [1, 1, 0, 0], weights 1 and 0.1: z-scores
    [1.5, -.5, -.5, -.5] and [.866, .866, -.866, -.866]; summed [1.587, -.413, -.587, -.587];
    / their std 1.061 -> [1.496, -0.390, -0.553, -0.553] (GRPO on the sums 1.1, 0.1, 0, 0:
    [1.494, -0.374, -0.560, -0.560]). Equal spreads give GRPO's advantages exactly.
    """
    if terms.dim() != 2 or weights.shape != terms.shape[1:]:
        raise ValueError(f"terms must be (N, K) and weights (K,), got {tuple(terms.shape)} and "
                         f"{tuple(weights.shape)}")
    each = AdvantageSettings(settings.adv_baseline, "group", settings.adv_zero_std_groups)
    total = sum(w * group_advantages(terms[:, j], group_size, each)
                for j, w in enumerate(weights.tolist()))
    scored = ~terms.isnan().any(dim=1)
    adv = total / batch_std(total[scored], batch_sum).clamp(min=STD_FLOOR)
    adv = torch.where(scored, adv, torch.zeros_like(adv))
    return adv.clamp(-settings.adv_clip, settings.adv_clip) if settings.adv_clip > 0 else adv


def scored_only(groups, baseline, scale, zero_std_groups, batch_sum):
    """group_advantages' (P, G) advantages over each group's scored (non-NaN) rewards only."""
    scored = ~groups.isnan()  # (P, G)
    count = scored.sum(dim=1, keepdim=True)  # (P, 1)
    r = torch.where(scored, groups, 0.0)
    total = r.sum(dim=1, keepdim=True)
    mean = total / count.clamp(min=1)
    if baseline == "mean":
        adv = r - mean
    else:  # leave-one-out over the other scored rewards
        adv = r - (total - r) / (count - 1).clamp(min=1)
    centred = torch.where(scored, r - mean, 0.0)
    std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    if scale == "group":
        adv = adv / std.clamp(min=STD_FLOOR)
    elif scale == "batch":
        adv = adv / batch_std(groups[scored], batch_sum).clamp(min=STD_FLOOR)
    lowest = torch.where(scored, groups, math.inf).amin(dim=1, keepdim=True)
    highest = torch.where(scored, groups, -math.inf).amax(dim=1, keepdim=True)
    keep = scored & (count > 1) & (highest > lowest)  # a signal, on a scored row
    if zero_std_groups:
        keep = keep & (std >= STD_FLOOR)
    return torch.where(keep, adv, torch.zeros_like(adv))


def batch_std(x, batch_sum=None):
    """Unbiased std of every element of x (over all ranks when batch_sum sums over them), 0-dim."""
    total = batch_sum or float
    n, s1, s2 = total(x.numel()), total(x.sum().item()), total((x.double() ** 2).sum().item())
    var = (s2 - s1 * s1 / n) / (n - 1) if n > 1 else 0.0
    return torch.tensor(max(var, 0.0) ** 0.5, dtype=x.dtype)


def informative_groups(rewards, G):
    """Indices of groups whose rewards are not all equal (R7: the others have zero advantage); a
    NaN (unscored) reward is left out, as group_advantages leaves it."""
    rows = [row[~row.isnan()] for row in rewards.view(-1, G)]
    return [g for g, row in enumerate(rows) if len(row) > 1 and row.max() > row.min()]


def group_stats(rewards, group_size, correct=None):
    """Per-step statistics of the groups (A4), as plain floats plus the per-group pass rate.

    rewards: (N,) groups contiguous. correct: (N,) 1/0, or None: use rewards (right for 0/1 ones).
    frac_reward_zero_std: share of groups whose rewards are all equal, the ones group_advantages
        gives exactly 0 (TRL's name and meaning: its torch.isclose(std, 0), which float32 can miss:
        eight rewards of 1.05 have a float32 std of ~1e-7, where TRL counts a spread).
    effective_group_ratio: 1 - frac_reward_zero_std, the share of groups that carry a signal;
        under ~0.3 the prompts are too easy or too hard for the policy.
    pass_rate: (P,) share of correct completions in each group.

    Example, G = 2, rewards [1, 0, 1, 1]: effective 0.5, zero-std 0.5, pass_rate [0.5, 1.0].
    """
    groups = _groups(rewards, group_size)  # (P, G)
    scored = ~groups.isnan()  # NaN: a completion TRL's reward functions left out, as TRL skips it
    count = scored.sum(dim=1)
    std = groups.std(dim=1)  # (P,) unbiased, as in group_advantages
    if not scored.all():
        centred = torch.where(scored, groups - groups.nansum(1, keepdim=True) / count[:, None], 0)
        std = (centred.pow(2).sum(dim=1) / (count - 1)).sqrt()
    highest = torch.where(scored, groups, -math.inf).amax(dim=1)
    effective = (highest > torch.where(scored, groups, math.inf).amin(dim=1)).float().mean().item()
    hits = _groups(rewards if correct is None else correct, group_size)
    return {
        "effective_group_ratio": effective,
        "frac_reward_zero_std": 1.0 - effective,
        "group_std": std[count > 1].mean().item(),
        "pass_rate": hits.mean(dim=1),
    }
