"""Group advantages against hand-worked numbers and a naive loop.

    pytest tests/test_advantage.py
"""

import itertools
import math
import statistics

import pytest
import torch

from advantage import (
    AdvantageSettings,
    component_advantages,
    group_advantages,
    group_stats,
    pass_k_advantages,
)

BATCH_LOO = AdvantageSettings(adv_scale="batch", adv_baseline="leave-one-out")  # RLOO on TRL's std


def naive_advantages(rewards, G, scale="group", std_floor=1e-4, zero_std_groups=False, clip=0.0):
    """One group, one completion at a time, in plain Python."""
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        mean = sum(group) / G
        std = statistics.stdev(group)  # Bessel-corrected
        for r in group:
            a = r - mean
            if scale == "group":
                a = a / max(std, std_floor)
            if zero_std_groups and std < std_floor:
                a = 0.0
            if clip > 0:
                a = min(max(a, -clip), clip)
            out.append(a)
    return out


def test_one_success_in_four():
    # mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_mean_only_scale():
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, AdvantageSettings(adv_scale="none"))
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_groups_are_independent_and_equal_groups_give_zero():
    adv = group_advantages(torch.tensor([1.0, 1, 1, 1, 0, 0, 2, 2]), 4)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    # second group: mean 1, unbiased std sqrt(4/3)
    assert adv[4:].tolist() == pytest.approx([-math.sqrt(3 / 4)] * 2 + [math.sqrt(3 / 4)] * 2)


def test_std_floor_and_zero_std_groups():
    # rewards 1e-6 apart: std 7.07e-7 is floored to 1e-4, so advantages are +-5e-7 / 1e-4 = +-0.005
    rewards = torch.tensor([0.0, 1e-6])
    assert group_advantages(rewards, 2).tolist() == pytest.approx([-0.005, 0.005], rel=1e-4)
    zeroed = AdvantageSettings(adv_zero_std_groups=True)
    assert group_advantages(rewards, 2, zeroed).tolist() == [0.0, 0.0]
    # a group with real spread is untouched by zero_std_groups
    spread = group_advantages(torch.tensor([0.0, 1.0]), 2, zeroed)
    assert spread.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_clip_after_normalising():
    # one success in 16: mean 1/16, unbiased std 0.25 -> winner (15/16) / 0.25 = 3.75, others -0.25
    rewards = torch.zeros(16)
    rewards[3] = 1.0
    assert group_advantages(rewards, 16)[3].item() == pytest.approx(3.75)
    clipped = group_advantages(rewards, 16, AdvantageSettings(adv_clip=3.0))
    assert clipped[3].item() == pytest.approx(3.0)
    assert clipped[0].item() == pytest.approx(-0.25)


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("zero_std_groups", [False, True])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_matches_naive_loop(scale, zero_std_groups, clip):
    torch.manual_seed(0)
    G = 6
    rewards = torch.rand(10 * G, dtype=torch.float64).round(decimals=1)
    rewards[:G] = 0.5  # an all-equal group
    rewards[G : 2 * G] = 0.5 + torch.arange(G) * 1e-6  # a nearly-equal group
    settings = AdvantageSettings(adv_scale=scale, adv_zero_std_groups=zero_std_groups,
                                 adv_clip=clip)
    got = group_advantages(rewards, G, settings)
    want = naive_advantages(rewards.tolist(), G, scale, 1e-4, zero_std_groups, clip)
    assert got.tolist() == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_sum_to_zero_per_group(scale):
    torch.manual_seed(1)
    adv = group_advantages(torch.randn(40), 8, AdvantageSettings(adv_scale=scale))
    assert adv.view(5, 8).sum(1).abs().max().item() < 1e-5
    assert adv.abs().sum().item() > 1.0  # not trivially zero


def test_clip_bounds_hold():
    torch.manual_seed(2)
    rewards = torch.zeros(64)
    rewards[::32] = 1.0  # one success per group of 32: winner gets ~5.4 std units
    adv = group_advantages(rewards, 32, AdvantageSettings(adv_clip=2.5))
    assert adv.max().item() == pytest.approx(2.5)
    assert adv.min().item() >= -2.5


def test_bad_shape_says_what_is_wrong():
    with pytest.raises(ValueError, match="num_prompts"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 4, AdvantageSettings(adv_scale="global"))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.zeros(4), 4, AdvantageSettings(adv_baseline="median"))


