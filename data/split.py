"""Fixed, disjoint train/test splits: a problem's split is a hash of its content,
not of its position."""

import hashlib
import random

TEST_PERCENT = 10  # share of all possible problems that belong to the test split


def in_split(key, split):
    """True if the problem with this content key belongs to `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    # stable across runs and machines
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return (bucket < TEST_PERCENT) == (split == "test")


def draw_distinct(split, n, seed, make):
    """The first n distinct problems of `split`, drawn by make(rng) ->
    (key, split_key, problem dict) or None.

    key is the problem's content (it decides the duplicates and becomes the id); split_key decides
    the split, so problems that are one problem in other words (a + b and b + a) share it and can
    never fall on both sides. Fails clearly when 100k draws in a row bring nothing new, i.e. the
    settings allow fewer than n problems.
    """
    rng, seen, out, misses = random.Random(seed), set(), [], 0
    while len(out) < n:
        misses += 1
        if misses > 100_000:
            raise ValueError(f"only {len(out)} distinct {split} problems exist for these settings, "
                             f"{n} asked for; lower train_size/test_size or widen the ranges")
        made = make(rng)
        if made is None or made[0] in seen or not in_split(made[1], split):
            continue
        seen.add(made[0])
        misses = 0
        out.append({"id": made[0], **made[2]})
    return out
