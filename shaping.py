"""The shaping every task's reward gets (W2, W3): a completion's named components and its length in
one number (shape_reward), a batch's rows of components in rewards and component tensors
(score_batch). The verifiers that make the components are rewards.py's and the task files'.
"""

import math

import torch

# W2: the weights of the built-in verifiers' components; a task's WEIGHTS and reward_weights
# override them ("format:0.2"). "parsed" weighs nothing: it picks wrong_penalty or unparsed_penalty
WEIGHTS = {"correct": 1.0, "format": 0.1}


def shape_reward(c, length, *, weights=None, wrong_penalty=0.0, unparsed_penalty=0.0,
                 length_soft_limit=0, length_penalty=0.05, length_penalty_tokens=32, length_min=0):
    """One scalar from a completion's components and its length in tokens.

    W2: each component times its weight: `weights`, else WEIGHTS' (correct 1, format 0.1), else 1
        (as TRL's reward_weights). "format" is the <think>..</think><answer>..</answer> layout
        (rewards.has_format). "parsed" (the answer was in its box or tag) picks a penalty: a
        parsed, wrong answer adds wrong_penalty (small, e.g. -0.1), one with no box or tag
        unparsed_penalty (larger, e.g. -0.5), even where a last number was judged right (math's
        math_last_number). (A common blog reward gives 0.4 when the answer tag is missing,
        rewarding the missing answer; not here.)
    W3: past length_soft_limit tokens, -length_penalty per length_penalty_tokens started;
        below length_min tokens the reward is 0. Both 0 = off.
    Example: correct, well formatted, 100 tokens, defaults -> 1.1.
    """
    weights = {**WEIGHTS, **(weights or {})}
    # correct and format first, whatever order the task's dict has: the sum's float rounding is
    # the same in every task, and a fixed-seed run's rewards stay what they were
    reward = weights["correct"] * c.get("correct", 0.0) + weights["format"] * c.get("format", 0.0)
    reward += sum(weights.get(k, 1.0) * v for k, v in c.items()
                  if k not in ("correct", "format", "parsed"))
    if "parsed" in c and c["parsed"] and c.get("correct", 0.0) < 1:
        reward += wrong_penalty
    if "parsed" in c and not c["parsed"]:
        reward += unparsed_penalty
    if length_soft_limit and length > length_soft_limit:
        reward -= length_penalty * math.ceil((length - length_soft_limit) / length_penalty_tokens)
    if length_min and length < length_min:
        reward = 0.0
    return reward


def score_batch(results, lengths, weights=None, **shaping):
    """Shape N scored completions. Returns (rewards (N,) float32, {component: (N,) float32}).

    results: per completion its components dict, or a string saying why the reward failed ("error",
    "timeout", ...; scoring.run_rewards). A failed completion scores exactly 0 (no shaping, no
    penalty) and is counted in components["errors"] (timeouts also in components["timeouts"]). A
    completion every TRL reward function left out ("unscored") has reward NaN: group_advantages
    leaves it out of its group's baseline and gives it advantage 0, the logged means leave it out,
    as TRL does.
    A component some completions lack is 0 for them. lengths: N completion lengths in tokens;
    weights, shaping: shape_reward's.
    """
    failed = [isinstance(c, str) for c in results]
    rewards = [0.0 if f else math.nan if c.get("unscored") else
               shape_reward(c, n, weights=weights, **shaping)
               for c, f, n in zip(results, failed, lengths)]
    names = sorted({k for c, f in zip(results, failed) if not f for k in c})
    per_component = {k: torch.tensor([0.0 if f else c.get(k, 0.0) for c, f in zip(results, failed)])
                     for k in names}
    per_component["errors"] = torch.tensor([float(f) for f in failed])
    per_component["timeouts"] = torch.tensor([float(c == "timeout") for c in results])
    return torch.tensor(rewards, dtype=torch.float32), per_component

