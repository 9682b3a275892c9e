"""The GRPO objective (L1-L8, F2, O1): the clipped surrogate, KL, token logprobs, schedules.

Per response token t of completion i, with r = pi_new(t) / pi_old(t) and A_i the group advantage:

    loss_t = -min(r * A_i, clip(r, 1 - eps, 1 + eps_high) * A_i)   # L1, PPO's clipped surrogate
             + beta * k3(pi_ref || pi_new)                        # L4, KL to the reference
             - entropy_coef * H_t                                 # L5, entropy bonus

(policy_loss swaps the first line for CISPO's, SAPO's or GPG's; kl_estimator the second for k1, k2)

then averaged over the response tokens of the whole batch (L2). Everything here is pure:
tensors in, a loss and a dict of floats out. The settings reach grpo_loss as one object with
their config.py names (the run's Config, or a LossSettings): a new variant is a setting in both, a
branch here.
"""

import math
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------- the loss (L1-L5, L8)


@dataclass(frozen=True)
class LossSettings:
    """grpo_loss's settings, by their config.py names and with its defaults (a test holds the two
    equal). A run passes its Config, which has every one; a test or a fork builds one of these."""
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0
    loss_agg: str = "token-mean"
    max_completion_len: int = None  # dr-grpo's constant; None: the micro-batch's width T
    policy_loss: str = "clip"
    dual_clip: float = 0.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    ratio_level: str = "token"
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    distill_coef: float = 1.0


def policy_ratio(logprobs, old_logprobs, mask, level="token"):
    """(log_ratio, ratio), each (B, T): pi / pi_old per token ("token", GRPO), or per completion
    ("sequence", GSPO, L8: the geometric mean of its token ratios, exp(mean_t log r_t)), 0 and 1 off
    the mask. old_logprobs is detached."""
    # Masked positions are zeroed *before* exp, so padding values (even -inf) cannot make a NaN.
    # The ratio is new / old policy. (Some blog code divides by the reference instead: wrong.)
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0)
    if level == "sequence":
        seq_log_ratio = log_ratio.sum(1) / mask.sum(1).clamp(min=1)  # (B,) log geometric mean
        log_ratio = torch.where(mask, seq_log_ratio[:, None].expand_as(log_ratio), 0.0)
    elif level != "token":
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {level!r}")
    return log_ratio, torch.exp(log_ratio)


