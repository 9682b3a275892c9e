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
