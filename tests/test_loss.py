"""The GRPO loss, plain token logprobs, adaptive KL, the LR schedule.   pytest tests/test_loss.py

The chunked and fused token logprobs (perf/logprobs.py) are held to the plain ones in test_perf.py.
"""

import dataclasses
import math

import pytest
import torch

from loss import LossSettings, adaptive_kl_beta, grpo_loss, lr_at, token_logprobs

LN = math.log


# ---------------------------------------------------------------- token logprobs (the plain path)


def naive_token_logprobs(logits, tokens, temperature):
    """log p(token) and each position's entropy, one position at a time: math.exp, math.log."""
    logprobs, entropies = [], []
    for row, row_tokens in zip(logits.tolist(), tokens.tolist()):
        lp_row, ent_row = [], []
        for z, token in zip(row, row_tokens):
            z = [x / temperature for x in z]
            top = max(z)  # softmax is shift-invariant; the shift keeps exp from overflowing
            weights = [math.exp(x - top) for x in z]
            total = sum(weights)
            p = [w / total for w in weights]
            lp_row.append(math.log(p[token]))
            ent_row.append(-sum(q * math.log(q) for q in p if q > 0))
        logprobs.append(lp_row)
        entropies.append(ent_row)
    return torch.tensor(logprobs, dtype=torch.float64), torch.tensor(entropies, dtype=torch.float64)


def test_token_logprobs_hand_worked():
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, LN(3)], [0.0, LN(3)]]])
    lp, ent = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp.tolist()[0] == pytest.approx([LN(3 / 4), LN(1 / 4)], abs=1e-6)
    want_h = -(0.25 * LN(0.25) + 0.75 * LN(0.75))
    assert ent.tolist()[0] == pytest.approx([want_h, want_h], abs=1e-6)
    assert want_h == pytest.approx(0.562, abs=1e-3)  # the docstring's example
    # temperature 2 halves the logits:
    # softmax([0, ln 3 / 2]) = [1 / (1 + sqrt 3), sqrt 3 / (1 + sqrt 3)]
    lp_t, ent_t = token_logprobs(logits, torch.tensor([[1, 0]]), temperature=2.0)
    s3 = math.sqrt(3)
    p = [1 / (1 + s3), s3 / (1 + s3)]
    assert lp_t.tolist()[0] == pytest.approx([LN(p[1]), LN(p[0])], abs=1e-6)
    assert ent_t.tolist()[0] == pytest.approx([-(p[0] * LN(p[0]) + p[1] * LN(p[1]))] * 2, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_a_naive_loop(dtype, temperature):
    """The plain definition against softmax written out position by position; fp32 from bf16 too."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 11) * 4).to(dtype)
    tokens = torch.randint(0, 11, (2, 5))
    lp, ent = token_logprobs(logits, tokens, temperature)
    assert lp.dtype == ent.dtype == torch.float32  # fp32 even from bf16 logits (L6)
    want_lp, want_ent = naive_token_logprobs(logits.float(), tokens, temperature)
    assert torch.allclose(lp.double(), want_lp, atol=1e-5)
    assert torch.allclose(ent.double(), want_ent, atol=1e-5)
    assert (ent > 0).all() and (lp < 0).all()


def test_token_logprobs_of_a_non_contiguous_slice():
    # the trainer's plain path passes model_logits[:, :-1], a non-contiguous view
    torch.manual_seed(3)
    full = torch.randn(2, 6, 9, requires_grad=True)
    tokens = torch.randint(0, 9, (2, 5))
    lp, ent = token_logprobs(full[:, :-1], tokens)
    want_lp, want_ent = naive_token_logprobs(full[:, :-1].detach(), tokens, 1.0)
    assert torch.allclose(lp.double(), want_lp, atol=1e-6)
    assert torch.allclose(ent.double(), want_ent, atol=1e-6)
    lp.sum().backward()
    assert full.grad[:, -1].abs().sum().item() == 0.0  # the dropped position gets no gradient
    assert full.grad[:, :-1].abs().sum().item() > 0


# ---------------------------------------------------------------- the loss: hand-worked cases


def one_token(log_ratio, adv, **settings):
    """Loss and d loss / d logprob for one response token with the given log ratio and advantage,
    under the loss settings given (LossSettings' names)."""
    lp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    loss, metrics = grpo_loss(lp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv]),
                              torch.ones(1, 1), LossSettings(**settings))
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.item(), metrics


