"""The GRPO objective (SPEC L1-L8, F2, O1): token logprobs, the clipped surrogate, KL, schedules.

Per response token t of completion i, with r = pi_new(t) / pi_old(t) and A_i the group advantage:

    loss_t = -min(r * A_i, clip(r, 1 - eps, 1 + eps_high) * A_i)   # L1, PPO's clipped surrogate
             + beta * k3(pi_ref || pi_new)                        # L4, KL to the reference
             - entropy_coef * H_t                                 # L5, entropy bonus

(policy_loss swaps the first line for CISPO's, SAPO's or GPG's; kl_estimator the second for k1 or k2)

then averaged over the response tokens of the whole batch (L2). Everything here is pure:
tensors in, a loss and a dict of floats out.
"""

import math

import torch

# ---------------------------------------------------------------- token logprobs (L6, R5)


class _LogprobsEntropy(torch.autograd.Function):
    """log p(token) and entropy per position from logits, chunk by chunk in fp32.

    A plain `log_softmax(logits.float())` keeps a full (B, T, V) fp32 copy alive for backward:
    at V = 152k, 8k tokens that is 5 GB. Here forward keeps only the logits (which the model holds
    anyway) and two (B, T) fp32 tensors; backward recomputes softmax one chunk at a time.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk):
        ctx.set_materialize_grads(False)
        B, T, _ = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 under gradcheck
        logp = logits.new_empty(B, T, dtype=dtype)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for b, s in _chunks(B, T, chunk):
            z = logits[b, s].to(dtype) / temperature  # (c, V): the only fp32 copy, one chunk at a time
            lse[b, s], logp[b, s], entropy[b, s] = _softmax_stats(z, tokens[b, s])
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # the chunks cover every position: nothing to zero first
        for b, s in _chunks(logits.shape[0], logits.shape[1], ctx.chunk):
            log_p = logits[b, s].to(lse.dtype) / ctx.temperature - lse[b, s, None]  # (c, V), a fresh chunk
            grad[b, s] = _softmax_grad(log_p, tokens[b, s], entropy[b, s],
                                       grad_logp[b, s] if grad_logp is not None else None,
                                       grad_entropy[b, s] if grad_entropy is not None else None, ctx.temperature)
        return grad, None, None, None


def _chunks(B, T, chunk):
    """(row, time-slice) pairs covering a (B, T) grid, at most `chunk` positions each."""
    return [(b, slice(t, t + chunk)) for b in range(B) for t in range(0, T, chunk)]


def logprobs_and_entropy(logits, tokens, temperature=1.0, chunk=1024):
    """Log-probability of each token and the entropy of each position, in fp32 (L6).

    logits: (B, T, V) any float dtype; logits[:, t] is the distribution that produced tokens[:, t]
            (so a caller passes model logits[:, :-1] with input_ids[:, 1:]). Non-contiguous is fine.
    tokens: (B, T) long.
    temperature: the sampler's temperature; both sides of the ratio use logits / temperature (R5).
    Returns (logprobs, entropy), each (B, T) fp32 (fp64 for fp64 logits), both differentiable.

    Example: logits [[[0, ln 3]]] (one position, two tokens), tokens [[1]] -> logprob ln(3/4).
    """
    return _LogprobsEntropy.apply(logits, tokens, float(temperature), chunk)


class _LinearLogprobsEntropy(torch.autograd.Function):
    """log p(token) and entropy per position from the final hidden states and the output matrix.

    The fused linear + cross-entropy idea (Liger Kernel, Unsloth): the logits h W^T are computed one
    chunk of positions at a time, inside forward and again inside backward, so neither the (N, V)
    logits nor their gradient ever exist whole. Forward keeps the hidden states and two (N,) fp32
    tensors; the price is one more head matmul in backward. The matmul runs in `compute_dtype` (bf16
    under autocast, as the model's own head would), the softmax in fp32 (L6). Positions are flat (N, H).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, compute_dtype):
        ctx.set_materialize_grads(False)
        dtype = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 under gradcheck
        logp = hidden.new_empty(len(hidden), dtype=dtype)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        w = weight.to(compute_dtype)
        for s in range(0, len(hidden), chunk):
            s = slice(s, s + chunk)
            z = _head(hidden[s], w, bias, compute_dtype).to(dtype) / temperature  # (c, V), one chunk
            lse[s], logp[s], entropy[s] = _softmax_stats(z, tokens[s])
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        cd = ctx.compute_dtype
        w = weight.to(cd)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        grad_bias = torch.zeros_like(grad_weight[:, 0]) if bias is not None else None
        for s in range(0, len(hidden), ctx.chunk):
            s = slice(s, s + ctx.chunk)
            h = hidden[s].to(cd)  # (c, H)
            log_p = _head(h, w, bias, cd).to(lse.dtype) / ctx.temperature - lse[s, None]  # (c, V)
            g = _softmax_grad(log_p, tokens[s], entropy[s], grad_logp[s] if grad_logp is not None else None,
                              grad_entropy[s] if grad_entropy is not None else None, ctx.temperature)
            if bias is not None:
                grad_bias += g.sum(0).to(grad_bias.dtype)
            g = g.to(cd)  # both products take it in the compute dtype
            grad_hidden[s] = (g @ w).to(grad_hidden.dtype)  # dL/dh = g W
            _add_weight_grad(grad_weight, g, h)  # dL/dW += g^T h
        grad_bias = grad_bias.to(bias.dtype) if bias is not None else None
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None, None


def _add_weight_grad(grad_weight, g, h):
    """grad_weight (V, H) += g^T h for one chunk, g (c, V) and h (c, H) in the compute dtype, in
    place: no (V, H) temporary per chunk (at V = 152k, H = 2048 a bf16 product and its fp32 copy
    would take 1.7 GiB a chunk).

    fp32 (or fp64) compute: addmm_ in place. bf16 compute into an fp32 gradient: on CUDA, cuBLAS
    multiplies the bf16 operands and adds into the fp32 gradient itself (addmm with out_dtype);
    CPU kernels lack that mixed-dtype call, so there the bf16 operands are widened to fp32 first
    (one (c, V) chunk) and multiplied exactly.
    """
    if grad_weight.dtype == g.dtype:
        grad_weight.addmm_(g.T, h)
    elif g.is_cuda:
        torch.addmm(grad_weight, g.T, h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight.addmm_(g.T.to(grad_weight.dtype), h.to(grad_weight.dtype))


def _head(h, w, bias, compute_dtype):
    """h W^T (+ b) in compute_dtype: the logits of one chunk of positions."""
    z = h.to(compute_dtype) @ w.T
    return z + bias.to(compute_dtype) if bias is not None else z


def _softmax_stats(z, tokens):
    """(logsumexp, log p(token), entropy), each (c,), of one chunk of (c, V) scaled logits and its (c,) tokens.

    z is the caller's scratch copy and is overwritten: log p is computed in its memory, so a chunk costs one
    (c, V) buffer besides z (at V = 152k every pass over a chunk is memory traffic, not arithmetic).
    """
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse[:, None])  # (c, V), in z's memory
    token_logp = log_p.gather(-1, tokens[:, None]).squeeze(-1)
    # H = -sum p log p; the equal form lse - sum p z loses ~1e-5 to cancellation in fp32
    entropy = torch.exp(log_p).mul_(log_p).sum(-1).neg_()
    return lse, token_logp, entropy


def _softmax_grad(log_p, tokens, entropy, grad_logp, grad_entropy, temperature):
    """d(loss)/d(logits) for logits -> z = logits / T -> (log p(token), entropy): (c, V) fp32, from the upstream
    (c,) gradients g_k, g_H (None = zero). With d log p_k / dz = onehot(k) - p and dH / dz = -p (log p + H):

        d(loss)/dz = onehot(k) g_k - p (g_k + g_H (log p + H)),   and d(loss)/d(logits) = that / T.

    The 1/T goes on the (c,) gradients first. log_p is a scratch chunk and is overwritten, as is p: two
    (c, V) buffers, five passes over them.
    """
    g_k = grad_logp / temperature if grad_logp is not None else None
    p = torch.exp(log_p)  # (c, V)
    if grad_entropy is not None:
        inner = log_p.add_(entropy[:, None]).mul_((grad_entropy / temperature)[:, None])  # g_H (log p + H)
    else:
        inner = log_p.zero_()
    if g_k is not None:
        inner.add_(g_k[:, None])
    grad = p.mul_(inner).neg_()  # -p (g_k + g_H (log p + H))
    if g_k is not None:
        grad.scatter_add_(-1, tokens[:, None], g_k[:, None])  # + onehot(k) g_k
    return grad


def linear_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, bias=None, chunk=None):
    """logprobs_and_entropy(hidden @ weight.T + bias, tokens, temperature) without the logits tensor.

    hidden: (B, T, H) the model's final hidden states (after its last norm); hidden[:, t] produced tokens[:, t].
    weight: (V, H) the output matrix (lm_head.weight; the embedding when tied), bias (V,) or None.
    tokens: (B, T) long. chunk: positions per chunk; default: head_chunk for the device.
    The head's matmul runs in the autocast dtype when autocast is on (bf16 logits, as the model's own head
    would give), else in the weight's dtype; logprobs and entropy in fp32. Both differentiable in hidden,
    weight and bias.

    Example: hidden [[[1, 0]]], weight [[0, 0], [ln 3, 0]], tokens [[1]] -> logprob ln(3/4), as for
    logits [[[0, ln 3]]].
    """
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    compute_dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    chunk = chunk or head_chunk(device, weight.shape[0])
    B, T, H = hidden.shape
    with torch.autocast(device, enabled=False):  # the casts are explicit, in forward and backward alike
        logp, entropy = _LinearLogprobsEntropy.apply(hidden.reshape(B * T, H), weight, bias, tokens.reshape(B * T),
                                                     float(temperature), chunk, compute_dtype)
    return logp.view(B, T), entropy.view(B, T)


