"""Group-relative advantages (SPEC A1-A4): the part of GRPO that replaces PPO's value network.

Rewards come as one flat tensor of N = num_prompts x G values, the G completions of each prompt
contiguous: [p0c0, p0c1, ..., p0c(G-1), p1c0, ...]. Every completion's advantage is its reward
measured against its own group, and the same advantage is used for every token it produced.
"""

import torch


def _groups(rewards, group_size):
    """(N,) -> (P, G) at least float32, with a clear error when N is not a whole number of groups."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (num_prompts * {group_size},), got shape {tuple(rewards.shape)}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)


def group_advantages(rewards, group_size, *, scale="group", std_floor=1e-4, zero_std_groups=False, clip=0.0):
    """Advantage of each completion relative to its group.

    rewards: (N,) float, N = num_prompts * group_size, groups contiguous.
    scale:   "group" -> (r - mean) / max(std, std_floor)   (A1, the GRPO paper's z-score)
             "none"  -> r - mean                           (A1, Dr. GRPO: no std division)
    zero_std_groups: groups whose std < std_floor get advantage 0 (A2, a common variant).
    clip:    clamp to [-clip, clip] after normalising; 0 = off (A3).
    Returns (N,) float32 (float64 for float64 rewards).

    Example, G = 4, rewards [1, 0, 0, 0]: mean 0.25, unbiased std 0.5,
    advantages [1.5, -0.5, -0.5, -0.5].
    """
    groups = _groups(rewards, group_size)  # (P, G)
    mean = groups.mean(dim=1, keepdim=True)  # (P, 1)
    # Unbiased (Bessel, divide by G-1) std, as TRL and verl use; the paper does not say which.
    std = groups.std(dim=1, keepdim=True)  # (P, 1)
    adv = groups - mean  # (P, G)
    if scale == "group":
        # A2: a floor rather than "+ eps", so a std of 1e-6 cannot blow a 1e-6 reward gap up to 1.
        adv = adv / std.clamp(min=std_floor)
    elif scale != "none":
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
    if zero_std_groups:
        # A2: when all rewards are equal adv is already exactly 0 either way; this only changes
        # groups of nearly-equal continuous rewards, whose tiny differences are usually noise.
        adv = torch.where(std < std_floor, torch.zeros_like(adv), adv)
    if clip > 0:
        adv = adv.clamp(-clip, clip)  # A3: after normalising, so the bound is in std units
    return adv.reshape(-1)


def group_stats(rewards, group_size, correct=None, eps=1e-4):
    """Per-step statistics of the groups (A4), as plain floats plus the per-group pass rate.

    rewards: (N,) groups contiguous.  correct: (N,) 1/0 (or None: use rewards, right for 0/1 rewards).
    effective_group_ratio: share of groups whose reward std > eps, i.e. that carry any signal;
        under ~0.3 the prompts are too easy or too hard for the policy.
    frac_reward_zero_std: 1 - effective_group_ratio (TRL's name for it).
    pass_rate: (P,) share of correct completions in each group.

    Example, G = 2, rewards [1, 0, 1, 1]: effective 0.5, zero-std 0.5, pass_rate [0.5, 1.0].
    """
    groups = _groups(rewards, group_size)  # (P, G)
    std = groups.std(dim=1)  # (P,) unbiased, as in group_advantages
    effective = (std > eps).float().mean().item()
    hits = _groups(rewards if correct is None else correct, group_size)
    return {
        "effective_group_ratio": effective,
        "frac_reward_zero_std": 1.0 - effective,
        "group_std": std.mean().item(),
        "pass_rate": hits.mean(dim=1),
    }