def test_on_policy_loss_is_minus_advantage():
    loss, grad, m = one_token(0.0, 2.0)
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx(-2.0)  # d(-r A)/d logp = -r A
    assert m["ratio"] == pytest.approx(1.0) and m["approx_kl_old"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "ratio, adv, loss, grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # above 1 + eps with A > 0: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5),  # below 1 - eps with A > 0: not clipped (min picks r A)
        (0.5, -1.0, 0.8, 0.0),  # below 1 - eps with A < 0: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # above 1 + eps with A < 0: not clipped
        (1.1, 1.0, -1.1, -1.1),  # inside the range
    ],
)
def test_clipped_surrogate(ratio, adv, loss, grad):
    got_loss, got_grad, _ = one_token(LN(ratio), adv, clip_eps=0.2)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)


def test_clip_higher():
    # DAPO clip-higher: ratio 1.25 with A > 0 is clipped at eps 0.2, free at eps_high 0.28
    assert one_token(LN(1.25), 1.0, clip_eps=0.2)[1] == 0.0
    loss, grad, m = one_token(LN(1.25), 1.0, clip_eps=0.2, clip_eps_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    assert m["clip_frac_high"] == 0.0
    assert one_token(LN(1.3), 1.0, clip_eps=0.2, clip_eps_high=0.28)[2]["clip_frac_high"] == 1.0
    # the low side still uses clip_eps
    assert one_token(LN(0.75), -1.0, clip_eps=0.2, clip_eps_high=0.28)[2]["clip_frac_low"] == 1.0


def test_k3_kl_hand_worked():
    # ref - new = ln 2: k3 = 2 - ln 2 - 1 = 0.30685; beta 0.1 adds 0.030685 to -A
    lp = torch.zeros(1, 1, requires_grad=True)
    ref = torch.full((1, 1), LN(2))
    loss, m = grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 1), ref_logprobs=ref,
                        beta=0.1)
    assert m["kl"] == pytest.approx(1 - LN(2), abs=1e-6)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * (1 - LN(2)), abs=1e-6)
    loss.backward()
    # d k3 / d new = -(exp(d) - 1) = -1 at d = ln 2; so grad = -A*r + beta * (-1) = -1.1
    assert lp.grad.item() == pytest.approx(-1.1, abs=1e-6)


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    torch.manual_seed(4)
    lp, ref = -torch.rand(4, 9) * 5, -torch.rand(4, 9) * 5
    mask = torch.ones(4, 9)
    _, m = grpo_loss(lp, lp, torch.randn(4), mask, ref_logprobs=ref)
    _, m_eq = grpo_loss(lp, lp, torch.randn(4), mask, ref_logprobs=lp)
    assert m["kl"] > 0.01
    assert m_eq["kl"] == 0.0


def test_k3_kl_is_clamped_on_an_extreme_token():
    """A token whose reference logprob is 20 nats above the policy's: unclamped k3 = e^20 - 21 ~
    4.9e8, finite, so the non-finite guard would let it dominate the update. Clamped as verl's
    low_var_kl: at most 10."""
    from loss import k3_kl

    lp = torch.tensor([[-25.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-5.0, -1.0 + LN(2)]])
    kl = k3_kl(lp, ref, torch.ones(1, 2, dtype=torch.bool))
    assert kl.tolist()[0] == pytest.approx([10.0, 1 - LN(2)], abs=1e-6)
    assert math.exp(20) - 21 > 4e8  # what the plain formula gives on the first token
    kl.sum().backward()
    # the clamped token adds no gradient
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1.0], abs=1e-6)
    loss, m = grpo_loss(lp.detach(), lp.detach(), torch.zeros(1), torch.ones(1, 2),
                        ref_logprobs=ref, beta=1.0)
    assert loss.item() == pytest.approx((10 + 1 - LN(2)) / 2, abs=1e-5) and m["kl"] <= 10
    # the other side: ref far below the policy, k3 = e^-20 + 20 - 1 ~ 19 -> 10
    d = torch.tensor([[-50.0]])
    assert (k3_kl(torch.zeros(1, 1), d, torch.ones(1, 1, dtype=torch.bool)).item()
            == pytest.approx(10.0))


