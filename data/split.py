"""Fixed, disjoint train/test splits: a problem's split is a hash of its content, not of its position."""

import hashlib

TEST_PERCENT = 10  # share of all possible problems that belong to the test split


def in_split(key, split):
    """True if the problem with this content key belongs to `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100  # stable across runs and machines
    return (bucket < TEST_PERCENT) == (split == "test")