def aggregate(per_token, mask, loss_agg, num_tokens=None, num_seqs=None, max_completion_len=0):
    """L2: the scalar loss of (B, T) per-token losses, zero off the mask (grpo_loss's loss_agg)."""
    B, T = mask.shape
    if loss_agg == "token-mean":
        return per_token.sum() / max(num_tokens if num_tokens is not None else mask.sum().item(), 1)
    if loss_agg == "seq-mean":
        return (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / (num_seqs or B)
    if loss_agg == "dr-grpo":
        return per_token.sum() / ((num_seqs or B) * (max_completion_len or T))
    raise ValueError(f"loss_agg must be 'token-mean', 'seq-mean' or 'dr-grpo', got {loss_agg!r}")


def grpo_loss(logprobs, old_logprobs, advantages, mask, settings=LossSettings(), *,
              ref_logprobs=None, beta=0.0, entropy=None, num_tokens=None, num_seqs=None,
              is_weights=None, pg_mask=None, teacher_logprobs=None):
    """Clipped-surrogate GRPO loss of one (micro-)batch and its metrics.

    logprobs:     (B, T) fp32, current policy, with grad.
    old_logprobs: (B, T) pi_old's: the policy before this batch's first update (the current one,
                  detached, with one update a batch); detached here whatever the caller passes.
    advantages:   (B,) one per completion (advantage.group_advantages).
    mask:         (B, T) 1 on response tokens, 0 on padding (L3); masked values may be anything,
                  even -inf.
    settings:     LossSettings, or the run's Config: the fields below by their config.py names.
    ref_logprobs: (B, T) reference policy, or None. beta weighs the k3 KL to it (L4).
    clip_eps, clip_eps_high: ratio clipped to [1 - clip_eps, 1 + clip_eps_high]; 0 = symmetric (L1).
    loss_agg (L2): "token-mean": sum over tokens / num_tokens (the response tokens of the *whole*
                  batch, so micro-batch losses add up to the batch loss; default: the mask's count).
              "seq-mean": mean over each sequence's tokens, then sum / num_seqs (the GRPO paper).
              "dr-grpo": sum over tokens / (num_seqs * max_completion_len), a constant (Dr. GRPO).
              num_seqs defaults to B and max_completion_len to T (the micro-batch is the batch).
              num_seqs counts rows with no token in the loss (mask_truncated) too, as TRL's "grpo"
              and "dr_grpo" do; verl's agg_loss leaves them out where it counts rows itself.
    entropy:      (B, T) with grad, needed when entropy_coef > 0 (L5); also logged when given.
    ratio_level:  "token" (GRPO) or "sequence" (GSPO, L8: one ratio per completion, the geometric
                  mean of its token ratios, exp(mean_t log r_t)).
    is_weights:   (B, T) or None: weighs the clipped surrogate of each token (sampler_is_weights).
    policy_loss:  the policy-gradient term, per token (every aggregation applies to each):
      "clip":  -min(r A, clip(r, 1 - eps, 1 + eps_high) A)   PPO (Schulman et al. 2017), GRPO
      "cispo": -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi  CISPO (MiniMax-M1, 2025): the clipped
               ratio is a stop-gradient weight, so a clipped token keeps its gradient
      "sapo":  -(4 / tau) sigmoid(tau (r - 1)) A             SAPO (Qwen, 2025): a soft gate in place
               of the hard clip; tau = sapo_tau_pos for A > 0, sapo_tau_neg for A < 0
      "gpg":   -A log pi                                     GPG (2025): no ratio, no clip
    dual_clip:    with "clip", for A < 0 the token's loss is at most dual_clip * |A| (dual-clip PPO,
                  Ye et al. 2020; verl clip_ratio_c, usually 3): a huge ratio on a bad token cannot
                  blow it up. 0 = off.
    kl_estimator: "k3" | "k1" | "k2", the KL term's per-token estimator (kl_estimate).
    pg_mask:      (B, T) bool or None: only these tokens get the policy-gradient term
                  (high_entropy_mask); the KL and entropy terms still act on every response token,
                  and the token-mean still counts them all.
    teacher_logprobs: (B, T) a teacher's logprobs, or None (L9, on-policy distillation, GKD): each
                  token's advantage + distill_coef * (log p_teacher - log pi_old), whose expected
                  gradient descends the reverse KL(pi || teacher). Logs teacher_kl, its estimate.
    Returns (loss, metrics): a scalar tensor and a dict of floats over this micro-batch's tokens.

    Example: one token, logprob = old, A = 2 -> r = 1, loss = -2 with token-mean (and with "cispo"
    and "gpg" the gradient is the same -2 d log pi; "sapo" gives -(4 / tau) * 0.5 * 2 with the same
    gradient).
    """
    s = settings
    mask = mask.bool()
    eps_high = s.clip_eps_high or s.clip_eps
    adv = advantages.to(logprobs.dtype)[:, None]  # (B, 1): one advantage for a completion's tokens
    if teacher_logprobs is not None:  # L9: the teacher's say per token: (B, T)
        teacher_kl = torch.where(mask, old_logprobs.detach() - teacher_logprobs, 0.0)
        adv = adv - s.distill_coef * teacher_kl
    log_ratio, ratio = policy_ratio(logprobs, old_logprobs, mask, s.ratio_level)  # (B, T) each
    per_token = policy_gradient_term(s, eps_high, ratio, torch.where(mask, logprobs, 0.0), adv)
    if is_weights is not None:  # R2: the tokens came from the sampler, not from pi_old exactly
        per_token = per_token * is_weights.detach()
    if pg_mask is not None:  # "80/20": no policy gradient for low-entropy tokens, only the KL pull
        per_token = torch.where(pg_mask.bool(), per_token, 0.0)

    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, mask, s.kl_estimator)  # (B, T)
        per_token = per_token + beta * kl
    if s.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy tensor (token_logprobs)")
        per_token = per_token - s.entropy_coef * entropy  # L5: a bonus, so it lowers the loss
    per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate(per_token, mask, s.loss_agg, num_tokens, num_seqs, s.max_completion_len)
    metrics = _metrics(mask, ratio, log_ratio, adv, s.clip_eps, eps_high, kl, entropy)
    if s.dual_clip:  # the tokens whose loss dual-clip bounded: A < 0 and r > dual_clip
        metrics["dual_clip_frac"] = _metrics_mean(mask, (ratio > s.dual_clip) & (adv < 0))
    if pg_mask is not None:  # the share of response tokens that got the policy gradient
        metrics["pg_token_frac"] = _metrics_mean(mask, pg_mask.bool())
    if teacher_logprobs is not None:  # k1's estimate of KL(pi_old || teacher) per token
        metrics["teacher_kl"] = _metrics_mean(mask, teacher_kl)
    return loss, metrics