# Logits per chunk of the fused head, by device type. Each chunk's backward reads and writes the
# whole (V, H) fp32 weight gradient: on an H200 at 2^24 logits (110 positions at V = 152k) that
# traffic takes ~5x as long as the chunk's weight-gradient matmul, at 2^27 (880 positions) about
# as long, and the chunk's few (c, V) fp32 buffers (512 MiB each) are small beside GPU memory.
# On a CPU, 2^24 (64 MiB of fp32) keeps them small beside the hidden states.
HEAD_CHUNK_LOGITS = {"cuda": 2**27}
HEAD_CHUNK_LOGITS_DEFAULT = 2**24


def head_chunk(device_type, vocab_size):
    """Positions per chunk of linear_logprobs_and_entropy on a device type ("cuda", "cpu", ...)."""
    return max(1, HEAD_CHUNK_LOGITS.get(device_type, HEAD_CHUNK_LOGITS_DEFAULT) // vocab_size)


def token_logprobs(logits, tokens, temperature=1.0):
    """(B, T, V) logits and (B, T) tokens -> (B, T) fp32 log p(token); see logprobs_and_entropy."""
    return logprobs_and_entropy(logits, tokens, temperature)[0]


# ---------------------------------------------------------------- the loss (L1-L5, L8)


def grpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    ref_logprobs=None,
    beta=0.0,
    clip_eps=0.2,
    clip_eps_high=None,
    agg="token-mean",
    num_tokens=None,
    num_seqs=None,
    max_len=None,
    entropy=None,
    entropy_coef=0.0,
    ratio_level="token",
    is_weights=None,
    policy_loss="clip",
    dual_clip=0.0,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    kl_estimator="k3",
    pg_mask=None,
):
    """Clipped-surrogate GRPO loss of one (micro-)batch and its metrics.

    logprobs:     (B, T) fp32, current policy, with grad.
    old_logprobs: (B, T) the sampling policy's logprobs; detached here whatever the caller passes.
    advantages:   (B,) one per completion (advantage.group_advantages).
    mask:         (B, T) 1 on response tokens, 0 on padding (L3); masked values may be anything, even -inf.
    ref_logprobs: (B, T) reference policy, or None. beta weighs the k3 KL to it (L4).
    clip_eps, clip_eps_high: ratio clipped to [1 - clip_eps, 1 + clip_eps_high]; None/0 = symmetric (L1).
    agg (L2): "token-mean": sum over tokens / num_tokens (all response tokens of the *whole* batch,
                  so micro-batch losses add up to the full-batch loss; defaults to this mask's count).
              "seq-mean": mean over each sequence's tokens, then sum / num_seqs (the GRPO paper).
              "dr-grpo": sum over tokens / (num_seqs * max_len), a constant (Dr. GRPO).
              num_seqs defaults to B and max_len to T, i.e. the micro-batch is the whole batch.
    entropy:      (B, T) with grad, needed when entropy_coef > 0 (L5); also logged when given.
    ratio_level:  "token" (GRPO) or "sequence" (GSPO, L8: one ratio per completion, the geometric
                  mean of its token ratios, exp(mean_t log r_t)).
    is_weights:   (B, T) or None: multiplies the clipped surrogate of each token (sampler_is_weights).
    policy_loss:  the policy-gradient term, per token (every aggregation applies to each):
                  "clip":  -min(r A, clip(r, 1 - eps, 1 + eps_high) A)      PPO (Schulman et al. 2017), GRPO
                  "cispo": -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi     CISPO (MiniMax-M1, 2025): the clipped
                           ratio is a stop-gradient weight, so a clipped token keeps its gradient
                  "sapo":  -(4 / tau) sigmoid(tau (r - 1)) A                SAPO (Qwen, 2025): a soft gate in place
                           of the hard clip; tau = sapo_tau_pos for A > 0, sapo_tau_neg for A < 0
                  "gpg":   -A log pi                                       GPG (2025): no ratio, no clip
    dual_clip:    with "clip", for A < 0 the token's loss is at most dual_clip * |A| (dual-clip PPO, Ye et
                  al. 2020; verl clip_ratio_c, usually 3): a huge ratio on a bad token cannot blow it up. 0 = off.
    kl_estimator: "k3" | "k1" | "k2", the KL term's per-token estimator (kl_estimate).
    pg_mask:      (B, T) bool or None: only these tokens get the policy-gradient term (high_entropy_mask); the
                  KL and entropy terms still act on every response token, and the token-mean still counts them all.
    Returns (loss, metrics): a scalar tensor and a dict of floats over this micro-batch's tokens.

    Example: one token, logprob = old, A = 2 -> r = 1, loss = -2 with token-mean (and with "cispo" and
    "gpg" the gradient is the same -2 d log pi; "sapo" gives -(4 / tau) * 0.5 * 2 with the same gradient).
    """
    mask = mask.bool()
    eps_high = clip_eps_high or clip_eps
    adv = advantages.to(logprobs.dtype)[:, None]  # (B, 1): one advantage for all tokens of a completion
    # Masked positions are zeroed *before* exp, so padding values (even -inf) cannot make a NaN.
    # The ratio is new / old policy. (Some blog code divides by the reference instead: wrong.)
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0)  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(1) / mask.sum(1).clamp(min=1)  # (B,) log of the geometric mean
        log_ratio = torch.where(mask, seq_log_ratio[:, None].expand_as(log_ratio), 0.0)
    elif ratio_level != "token":
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    per_token = policy_gradient_term(policy_loss, ratio, torch.where(mask, logprobs, 0.0), adv, clip_eps, eps_high,
                                     dual_clip, sapo_tau_pos, sapo_tau_neg)  # (B, T)
    if is_weights is not None:  # R2: the tokens came from the sampler, not from pi_old exactly
        per_token = per_token * is_weights.detach()
    if pg_mask is not None:  # "80/20": the low-entropy tokens get no policy gradient, only the KL's pull
        per_token = torch.where(pg_mask.bool(), per_token, 0.0)

    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, mask, kl_estimator)  # (B, T)
        per_token = per_token + beta * kl
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy tensor (logprobs_and_entropy)")
        per_token = per_token - entropy_coef * entropy  # L5: a bonus, so it lowers the loss
    per_token = torch.where(mask, per_token, 0.0)

    B, T = mask.shape
    if agg == "token-mean":
        loss = per_token.sum() / max(num_tokens if num_tokens is not None else mask.sum().item(), 1)
    elif agg == "seq-mean":
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / (num_seqs or B)
    elif agg == "dr-grpo":
        loss = per_token.sum() / ((num_seqs or B) * (max_len or T))
    else:
        raise ValueError(f"agg must be 'token-mean', 'seq-mean' or 'dr-grpo', got {agg!r}")
    metrics = _metrics(mask, ratio, log_ratio, adv, clip_eps, eps_high, kl, entropy)
    if dual_clip:  # the tokens whose loss dual-clip bounded: A < 0 and r > dual_clip
        metrics["dual_clip_frac"] = _metrics_mean(mask, (ratio > dual_clip) & (adv < 0))
    if pg_mask is not None:  # the share of response tokens that got the policy gradient
        metrics["pg_token_frac"] = _metrics_mean(mask, pg_mask.bool())
    return loss, metrics