def test_group_stats_hand_worked():
    stats = group_stats(torch.tensor([1.0, 0, 1, 1]), 2)
    assert stats["effective_group_ratio"] == 0.5
    assert stats["frac_reward_zero_std"] == 0.5
    # std of [1, 0] is sqrt(0.5), of [1, 1] is 0
    assert stats["group_std"] == pytest.approx(math.sqrt(0.5) / 2)
    assert stats["pass_rate"].tolist() == [0.5, 1.0]


def test_group_stats_pass_rate_from_correct():
    # shaped rewards (format bonus) differ from correctness: the pass rate follows `correct`
    rewards = torch.tensor([0.2, 1.2, 0.2, 0.0])
    correct = torch.tensor([0.0, 1.0, 0.0, 0.0])
    stats = group_stats(rewards, 2, correct=correct)
    assert stats["pass_rate"].tolist() == [0.5, 0.0]
    assert stats["effective_group_ratio"] == 1.0


# ---------------------------------------------------------------- RLOO's baseline and the batch std


def naive_rloo(rewards, G):
    """Each completion against the mean of the other G - 1 in its group, one at a time."""
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            out.append(r - sum(others) / (G - 1))
    return out


def test_every_baseline_and_scale_on_one_group_hand_worked():
    """The table in group_advantages' docstring, for rewards [1, 0, 0, 0]."""
    r = torch.tensor([1.0, 0, 0, 0])
    want = {("mean", "group"): [1.5, -0.5, -0.5, -0.5], ("mean", "batch"): [1.5, -0.5, -0.5, -0.5],
            ("mean", "none"): [0.75, -0.25, -0.25, -0.25],
            ("leave-one-out", "group"): [2, -2 / 3, -2 / 3, -2 / 3],
            ("leave-one-out", "batch"): [2, -2 / 3, -2 / 3, -2 / 3],
            ("leave-one-out", "none"): [1, -1 / 3, -1 / 3, -1 / 3]}
    for (baseline, scale), expected in want.items():
        adv = group_advantages(r, 4, AdvantageSettings(adv_baseline=baseline, adv_scale=scale))
        assert adv.tolist() == pytest.approx(expected)


def test_leave_one_out_against_a_naive_loop_and_it_sums_to_zero():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g)
    adv = group_advantages(rewards, 5,
                           AdvantageSettings(adv_baseline="leave-one-out", adv_scale="none"))
    assert adv.tolist() == pytest.approx(naive_rloo(rewards.tolist(), 5), abs=1e-6)
    assert adv.view(6, 5).sum(dim=1).abs().max() < 1e-6  # RLOO advantages sum to 0 in every group
    # = the mean baseline's times G / (G - 1)
    mean_adv = group_advantages(rewards, 5, AdvantageSettings(adv_scale="none"))
    assert adv.tolist() == pytest.approx((mean_adv * 5 / 4).tolist(), abs=1e-6)


def naive_trl_batch_scale(rewards, G):
    """TRL GRPOTrainer's scale_rewards="batch", one completion at a time: (r - its group's mean) /
    (the unbiased std of every reward of the batch + 1e-4)."""
    std = statistics.stdev(rewards)
    return [(r - sum(rewards[i // G * G : i // G * G + G]) / G) / (std + 1e-4)
            for i, r in enumerate(rewards)]


def test_batch_scale_is_trls_std_of_the_batchs_rewards():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 1, 2, 2])
    centred = [0.75, -0.25, -0.25, -0.25, 1, -1, 0, 0]
    # by hand: mean 9/8, squared deviations sum to 71/8, unbiased variance 71/56; the std of the
    # centred rewards (2.75/7) would give advantages 1.8x larger
    std = math.sqrt(71 / 56)
    batch = group_advantages(rewards, 4, AdvantageSettings(adv_scale="batch"))
    assert batch.tolist() == pytest.approx([c / std for c in centred], abs=1e-6)
    # a group's own std no longer matters: the two groups' advantages keep their raw ratio
    assert batch[4].item() / batch[0].item() == pytest.approx(1 / 0.75)
    # TRL's formula, + 1e-4 where this floors the std: the same to within 1e-4 / std
    g = torch.Generator().manual_seed(0)
    for rewards in (torch.rand(6 * 4, generator=g), (torch.rand(5 * 8, generator=g) > 0.7).float()):
        G = 4 if len(rewards) == 24 else 8
        ours = group_advantages(rewards, G, AdvantageSettings(adv_scale="batch"))
        trl = naive_trl_batch_scale(rewards.tolist(), G)
        rel = 1e-4 / statistics.stdev(rewards.tolist()) + 1e-6
        assert ours.tolist() == pytest.approx(trl, rel=rel, abs=1e-6)
    # leave-one-out keeps its G / (G - 1) factor: the std is the rewards', not the advantages'
    loo = group_advantages(rewards, 8, BATCH_LOO)
    batch = group_advantages(rewards, 8, AdvantageSettings(adv_scale="batch"))
    assert loo.tolist() == pytest.approx((batch * 8 / 7).tolist(), abs=1e-6)


def test_batch_std_over_two_ranks_is_the_one_process_std():
    """Under torchrun each rank holds some groups; batch_sum
    (parallel.all_sum) makes the std the global one."""
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 1, 2, 2, 5, 5, 0, 1])
    one = group_advantages(rewards, 4, BATCH_LOO)
    halves = rewards[:4], rewards[4:]
    # each rank's rewards
    stats = [(h.numel(), h.sum().item(), (h.double() ** 2).sum().item()) for h in halves]
    for rank in (0, 1):
        calls = iter(range(3))  # batch_std sums n, then sum, then sum of squares

        def all_sum(x, rank=rank, calls=calls):
            return x + stats[1 - rank][next(calls)]  # this rank's share plus the other rank's

        got = group_advantages(halves[rank], 4, BATCH_LOO, batch_sum=all_sum)
        assert got.tolist() == pytest.approx(one[:4].tolist() if rank == 0 else one[4:].tolist())