def policy_gradient_term(settings, eps_high, ratio, logprobs, adv):
    """Per-token loss of grpo_loss's policy_loss; (B, T) ratio and logprobs, (B, 1) adv; the ratio
    clipped to [1 - clip_eps, 1 + eps_high]."""
    policy_loss, clip_eps, dual_clip = settings.policy_loss, settings.clip_eps, settings.dual_clip
    if policy_loss == "clip":
        clipped = ratio.clamp(1 - clip_eps, 1 + eps_high)
        per_token = -torch.min(ratio * adv, clipped * adv)  # zero grad on the clipped side
        if dual_clip:  # dual-clip PPO: for A < 0, at most dual_clip * |A| (and no gradient past it)
            per_token = torch.where(adv < 0, per_token.clamp(max=-dual_clip * adv), per_token)
        return per_token
    if policy_loss == "cispo":  # the weight is detached: d loss = -w A d log pi, clipped or not
        return -ratio.clamp(1 - clip_eps, 1 + eps_high).detach() * adv * logprobs
    if policy_loss == "sapo":  # gate'(1) = 1: near r = 1 SAPO's gradient is the plain ratio's
        # (B, 1)
        tau = torch.where(adv > 0, torch.full_like(adv, settings.sapo_tau_pos),
                          torch.full_like(adv, settings.sapo_tau_neg))
        return -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    if policy_loss == "gpg":
        return -adv * logprobs
    raise ValueError(f"policy_loss must be 'clip', 'cispo', 'sapo' or 'gpg', got {policy_loss!r}")


def kl_estimate(logprobs, ref_logprobs, mask, estimator="k3"):
    """Per-token estimate of KL(pi_new || pi_ref) from samples of pi_new (Schulman, "Approximating
    KL divergence", 2020), d = log pi_ref - log pi_new; (B, T) in and out, 0 where mask is 0 (L4).

    k1 = -d:             unbiased, high variance, negative on some tokens; as a loss its gradient
                         is the score function alone, 0 in expectation on-policy (barely pulls back)
    k2 = d^2 / 2:        biased, low variance, >= 0; as a loss its expected gradient is the KL's
    k3 = exp(d) - d - 1: unbiased, low variance, >= 0 (the GRPO paper's; verl low_var_kl, clamped)

    Example: d = ln 2 -> k1 = -0.693, k2 = 0.240, k3 = 0.307.
    """
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs, mask)
    d = torch.where(mask, ref_logprobs.detach() - logprobs, 0.0)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def k3_kl(logprobs, ref_logprobs, mask):
    """Per-token k3 of KL(pi_new || pi_ref) = E[exp(d) - d - 1], d = log pi_ref - log pi_new (L4).

    d has either sign; k3 is >= 0 for every d. (A common blog version flips the sign of d; with the
    flipped sign the penalty pushes away from the reference.) Clamped as verl's `low_var_kl` does:
    d to [-20, 20] and k3 to at most 10, so one token the policy has moved far from the reference
    (d = 20 gives exp(20) ~ 5e8, finite, so the non-finite guard would pass it) cannot dominate the
    batch; a clamped token gets no KL gradient. (B, T) in, (B, T) out, 0 where mask is 0.

    Example: d = 0 -> 0; d = ln 2 -> 2 - ln 2 - 1 = 0.307; d = 50 -> 10 (clamped).
    """
    d = torch.where(mask, ref_logprobs.detach() - logprobs, 0.0).clamp(-K3_LOG_CLAMP, K3_LOG_CLAMP)
    return (torch.exp(d) - d - 1).clamp(max=K3_MAX)