def test_entropy_bonus_lowers_the_loss():
    lp = torch.zeros(1, 2, requires_grad=True)
    ent = torch.tensor([[2.0, 4.0]], requires_grad=True)
    loss, m = grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2),
                        LossSettings(entropy_coef=0.01), entropy=ent)
    assert loss.item() == pytest.approx(-1.0 - 0.01 * 3.0)
    assert m["entropy"] == pytest.approx(3.0)
    loss.backward()
    assert ent.grad.tolist()[0] == pytest.approx([-0.005, -0.005])
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2),
                  LossSettings(entropy_coef=0.01))


def test_gspo_sequence_ratio():
    # token log ratios [ln 2, 0]: sequence ratio = geometric mean = sqrt 2, applied to both tokens
    lp = torch.tensor([[LN(2), 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = grpo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2),
                        LossSettings(clip_eps=0.5, ratio_level="sequence"))
    assert loss.item() == pytest.approx(-math.sqrt(2))
    assert m["ratio"] == pytest.approx(math.sqrt(2))
    loss.backward()
    # d(-s)/d lp_t = -s / |y| = -sqrt(2) / 2 for each token
    assert lp.grad.tolist()[0] == pytest.approx([-math.sqrt(2) / 2] * 2)
    # outside the range the whole sequence is clipped together
    lp2 = torch.tensor([[LN(4), 0.0]], requires_grad=True)
    loss2, _ = grpo_loss(lp2, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                         LossSettings(ratio_level="sequence"))
    loss2.backward()
    assert loss2.item() == pytest.approx(-1.2) and lp2.grad.abs().sum().item() == 0.0


def test_token_mean_vs_seq_mean_vs_dr_grpo_on_unequal_lengths():
    # on-policy (ratio 1) so each token's loss is -A. Seq 0: 1 token, A = 1; seq 1: 3 tokens,
    # A = -1.
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    lp = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -1.0])
    token_mean = grpo_loss(lp, lp, adv, mask, LossSettings(loss_agg="token-mean"))[0].item()
    seq_mean = grpo_loss(lp, lp, adv, mask, LossSettings(loss_agg="seq-mean"))[0].item()
    dr = grpo_loss(lp, lp, adv, mask, LossSettings(loss_agg="dr-grpo"))[0].item()
    # every token weighs the same: long seq dominates
    assert token_mean == pytest.approx((-1 + 3) / 4)
    assert seq_mean == pytest.approx((-1 + 1) / 2)  # every sequence weighs the same
    assert dr == pytest.approx((-1 + 3) / (2 * 4))  # token sum over the constant seqs x max_len
    dr_8 = grpo_loss(lp, lp, adv, mask,
                     LossSettings(loss_agg="dr-grpo", max_completion_len=8))[0].item()
    assert dr_8 == pytest.approx(2 / 16)