# ---------------------------------------------------------------- equal rewards, float32, TRL


@pytest.mark.parametrize("G", [4, 8, 16])
@pytest.mark.parametrize("baseline", ["mean", "leave-one-out"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exactly_zero_in_float32(G, baseline, scale):
    """A group of equal rewards has advantage exactly 0, whatever their value: in float32 the mean
    of eight rewards of 1.05 is one ulp off 1.05, and the 1e-4 floor would blow r - mean up to
    1.2e-3 (the zero-gradient shortcut relies on the 0). A group with a spread beside it keeps the
    plain formula's values."""
    values = [1.05, 0.3, 0.7, -0.2, 1.1, 0.1 + 1.0]
    flat = torch.tensor([v for v in values for _ in range(G)])
    settings = AdvantageSettings(adv_baseline=baseline, adv_scale=scale)
    assert (group_advantages(flat, G, settings) == 0).all()
    mixed = torch.cat([torch.full((G,), 1.05), torch.tensor([1.0] + [0.0] * (G - 1))])
    got = group_advantages(mixed, G, settings)
    assert (got[:G] == 0).all()
    if scale == "group" and baseline == "mean":
        assert got[G:].tolist() == pytest.approx(naive_advantages(mixed[G:].tolist(), G), abs=1e-6)


def trl_frac_reward_zero_std(rewards, G):
    """TRL 1.16's frac_reward_zero_std (GRPOTrainer._generate_and_score_completions, scale_rewards
    "group"): its nanstd of each group, repeated per row, torch.isclose to 0, the mean."""
    from trl.trainer.utils import nanstd

    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


def test_frac_reward_zero_std_is_trls():
    """frac_reward_zero_std against TRL's own nanstd and isclose: the same on 0/1 rewards, shaped
    rewards, nearly equal continuous ones (a spread of 1e-6 is a spread for both, though the old
    1e-4 threshold here called it none) and G from 2 to 16. One case differs, and says why: eight
    rewards of 1.05, where TRL's float32 std is ~1e-7 and it counts a spread that group_advantages
    (and TRL's own advantage, (r - mean) / (std + 1e-4) ~ 1e-3) turns into noise."""
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    for G in (2, 4, 8, 16):
        for rewards in ((torch.rand(32 * G, generator=g) > 0.8).float(),  # mostly all-wrong groups
                        (torch.rand(32 * G, generator=g) > 0.8).float() * 1.0 + 0.1,  # shaped
                        torch.randint(0, 2, (32 * G,), generator=g).float() * 0.25):
            assert group_stats(rewards, G)["frac_reward_zero_std"] == trl_frac_reward_zero_std(
                rewards, G)
    nearly = torch.tensor([0.5, 0.5, 0.5, 0.5 + 1e-6, 1.0, 1.0, 1.0, 1.0])
    assert group_stats(nearly, 4)["frac_reward_zero_std"] == trl_frac_reward_zero_std(nearly, 4)
    assert group_stats(nearly, 4)["frac_reward_zero_std"] == 0.5
    float_noise = torch.full((8,), 1.05)
    assert trl_frac_reward_zero_std(float_noise, 8) == 0.0  # TRL: a spread of ~1e-7
    assert group_stats(float_noise, 8)["frac_reward_zero_std"] == 1.0
    assert group_stats(float_noise, 8)["effective_group_ratio"] == 0.0


def test_the_std_floor_against_trls_added_epsilon():
    """scale="group" divides by max(std, 1e-4); TRL by std + 1e-4. Hand numbers for the docstring:
    one success in four, 1.5 against 1.4997; at std = 1e-4 TRL's is half; far below, the same."""
    one_in_four = torch.tensor([1.0, 0, 0, 0])
    assert group_advantages(one_in_four, 4)[0].item() == pytest.approx(1.5)
    assert 0.75 / (0.5 + 1e-4) == pytest.approx(1.49970, abs=1e-5)
    at_floor = torch.tensor([0.0, 0.0, 0.0, 2e-4], dtype=torch.float64)  # std = 1e-4 exactly
    ours = group_advantages(at_floor, 4)
    trl = (at_floor - at_floor.mean()) / (at_floor.std() + 1e-4)
    assert ours.tolist() == pytest.approx((2 * trl).tolist(), rel=1e-9)
    tiny = torch.tensor([0.0, 0.0, 0.0, 2e-8], dtype=torch.float64)  # std 1e-8
    trl = (tiny - tiny.mean()) / (tiny.std() + 1e-4)
    assert group_advantages(tiny, 4).tolist() == pytest.approx(trl.tolist(), rel=1e-3)


# ---------------------------------------------------------------- pass@k advantages (A5)


def brute_pass_k(group, k):
    """Chen et al.'s bootstrap taken to its limit: every k-subset of the group, scored by its best
    reward, z-scored over the subsets (population std); each completion's advantage the mean over
    the subsets that hold it."""
    subsets = list(itertools.combinations(range(len(group)), k))
    scores = [max(group[i] for i in s) for s in subsets]
    mu = sum(scores) / len(scores)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in scores) / len(scores))
    if sigma == 0:
        return [0.0] * len(group)
    return [statistics.mean((x - mu) / sigma for s, x in zip(subsets, scores) if i in s)
            for i in range(len(group))]