K3_LOG_CLAMP, K3_MAX = 20.0, 10.0  # verl's low_var_kl bounds


@torch.no_grad()
def _metrics_mean(mask, x):
    """The mean of x over the mask's tokens, 0.0 for an empty mask."""
    n = mask.sum().item()
    return torch.where(mask, x.float(), 0.0).sum().item() / n if n else 0.0


@torch.no_grad()
def _metrics(mask, ratio, log_ratio, adv, clip_eps, eps_high, kl, entropy):
    """Token means over the mask (0.0 for an empty mask) and the token count, to weight them."""
    n = mask.sum().item()

    def mean(x):
        return _metrics_mean(mask, x)

    out = {
        "clip_frac_low": mean((ratio < 1 - clip_eps) & (adv < 0)),  # clipped, the clip active
        "clip_frac_high": mean((ratio > 1 + eps_high) & (adv > 0)),
        "approx_kl_old": mean(ratio - 1 - log_ratio),  # k3 KL(old || new): how far the update moved
        "ratio": mean(ratio),
        "num_tokens": n,
    }
    if kl is not None:
        out["kl"] = mean(kl)
    if entropy is not None:
        out["entropy"] = mean(entropy)
    return out


def high_entropy_mask(entropy, mask, top_quantile, gather=None):
    """The response tokens whose entropy is in the top `top_quantile` share of the batch's (Wang et
    al. 2025, "Beyond the 80/20 Rule": the high-entropy "forking" tokens carry the learning; TRL
    top_entropy_quantile).

    entropy, mask: (B, T). gather: a function that concatenates a list over ranks
    (parallel.all_gather_list), so the threshold is the global batch's; None = this batch alone.
    Returns (B, T) bool. Example: entropies [0.1, 0.5, 0.9, 2.0], top_quantile 0.5 -> the threshold
    is their median 0.7 -> [False, False, True, True].
    """
    mask = mask.bool()
    values = entropy[mask].float()
    if gather is not None:
        values = torch.tensor(gather(values.tolist()), dtype=torch.float32)
    if values.numel() == 0:
        return mask
    threshold = torch.quantile(values, 1 - top_quantile)  # interpolates between order statistics
    return mask & (entropy >= threshold.to(entropy.device))


# ---------------------------------------------------------------- token logprobs (L6, R5)