def test_metrics_hand_worked():
    # four tokens, ratios [1.5, 0.5, 1.0, 1.0], advantages [+1 (seq 0), -1 (seq 1)]
    lp = torch.tensor([[LN(1.5), LN(0.5)], [0.0, 0.0]])
    _, m = grpo_loss(lp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    assert m["clip_frac_high"] == 0.25  # ratio 1.5 with A > 0
    assert m["clip_frac_low"] == 0.0  # ratio 0.5 has A > 0: the low clip is not active
    assert m["ratio"] == pytest.approx(1.0)
    want = ((1.5 - 1 - LN(1.5)) + (0.5 - 1 - LN(0.5))) / 4
    assert m["approx_kl_old"] == pytest.approx(want)
    assert m["num_tokens"] == 4


# ---------------------------------------------------------------- the loss against a naive loop


def naive_policy_term(policy_loss, lp, r, a, eps, eps_high, dual_clip=0.0, tau_pos=1.0,
                      tau_neg=1.05):
    """One token's policy-gradient loss, as each paper writes it
    (the value; CISPO's weight is a constant)."""
    clipped = min(max(r, 1 - eps), 1 + eps_high)
    if policy_loss == "clip":
        val = -min(r * a, clipped * a)
        return min(val, -dual_clip * a) if dual_clip and a < 0 else val
    if policy_loss == "cispo":
        return -clipped * a * lp
    if policy_loss == "sapo":
        tau = tau_pos if a > 0 else tau_neg
        return -(4 / tau) * a / (1 + math.exp(-tau * (r - 1)))
    return -a * lp  # gpg


def naive_kl(d, estimator):
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[estimator]


def naive_loss(lp, old, adv, mask, ref, beta, eps, eps_high, agg, num_seqs, max_len,
               policy_loss="clip", dual_clip=0.0, kl_estimator="k3"):
    """Element by element, exactly the formula in loss.py's docstring."""
    per_seq, total, count = [], 0.0, 0
    for i in range(len(lp)):
        seq_sum, n = 0.0, 0
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            val = naive_policy_term(policy_loss, lp[i][t], r, adv[i], eps, eps_high, dual_clip)
            if ref is not None:
                val += beta * naive_kl(ref[i][t] - lp[i][t], kl_estimator)
            seq_sum, n = seq_sum + val, n + 1
        per_seq.append(seq_sum / max(n, 1))
        total, count = total + seq_sum, count + n
    if agg == "token-mean":
        return total / count
    if agg == "seq-mean":
        return sum(per_seq) / num_seqs
    return total / (num_seqs * max_len)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "dr-grpo"])
@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("policy_loss, dual_clip, kl_estimator",
                         [("clip", 0.0, "k3"), ("clip", 1.5, "k1"), ("cispo", 0.0, "k2"),
                          ("sapo", 0.0, "k3"), ("gpg", 0.0, "k3")])
def test_matches_naive_loop(agg, with_ref, eps_high, policy_loss, dual_clip, kl_estimator):
    torch.manual_seed(5)
    B, T = 6, 9
    lp = -torch.rand(B, T, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, dtype=torch.float64) * 0.3  # ratios well outside 1 +- 0.2 too
    ref = lp + torch.randn(B, T, dtype=torch.float64) * 0.5 if with_ref else None
    adv = torch.randn(B, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    settings = LossSettings(clip_eps_high=eps_high, loss_agg=agg, policy_loss=policy_loss,
                            dual_clip=dual_clip, kl_estimator=kl_estimator)
    got, _ = grpo_loss(lp, old, adv, mask, settings, ref_logprobs=ref, beta=0.05)
    want = naive_loss(
        lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), None if ref is None
        else ref.tolist(),
        0.05, 0.2, eps_high or 0.2, agg, B, T, policy_loss, dual_clip, kl_estimator,
    )
    assert got.item() == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "dr-grpo"])