def policy_gradient_term(policy_loss, ratio, logprobs, adv, clip_eps, eps_high, dual_clip, tau_pos, tau_neg):
    """Per-token policy-gradient loss of grpo_loss's policy_loss; (B, T) ratio and logprobs, (B, 1) adv."""
    if policy_loss == "clip":
        clipped = ratio.clamp(1 - clip_eps, 1 + eps_high)
        per_token = -torch.min(ratio * adv, clipped * adv)  # zero grad on the clipped side
        if dual_clip:  # dual-clip PPO: for A < 0, at most dual_clip * |A| (and no gradient past it)
            per_token = torch.where(adv < 0, per_token.clamp(max=-dual_clip * adv), per_token)
        return per_token
    if policy_loss == "cispo":  # the weight is detached: d loss = -w A d log pi, clipped or not
        return -ratio.clamp(1 - clip_eps, 1 + eps_high).detach() * adv * logprobs
    if policy_loss == "sapo":  # gate'(1) = 1: near r = 1 SAPO's gradient is the plain ratio's
        tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # (B, 1)
        return -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    if policy_loss == "gpg":
        return -adv * logprobs
    raise ValueError(f"policy_loss must be 'clip', 'cispo', 'sapo' or 'gpg', got {policy_loss!r}")


def kl_estimate(logprobs, ref_logprobs, mask, estimator="k3"):
    """Per-token estimate of KL(pi_new || pi_ref) from samples of pi_new (Schulman, "Approximating KL
    divergence", 2020), d = log pi_ref - log pi_new; (B, T) in, (B, T) out, 0 where mask is 0 (L4).

      k1 = -d:                unbiased, high variance, negative on some tokens; as a loss its gradient is
                              the score function alone, 0 in expectation on-policy (it barely pulls back)
      k2 = d^2 / 2:           biased, low variance, >= 0; as a loss its expected gradient is the KL's
      k3 = exp(d) - d - 1:    unbiased, low variance, >= 0 (the GRPO paper's; verl low_var_kl, clamped)

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
    """Per-token k3 estimate of KL(pi_new || pi_ref) = E[exp(d) - d - 1], d = log pi_ref - log pi_new (L4).

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
        "clip_frac_low": mean((ratio < 1 - clip_eps) & (adv < 0)),  # clipped and the clip is active
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
    """The response tokens whose entropy is in the top `top_quantile` share of the batch's (Wang et al. 2025,
    "Beyond the 80/20 Rule": the high-entropy "forking" tokens carry the learning; TRL top_entropy_quantile).

    entropy, mask: (B, T). gather: a function that concatenates a list over ranks (parallel.all_gather_list),
    so the threshold is the global batch's; None = this batch alone. Returns (B, T) bool.
    Example: entropies [0.1, 0.5, 0.9, 2.0], top_quantile 0.5 -> the threshold is their median 0.7 ->
    [False, False, True, True].
    """
    mask = mask.bool()
    values = entropy[mask].float()
    if gather is not None:
        values = torch.tensor(gather(values.tolist()), dtype=torch.float32)
    if values.numel() == 0:
        return mask
    threshold = torch.quantile(values, 1 - top_quantile)  # linear interpolation between order statistics
    return mask & (entropy >= threshold.to(entropy.device))