def token_logprobs(logits, tokens, temperature=1.0):
    """log p(token) and the entropy of each position, in fp32, from logits / temperature (R5: the
    sampler's temperature on both sides of the ratio). The plain definition, and the tests' oracle:
    perf/logprobs.py computes the same without keeping a (B, T, V) fp32 copy.

    logits: (B, T, V), logits[:, t] the distribution of tokens[:, t]; tokens: (B, T) long.
    Returns (logprobs, entropy), each (B, T). Example: logits [[[0, ln 3]]], tokens [[1]] ->
    logprob ln(3/4), entropy -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy


# ---------------------------------------------------------------- sampler/trainer mismatch (R2)


def sampler_is_weights(old_logprobs, sampler_logprobs, mask, *, level="token", action="truncate",
                       cap=2.0, floor=0.0):
    """Importance weights for sampling from the engine's q instead of the trainer's pi_old (R2, R8).

    vLLM and the trainer compute slightly different probabilities for the same weights (kernels,
    dtypes), and with async_rollouts (R8) q is a policy some updates old: the tokens are samples of
    q, not of pi_old. With rho_t = pi_old(t) / q(t), and the band [floor, cap]:
      level "token":    one weight per token, rho_t
      level "sequence": one weight per completion, the product prod_t rho_t (the true sequence
                        ratio: no geometric mean, so the band bounds the product itself)
      action "truncate": w = clamp(rho, floor, cap)   (truncated IS, TIS; floor 0: min(rho, cap))
      action "mask":     w = 1[floor <= rho <= cap]   (the token, or the whole completion, leaves
                         the loss: IcePop's band at token level, sequence masking at row level)
    As TRL's vllm_importance_sampling_mode (token/sequence x truncate/mask, clip_min and clip_max)
    and verl's rollout correction. floor 0 limits only large rho, TRL's default: rho < 1 already
    weighs a token down.
    old_logprobs, sampler_logprobs, mask: (B, T). Returns (weights (B, T), metrics), weights
    detached and 0 off the mask. is_limited_frac: the share of tokens (or of completions) outside
    the band; rows_masked / rows: completions the mask left no token of, and all completions.

    Example: pi_old = 0.5, q = 0.25 -> rho = 2; token/truncate with cap 1.5 -> 1.5; token/mask -> 0.
    Sequence: two tokens with rho 2 and 2 -> rho = 4; cap 3: truncate -> 3, mask -> 0. Band
    [0.5, 2]: rho 0.25 -> 0.5 (truncate), 0 (mask).
    """
    mask = mask.bool()
    log_rho = torch.where(mask, old_logprobs.detach() - sampler_logprobs, 0.0)  # (B, T)
    if level == "sequence":
        log_rho = log_rho.sum(1, keepdim=True)  # (B, 1): log prod_t rho_t
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    rho = torch.exp(log_rho)
    outside = (rho > cap) | (rho < floor)  # (B, T) or (B, 1)
    if action == "truncate":
        weights = rho.clamp(min=floor, max=cap)
    elif action == "mask":
        weights = (~outside).to(rho.dtype)
    else:
        raise ValueError(f"action must be 'truncate' or 'mask', got {action!r}")
    weights = torch.where(mask, weights.expand_as(mask), 0.0)
    n = max(mask.sum().item(), 1)
    # tokens, or non-empty completions
    counted = mask if level == "token" else mask.any(1, keepdim=True)
    frac = (outside & counted).sum().item() / max(counted.sum().item(), 1)
    rows = mask.any(1)
    masked = rows & ~(weights > 0).any(1)
    return weights, {"is_weight_mean": weights.sum().item() / n, "is_limited_frac": frac,
                     "rows_masked": masked.sum().item(), "rows": rows.sum().item()}


# ---------------------------------------------------------------- adaptive KL (F2) and LR (O1)


def adaptive_kl_beta(beta, mean_kl, *, high=0.08, low=0.01, up=1.2, down=0.8):
    """F2: the next beta from the mean token KL of the last window of steps.

    KL above `high` -> beta * up (pull back to the reference); below `low` -> beta * down.
    Example: adaptive_kl_beta(0.01, 0.1) -> 0.012.
    """
    if mean_kl > high:
        return beta * up
    if mean_kl < low:
        return beta * down
    return beta


def lr_at(step, *, lr, warmup_steps, max_steps, min_lr_ratio=0.1):
    """O1: linear warm-up over `warmup_steps`, then cosine from lr down to lr * min_lr_ratio.

    step counts from 0. Example: lr=1, warmup 10, max 110 -> step 0: 0.1, step 9: 1.0,
    step 60: 0.55 (halfway down the cosine), step 110: 0.1.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    floor = lr * min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - floor)
