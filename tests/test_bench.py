"""dev/bench.py's side-by-side passes on the tiny model: every variant, the same tokens, the
positions each computes.   pytest tests/test_bench.py
"""

import os

from config import Config
from dev import bench


def test_passes_compare_every_variant_on_one_batch(capsys):
    tiny = os.path.join(bench.ROOT, "config", "tiny.py")
    results = bench.passes(["--config", tiny, "--batch_size=8", "--micro_batch_tokens=2048"],
                           "countdown", repeats=1)
    by_name = {r["variant"]: r for r in results}
    assert list(by_name) == [name for name, *_ in bench.PASS_VARIANTS]
    assert len({r["tokens"] for r in results}) == 1  # the same batch for every variant
    padded = by_name["padded rows, full logits"]
    one_run = by_name["shared prompt, one run, full logits"]
    runs = by_name["shared prompt, tail runs, full logits"]
    # prompts of 130-170 and completions of 300-1000 tokens in 2 groups of 4: each prompt once saves
    # 3 x ~150 positions a group; runs by length pad the completions to their run's longest, never
    # more than one run
    assert runs["tokens_computed"] <= one_run["tokens_computed"] < padded["tokens_computed"]
    assert all(r["ref_s"] > 0 and r["update_s"] > 0 and 0 <= r["pad_frac"] < 1 for r in results)
    assert "shared prompt, tail runs, fused" in capsys.readouterr().out


def test_packed_rows_give_the_padded_rows_logprobs_and_gradients(tmp_path):
    """O4 as dev/bench.py measures it: the rows packed into one sequence (positions restarting per
    row, no mask) give the padded plain forward's logprobs, entropies and gradients to 1e-5 in
    fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from model import build_tiny, sequence_logprobs

    folder = build_tiny(str(tmp_path / "tiny"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = [9, 4, 12, 2]
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=g)
    attention = (torch.arange(12) < torch.tensor(lengths)[:, None]).long()
    weights = torch.randn(4, 11, generator=g) * attention[:, 1:]

    def values_and_grads(fn):
        model.zero_grad(set_to_none=True)
        lp, entropy = fn()
        ((lp + 0.3 * entropy) * weights).sum().backward()
        return (lp * attention[:, 1:], entropy * attention[:, 1:],
                [p.grad.clone() for p in model.parameters()])

    plain = Config(fused_logprobs=False, chunked_logprobs=False)
    padded = values_and_grads(
        lambda: sequence_logprobs(model, ids, 0.7, plain, attention_mask=attention))
    packed = values_and_grads(lambda: bench.packed_logprobs(model, ids, attention, 0.7))
    assert torch.allclose(packed[0], padded[0], atol=1e-5)
    assert torch.allclose(packed[1], padded[1], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(packed[2], padded[2]))
    # without the restarts the rows would attend to each other: the check above can fail
    flat = torch.cat([ids[r, :n] for r, n in enumerate(lengths)])[None]
    with torch.no_grad():
        leaked = model(input_ids=flat).logits[0, lengths[0] : lengths[0] + 3]  # row 1 seeing row 0
        alone = model(input_ids=ids[1:2, :3]).logits[0]
    assert not torch.allclose(leaked, alone, atol=1e-3)