# ---------------------------------------------------------------- sampler/trainer mismatch (R2)


def sampler_is_weights(old_logprobs, sampler_logprobs, mask, *, level="token", action="truncate", cap=2.0):
    """Importance weights for sampling from the engine's q instead of the trainer's pi_old (R2).

    vLLM and the trainer compute slightly different probabilities for the same weights (kernels,
    dtypes), so the tokens are samples of q, not of pi_old. With rho_t = pi_old(t) / q(t):
      level "token":    one weight per token, rho_t
      level "sequence": one weight per completion, the product prod_t rho_t (the true sequence
                        ratio: no geometric mean, so `cap` is a bound on the product itself)
      action "truncate": w = min(rho, cap)   (truncated IS, TIS)
      action "mask":     w = 1[rho <= cap]    (the token or completion leaves the loss)
    As TRL's vllm_importance_sampling_mode (token/sequence x truncate/mask) and verl's rollout
    correction. Only large rho is limited, as in TRL: rho < 1 already weighs a token down.
    old_logprobs, sampler_logprobs, mask: (B, T). Returns (weights (B, T), metrics), weights
    detached and 0 off the mask; is_limited_frac is the share of tokens (or of completions) limited.

    Example: pi_old = 0.5, q = 0.25 -> rho = 2; token/truncate with cap 1.5 -> 1.5; token/mask -> 0.
    Sequence: two tokens with rho 2 and 2 -> rho = 4; cap 3: truncate -> 3, mask -> 0.
    """
    mask = mask.bool()
    log_rho = torch.where(mask, old_logprobs.detach() - sampler_logprobs, 0.0)  # (B, T)
    if level == "sequence":
        log_rho = log_rho.sum(1, keepdim=True)  # (B, 1): log prod_t rho_t
    elif level != "token":
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    rho = torch.exp(log_rho)
    over = rho > cap  # (B, T) or (B, 1)
    if action == "truncate":
        weights = rho.clamp(max=cap)
    elif action == "mask":
        weights = (~over).to(rho.dtype)
    else:
        raise ValueError(f"action must be 'truncate' or 'mask', got {action!r}")
    weights = torch.where(mask, weights.expand_as(mask), 0.0)
    n = max(mask.sum().item(), 1)
    counted = mask if level == "token" else mask.any(1, keepdim=True)  # tokens, or non-empty completions
    frac = (over & counted).sum().item() / max(counted.sum().item(), 1)
    return weights, {"is_weight_mean": weights.sum().item() / n, "is_limited_frac": frac}


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