@pytest.mark.parametrize("policy_loss", ["clip", "cispo", "sapo", "gpg"])
def test_micro_batches_add_up_to_the_full_batch(agg, policy_loss):
    """Gradient accumulation (L2, O3):
    shared denominators make micro-batch losses sum to the batch loss."""
    torch.manual_seed(6)
    B, T = 8, 12
    lp = (-torch.rand(B, T, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.2
    ref = lp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.2
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,))[:, None]
    settings = LossSettings(loss_agg=agg, policy_loss=policy_loss,
                            dual_clip=2.0 if policy_loss == "clip" else 0.0)

    full, _ = grpo_loss(lp, old, adv, mask, settings, ref_logprobs=ref, beta=0.04)
    (full_grad,) = torch.autograd.grad(full, lp)

    shared = dict(num_tokens=int(mask.sum()), num_seqs=B)
    whole = dataclasses.replace(settings, max_completion_len=T)
    total = 0.0
    for idx in ([0, 1, 2], [3], [4, 5, 6, 7]):
        part, _ = grpo_loss(lp[idx], old[idx], adv[idx], mask[idx], whole, ref_logprobs=ref[idx],
                            beta=0.04, **shared)
        total = total + part
    (micro_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(micro_grad, full_grad, atol=1e-6)
    # without the shared denominator token-mean would differ: the test can tell
    if agg == "token-mean":
        parts = ([0, 1, 2], [3], [4, 5, 6, 7])
        naive = sum(grpo_loss(lp[i], old[i], adv[i], mask[i], settings, ref_logprobs=ref[i],
                              beta=0.04)[0]
                    for i in parts)
        assert abs(naive.item() - full.item()) > 1e-3


@pytest.mark.parametrize("policy_loss", ["clip", "cispo", "sapo", "gpg"])
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_masked_positions_may_hold_minus_inf(policy_loss, kl_estimator):
    lp = torch.tensor([[-0.5, -float("inf")], [-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-0.4, -float("inf")], [-1.1, -float("inf")]])
    ref = torch.tensor([[-0.6, -float("inf")], [-0.9, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    loss, m = grpo_loss(lp, old, torch.tensor([1.0, -1.0]), mask,
                        LossSettings(policy_loss=policy_loss, kl_estimator=kl_estimator,
                                     dual_clip=3.0 if policy_loss == "clip" else 0.0),
                        ref_logprobs=ref, beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[:, 1].tolist() == [0.0, 0.0]  # padding gets no gradient (L3)
    assert all(math.isfinite(v) for v in m.values())


def test_fully_masked_micro_batch_gives_zero_not_nan():
    lp = torch.randn(2, 3, requires_grad=True)
    for agg in ("token-mean", "seq-mean", "dr-grpo"):
        loss, m = grpo_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3),
                            LossSettings(loss_agg=agg, entropy_coef=0.1), entropy=lp)
        (g,) = torch.autograd.grad(loss, lp)
        assert loss.item() == 0.0 and g.abs().sum().item() == 0.0
        assert m["num_tokens"] == 0 and m["ratio"] == 0.0


def test_old_logprobs_are_detached():
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -0.1, requires_grad=True)
    loss, _ = grpo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert old.grad is None and lp.grad is not None


def test_bad_options_fail_clearly():
    lp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="agg"):
        grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 1), LossSettings(loss_agg="sum"))
    with pytest.raises(ValueError, match="ratio_level"):
        grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 1), LossSettings(ratio_level="seq"))


# ---------------------------------------------------------------- adaptive KL and LR schedule


def test_adaptive_kl_beta():
    assert adaptive_kl_beta(0.01, 0.1) == pytest.approx(0.012)  # above 0.08: x 1.2
    assert adaptive_kl_beta(0.01, 0.005) == pytest.approx(0.008)  # below 0.01: x 0.8
    assert adaptive_kl_beta(0.01, 0.03) == 0.01  # in the band: unchanged
    # other published thresholds, as settings
    assert adaptive_kl_beta(0.01, 0.09, high=0.1, low=0.01) == 0.01


def test_lr_schedule_hand_worked():
    kw = dict(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(110)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(5, lr=2.0, warmup_steps=0, max_steps=10, min_lr_ratio=1.0) == 2.0  # constant


# --------------------------------------------------------------- sampler/trainer IS correction (R2)


def test_sampler_is_weights_hand_worked():
    from loss import sampler_is_weights

    old = torch.tensor([[LN(0.5), LN(0.9), 0.0]])
    sampler = torch.tensor([[LN(0.25), LN(0.9), -float("inf")]])  # the padding may hold anything
    mask = torch.tensor([[1, 1, 0]])
    w, m = sampler_is_weights(old, sampler, mask, level="token", action="truncate", cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, 1.0, 0.0])  # rho = [2, 1], capped at 1.5
    assert m == {"is_weight_mean": pytest.approx(1.25), "is_limited_frac": 0.5,
                 "rows": 1, "rows_masked": 0}
    w, m = sampler_is_weights(old, sampler, mask, level="token", action="mask", cap=1.5)
    # rho 2 > 1.5 leaves the loss
    assert w.tolist()[0] == [0.0, 1.0, 0.0] and m["is_limited_frac"] == 0.5
    # sequence: the product of rho (2 x 1 = 2), not its geometric mean (1.414)
    w, m = sampler_is_weights(old, sampler, mask, level="sequence", action="truncate", cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, 1.5, 0.0]) and m["is_limited_frac"] == 1.0
    w, m = sampler_is_weights(old, sampler, mask, level="sequence", action="truncate", cap=3.0)
    assert w.tolist()[0] == pytest.approx([2.0, 2.0, 0.0]) and m["is_limited_frac"] == 0.0
    w, m = sampler_is_weights(old, sampler, mask, level="sequence", action="mask", cap=1.5)
    assert w.tolist()[0] == [0.0, 0.0, 0.0] and m["is_limited_frac"] == 1.0
    assert m["rows_masked"] == 1  # the mask left no token of the completion
    w, _ = sampler_is_weights(old, sampler, mask, level="sequence", action="mask", cap=3.0)
    assert w.tolist()[0] == [1.0, 1.0, 0.0]


