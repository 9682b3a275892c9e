"""bench.py's side-by-side passes run on the tiny model: every variant, the same tokens, the positions each computes."""

import bench


def test_passes_compare_every_variant_on_one_batch(capsys):
    results = bench.passes(["--config", "config/tiny.py", "--batch_size=8", "--micro_batch_tokens=2048"],
                           "countdown", repeats=1)
    by_name = {r["variant"]: r for r in results}
    assert list(by_name) == [name for name, *_ in bench.PASS_VARIANTS]
    assert len({r["tokens"] for r in results}) == 1  # the same batch for every variant
    padded, one_run = by_name["padded rows, full logits"], by_name["shared prompt, one run, full logits"]
    runs = by_name["shared prompt, tail runs, full logits"]
    # prompts of 130-170 and completions of 300-1000 tokens in 2 groups of 4: each prompt once saves 3 x ~150
    # positions a group; runs by length pad the completions to their run's longest, never more than one run
    assert runs["tokens_computed"] <= one_run["tokens_computed"] < padded["tokens_computed"]
    assert all(r["ref_s"] > 0 and r["update_s"] > 0 and 0 <= r["pad_frac"] < 1 for r in results)
    assert "shared prompt, tail runs, fused" in capsys.readouterr().out