def test_pass_k_hand_worked_and_the_papers_closed_form():
    # G = 4, k = 2, one right: mu = 1/2, sigma = 1/2; the right one's pairs all score 1, a wrong
    # one's pairs score 1 once in 3
    got = pass_k_advantages(torch.tensor([1.0, 0, 0, 0]), 4, 2)
    assert got.tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3])
    for n, k in ((8, 1), (8, 3), (8, 7), (16, 4), (5, 2)):
        for c in range(1, n):  # c right of n
            rewards = torch.tensor([1.0] * c + [0.0] * (n - c))
            if n - c < k:  # every k-subset holds a right one: pass@k is 1, no signal
                assert pass_k_advantages(rewards, n, k).tolist() == [0.0] * n
                continue
            mu = 1 - math.comb(n - c, k) / math.comb(n, k)
            sigma = math.sqrt(mu * (1 - mu))
            right = (1 - mu) / sigma
            wrong = (1 - mu - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
            assert pass_k_advantages(rewards, n, k).tolist() == pytest.approx(
                [right] * c + [wrong] * (n - c), abs=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_k_against_every_k_subset(k):
    """Continuous rewards, ties, several groups, a group of equal rewards: as the enumeration."""
    gen = torch.Generator().manual_seed(k)
    rewards = torch.cat([torch.rand(6, generator=gen), torch.tensor([1.0, 0, 1, 0.5, 0.5, 0]),
                         torch.full((6,), 0.3), (torch.rand(6, generator=gen) * 3).round()])
    got = pass_k_advantages(rewards, 6, k)
    want = [a for g in rewards.view(-1, 6).tolist() for a in brute_pass_k(g, k)]
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert got[12:18].tolist() == [0.0] * 6  # equal rewards: exactly 0


def test_pass_k_1_is_the_z_score_and_unscored_rows_are_left_out():
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 3, 5, 1])
    population = group_advantages(rewards, 4) * math.sqrt(4 / 3)  # unbiased std -> population
    assert pass_k_advantages(rewards, 4, 1).tolist() == pytest.approx(population.tolist())
    with_nan = pass_k_advantages(torch.tensor([1.0, math.nan, 0, 0, 0]), 5, 2)
    assert with_nan.tolist() == pytest.approx([1, 0, -1 / 3, -1 / 3, -1 / 3])
    # at most k scored: every subset is the whole group
    assert pass_k_advantages(torch.tensor([1.0, math.nan, math.nan, 0]), 4, 2).tolist() == [0] * 4
    assert pass_k_advantages(torch.full((4,), math.nan), 4, 2).tolist() == [0] * 4  # none scored