def test_sequence_is_weight_is_the_product_over_a_long_completion():
    """500 tokens each with rho = 1.01: the product is 1.01^500 = 145, far past a cap of 3, though
    the per-token geometric mean (1.01) is well inside any [1/cap, cap] band."""
    from loss import sampler_is_weights

    old, sampler = torch.full((1, 500), math.log(1.01)), torch.zeros(1, 500)
    mask = torch.ones(1, 500)
    w, m = sampler_is_weights(old, sampler, mask, level="sequence", action="truncate", cap=3.0)
    assert torch.allclose(w, torch.full((1, 500), 3.0)) and m["is_limited_frac"] == 1.0
    w, _ = sampler_is_weights(old, sampler, mask, level="sequence", action="mask", cap=3.0)
    assert w.sum().item() == 0.0
    w, m = sampler_is_weights(old, sampler, mask, level="token", action="truncate", cap=2.0)
    assert torch.allclose(w, torch.full((1, 500), 1.01)) and m["is_limited_frac"] == 0.0


def test_sampler_is_weights_bad_options():
    from loss import sampler_is_weights

    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="level"):
        sampler_is_weights(x, x, mask, level="off")
    with pytest.raises(ValueError, match="action"):
        sampler_is_weights(x, x, mask, action="clip")


def test_is_weights_scale_the_surrogate_but_not_the_kl():
    lp = torch.zeros(1, 1, requires_grad=True)
    w = torch.tensor([[1.5]])
    loss, _ = grpo_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 1), is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0) and lp.grad.item() == pytest.approx(-3.0)
    ref = torch.full((1, 1), LN(2))
    kl_only = 1 - LN(2)
    loss, _ = grpo_loss(lp, lp.detach(), torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=ref,
                        beta=1.0, is_weights=torch.tensor([[0.0]]))
    assert loss.item() == pytest.approx(kl_only, abs=1e-6)


# ------------------------------------------------------- the policy-loss variants and KL estimators


def pg(log_ratio, adv, **kw):
    """(loss, d loss / d logprob) of one token with logprob - old = log_ratio
    (one_token without the metrics)."""
    return one_token(log_ratio, adv, **kw)[:2]


def test_policy_losses_hand_worked_on_a_clipped_token():
    """r = 1.5, A = 1, eps = 0.2: the clip takes the token's gradient away, CISPO keeps it,
    SAPO softens it."""
    lr = math.log(1.5)
    assert pg(lr, 1.0) == pytest.approx((-1.2, 0.0))  # -min(1.5, 1.2): clipped, no gradient
    # CISPO: -sg(1.2) * A * log pi: value -1.2 * ln 1.5, gradient -1.2 (the token still learns)
    assert pg(lr, 1.0, policy_loss="cispo") == pytest.approx((-1.2 * lr, -1.2))
    # SAPO, tau 1: -(4) sigmoid(0.5) = -2.4898; gradient -4 s
    # (1 - s) * r = -4 * 0.2350 * 1.5 = -1.4100
    s = 1 / (1 + math.exp(-0.5))
    assert pg(lr, 1.0, policy_loss="sapo") == pytest.approx((-4 * s, -4 * s * (1 - s) * 1.5))
    # -A log pi: no ratio at all
    assert pg(lr, 1.0, policy_loss="gpg") == pytest.approx((-lr, -1.0))