def test_adv_pass_k_is_group_advantages_switch_and_clip_still_applies():
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])
    on = AdvantageSettings(adv_pass_k=4)
    assert group_advantages(rewards, 8, on).tolist() == pytest.approx(
        pass_k_advantages(rewards, 8, 4).tolist())
    clipped = group_advantages(rewards, 8, AdvantageSettings(adv_pass_k=4, adv_clip=0.1))
    assert clipped.abs().max().item() == pytest.approx(0.1)


# ---------------------------------------------------------------- per-component advantages (A6)


def naive_gdpo(terms, weights, G):
    """TRL's normalize_then_sum, one value at a time, with this module's std floor and without
    its batch mean (0 here by construction)."""
    N, K = len(terms), len(weights)
    total = [0.0] * N
    for j in range(K):
        column = [t[j] for t in terms]
        for start in range(0, N, G):
            group = column[start : start + G]
            mean, std = statistics.mean(group), statistics.stdev(group)
            for i, r in enumerate(group):
                z = 0.0 if max(group) == min(group) else (r - mean) / max(std, 1e-4)
                total[start + i] += weights[j] * z
    std = statistics.stdev(total)
    return [a / max(std, 1e-4) for a in total]


def test_per_component_hand_worked():
    terms = torch.tensor([[1.0, 1], [0, 1], [0, 0], [0, 0]])  # correct, format
    got = component_advantages(terms, torch.tensor([1.0, 0.1]), 4)
    # z-scores [1.5, -.5, -.5, -.5] and [.866, .866, -.866, -.866]; summed; / their std 1.0609
    summed = [1.5 + 0.0866025, -0.5 + 0.0866025, -0.5 - 0.0866025, -0.5 - 0.0866025]
    assert got.tolist() == pytest.approx([x / statistics.stdev(summed) for x in summed], abs=1e-5)
    assert got.tolist() == pytest.approx([1.4956, -0.3897, -0.5529, -0.5529], abs=1e-4)


def test_per_component_keeps_a_narrow_term_from_drowning():
    """correct 0/1 beside a score in the hundreds: summed first, the score is nearly all of the
    advantage and the right answers barely count; normalised apart, each term weighs one unit."""
    correct = torch.tensor([1.0, 1, 0, 0])
    score = torch.tensor([100.0, 300, 200, 400])
    summed = group_advantages(correct + score, 4)
    apart = component_advantages(torch.stack([correct, score], dim=1), torch.ones(2), 4)
    # the right answer with the worst score (0): summed, it is below a wrong one (2)
    assert summed[0] < summed[2]
    assert apart[0] > apart[2]  # apart: right beats wrong when the score gap is one step
    gen = torch.Generator().manual_seed(0)
    terms = torch.rand(24, 3, generator=gen).round(decimals=1)
    weights = torch.tensor([1.0, 0.5, 2.0])
    want = naive_gdpo(terms.tolist(), weights.tolist(), 6)
    assert component_advantages(terms, weights, 6).tolist() == pytest.approx(want, abs=1e-5)


def test_per_component_equal_groups_stay_zero_and_nan_rows_are_left_out():
    terms = torch.tensor([[1.0, 0], [1, 0], [1, 0], [1, 0], [1.0, 1], [0, 1], [0, 0], [0, 0]])
    got = component_advantages(terms, torch.tensor([1.0, 0.1]), 4)
    assert got[:4].tolist() == [0.0] * 4  # TRL subtracts a batch mean that leaves ~1e-8 here
    assert abs(got[4:].sum().item()) < 1e-6
    nan = terms.clone()
    nan[5, 1] = math.nan
    got = component_advantages(nan, torch.tensor([1.0, 0.1]), 4)
    assert got[5].item() == 0.0 and math.isfinite(got.sum().item())
    clipped = component_advantages(terms, torch.ones(2), 4, AdvantageSettings(adv_clip=0.5))
    assert clipped.abs().max().item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"terms must be \(N, K\)"):
        component_advantages(terms, torch.ones(3), 4)