def test_cispo_keeps_a_gradient_where_the_clip_has_none():
    # above 1 + eps with A > 0, below 1 - eps with A < 0
    for lr, adv in ((math.log(1.5), 1.0), (math.log(0.5), -1.0)):
        assert pg(lr, adv)[1] == 0.0
        assert pg(lr, adv, policy_loss="cispo")[1] != 0.0


def test_dual_clip_bounds_the_loss_of_a_bad_token_with_a_huge_ratio():
    lr = math.log(5.0)  # r = 5, A = -1: the clipped surrogate is -min(-5, -1.2) = 5, growing with r
    assert pg(lr, -1.0) == pytest.approx((5.0, 5.0))
    # at most 3 * |A|, no gradient past it
    assert pg(lr, -1.0, dual_clip=3.0) == pytest.approx((3.0, 0.0))
    # under the bound: untouched
    assert pg(math.log(2.0), -1.0, dual_clip=3.0) == pytest.approx((2.0, 2.0))
    assert pg(lr, 1.0, dual_clip=3.0) == pg(lr, 1.0)  # A > 0: dual clip does nothing
    for r in (1.0, 2.0, 10.0, 1e3):
        assert pg(math.log(r), -2.0, dual_clip=3.0)[0] <= 6.0 + 1e-9


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_sapo_is_the_plain_ratio_to_first_order_near_one(adv):
    """gate(r) = (4 / tau) sigmoid(tau (r - 1)) has gate'(1) = 1, so at r = 1 SAPO's gradient is -A,
    like -r A."""
    assert pg(0.0, adv, policy_loss="sapo", sapo_tau_pos=1.0,
              sapo_tau_neg=1.05)[1] == pytest.approx(-adv)
    assert pg(0.0, adv, policy_loss="sapo", sapo_tau_pos=3.0,
              sapo_tau_neg=7.0)[1] == pytest.approx(-adv)
    # and away from 1 it falls off, where the clip would cut to 0 at once
    far = pg(math.log(2.0), adv, policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)[1]
    assert 0 < far / -adv < 2.0 and abs(far) < abs(2.0 * adv)


def test_kl_estimators_hand_worked():
    from loss import kl_estimate

    d = torch.tensor([[math.log(2), -math.log(2), 0.0]])  # d = log pi_ref - log pi
    mask = torch.ones(1, 3, dtype=torch.bool)
    z = torch.zeros(1, 3)
    for est, want in (("k1", [-0.6931, 0.6931, 0.0]), ("k2", [0.2402, 0.2402, 0.0]),
                      ("k3", [0.3069, 0.1931, 0.0])):
        assert kl_estimate(z, d, mask, est)[0].tolist() == pytest.approx(want, abs=1e-4), est
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(z, d, mask, "k4")
    with pytest.raises(ValueError, match="policy_loss"):
        grpo_loss(z, z, torch.ones(1), mask, LossSettings(policy_loss="ppo"))


def test_kl_estimators_agree_in_expectation_where_they_should():
    """Sampled from pi, k1 and k3 average to the true KL(pi || ref);
    k2 is biased but close when they are near."""
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(50, generator=g), 0)
    ref = torch.softmax(torch.log(pi) + 0.1 * torch.randn(50, generator=g), 0)
    true_kl = (pi * (pi.log() - ref.log())).sum().item()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    lp, rlp = pi.log()[tokens][None], ref.log()[tokens][None]
    mask = torch.ones_like(lp, dtype=torch.bool)
    from loss import kl_estimate

    k1, k2, k3 = (kl_estimate(lp, rlp, mask, e).mean().item() for e in ("k1", "k2", "k3"))
    assert k1 == pytest.approx(true_kl, rel=0.05) and k3 == pytest.approx(true_kl, rel=0.05)
    assert k2 == pytest.approx(true_kl, rel=0.2)
    assert kl_estimate(lp, rlp, mask, "k1").min() < 0 <= kl_estimate(lp, rlp, mask, "k3").min()


def test_dual_clip_frac_counts_the_bounded_tokens():
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64))  # ratios against old = 0
    _, m = grpo_loss(lp, torch.zeros(1, 3, dtype=torch.float64),
                     torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 3),
                     LossSettings(dual_clip=3.0))
    assert m["dual_clip_frac"] == pytest.approx(2 / 3)  # r = 5 twice above 3, r = 2 not


def test_high_entropy_mask_hand_worked_and_over_ranks():
    from loss import high_entropy_mask

    entropy = torch.tensor([[0.1, 0.5, 0.9, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last is padding: not counted, not kept
    # median 0.7
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, False, True, True, False]]
    assert high_entropy_mask(entropy, mask, 0.25).tolist() == [[False, False, False, True, False]]
    # two ranks: the threshold is the whole batch's, not each rank's own
    other = [3.0, 4.0, 5.0, 6.0]
    got = high_entropy_mask(entropy, mask, 0.5, gather=lambda values: values + other)
    assert got.tolist() == [[False, False, False, False, False]]  # the global median is 2.5


def test_pg_mask_drops_the_policy_gradient_but_keeps_the_kl():
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), 0.5, dtype=torch.float64)
    kw = dict(ref_logprobs=ref, beta=0.1)
    loss, m = grpo_loss(lp, lp.detach(), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2),
                        pg_mask=torch.tensor([[True, False]]), **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    kl_grad = 0.1 * (1 - math.exp(0.5)) / 2  # d/dlp of beta * k3, averaged over 2 tokens
    # token 2: the KL's pull only
    assert grad.tolist()[0] == pytest.approx([-0.5 + kl_grad, kl_grad])
    assert m["pg_token_frac"] == 0.5


# ---------------------------------------------------------------- on-policy distillation (L9)


def test_a_teacher_adds_its_per_token_say_to_the_advantage_hand_worked():
    """Two tokens, A = 1, pi_old = (0.5, 0.25), the teacher (0.25, 0.25): the first token's
    advantage is 1 + ln(0.25 / 0.5) = 1 - ln 2, the second's 1; the token-mean gradient is
    -A_t / 2 per token; teacher_kl is the mean of log pi_old - log teacher, ln 2 / 2."""
    lp = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    teacher = torch.tensor([[LN(0.25), LN(0.25)]])
    loss, m = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2),
                        teacher_logprobs=teacher)
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(-(1 - LN(2) + 1) / 2)
    assert grad[0].tolist() == pytest.approx([-(1 - LN(2)) / 2, -1 / 2])
    assert m["teacher_kl"] == pytest.approx(LN(2) / 2)
    half = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2), teacher_logprobs=teacher,
                     settings=LossSettings(distill_coef=0.5))[0]
    assert half.item() == pytest.approx(-(1 - LN(2) / 2 + 1) / 2)
    # a teacher that agrees with the student changes nothing; padding (even -inf) neither
    same = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2), teacher_logprobs=lp.detach())
    plain = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2))
    assert same[0].item() == plain[0].item() and same[1]["teacher_kl"] == 0.0
    padded = grpo_loss(lp, lp.detach(), torch.ones(1), torch.tensor([[1.0, 0.0]]),
                       teacher_logprobs=torch.tensor([[LN(0.25), -math.inf]]))[0]
    assert math.isfinite(padded.item())
    (grad,) = torch.autograd.grad(padded, lp)
    assert grad[0].tolist() == pytest.approx([-(1 - LN(2)), 0.0])


def test_the_distillation_gradient_is_the_reverse_kls():
    """Over a 5-token vocabulary, every token weighed by the probability the student samples it:
    the expected gradient of the loss (A = 0) is the gradient of KL(pi || teacher), exactly; the
    reverse KL, which a KL loss term on the sampled tokens would not give (k1's is 0 on-policy)."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    expected = sum(logp[y].exp().detach() * grpo_loss(
        logp[y].view(1, 1), logp[y].detach().view(1, 1), torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 1), teacher_logprobs=teacher[y].view(1, 1))[0] for y in range(5))
    (got,) = torch.autograd.grad(expected, theta, retain_graph=True)
    kl = (logp.exp() * (logp - teacher)).sum()
    (want,) = torch.autograd.grad(kl, theta)
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-12)
