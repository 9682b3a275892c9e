"""The fast paths (perf/) held to the plain ones: chunked and fused token logprobs, each prompt
once (tail runs, the micro-batch planner), the CPU settings.   pytest tests/test_perf.py

The plain path is loss.token_logprobs on the full logits, over padded rows, with transformers' own
attention: every fast path gives its numbers, values and gradients, within fp32 rounding.
"""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import grpo
from config import Config
from infra.memory import head_chunk
from loss import token_logprobs
from model import build_tiny, self_attending_mask, sequence_logprobs
from perf import cpu, shared_prompt
from perf.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy
from perf.shared_prompt import checkpoint_with_cache, tail_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LN = math.log
PLAIN = Config(fused_logprobs=False, chunked_logprobs=False)  # log_softmax of the full logits
CHUNKED = Config(fused_logprobs=False, chunked_logprobs=True)  # the default
FUSED = Config(fused_logprobs=True)

# model.py's functions, passed in as grpo.py passes them (perf/ imports nothing of model.py)
shared_prompt_logprobs = functools.partial(
    shared_prompt.shared_prompt_logprobs, sequence_logprobs=sequence_logprobs,
    self_attending_mask=self_attending_mask)


# ---------------------------------------------------------------- chunked logprobs (L6)


def fp64_logprobs(logits, tokens, temperature):
    """loss.token_logprobs's definition in fp64 (token_logprobs itself computes in fp32): the oracle
    where gradients are checked to 1e-10."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_chunked_logprobs_hand_worked():
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, LN(3)], [0.0, LN(3)]]])
    lp, ent = logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    assert lp.tolist()[0] == pytest.approx([LN(3 / 4), LN(1 / 4)], abs=1e-6)
    want_h = -(0.25 * LN(0.25) + 0.75 * LN(0.75))
    assert ent.tolist()[0] == pytest.approx([want_h, want_h], abs=1e-6)
    # temperature 2 halves the logits: softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    lp_t, _ = logprobs_and_entropy(logits, torch.tensor([[1, 0]]), temperature=2.0)
    s3 = math.sqrt(3)
    assert lp_t.tolist()[0] == pytest.approx([LN(s3 / (1 + s3)), LN(1 / (1 + s3))], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_logprobs_equal_the_plain_ones(dtype, chunk):
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 4).to(dtype)
    tokens = torch.randint(0, 50, (3, 7))
    lp, ent = logprobs_and_entropy(logits, tokens, 0.7, chunk=chunk)
    want_lp, want_ent = token_logprobs(logits, tokens, 0.7)
    assert lp.dtype == torch.float32  # fp32 even from bf16 logits (L6)
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert torch.allclose(ent, want_ent, atol=1e-5)


def test_chunked_gradients_match_autograd_of_log_softmax():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 5))
    w_lp, w_ent = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    lp, ent = logprobs_and_entropy(x, tokens, 1.3, chunk=2)
    (g,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), x)
    want_lp, want_ent = fp64_logprobs(x, tokens, 1.3)
    loss = (want_lp * w_lp).sum() + (want_ent * w_ent).sum()
    (want_g,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert torch.allclose(g, want_g, atol=1e-10)
    # logprobs alone (entropy unused): its grad is None inside backward and must be skipped cleanly
    (g_lp,) = torch.autograd.grad((logprobs_and_entropy(x, tokens, 1.3)[0] * w_lp).sum(), x)
    (want_g_lp,) = torch.autograd.grad((want_lp * w_lp).sum(), x)
    assert torch.allclose(g_lp, want_g_lp, atol=1e-10)


def test_chunked_gradcheck():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, tokens, 0.9, chunk=2), (x,))


def test_chunked_logprobs_of_a_non_contiguous_slice():
    # the trainer may pass model_logits[:, :-1], a non-contiguous view
    torch.manual_seed(3)
    full = torch.randn(2, 6, 9, requires_grad=True)
    tokens = torch.randint(0, 9, (2, 5))
    lp, _ = logprobs_and_entropy(full[:, :-1], tokens)
    assert torch.allclose(lp, token_logprobs(full[:, :-1].detach(), tokens)[0], atol=1e-6)
    lp.sum().backward()
    assert full.grad[:, -1].abs().sum().item() == 0.0  # the dropped position gets no gradient


def test_no_fp32_copy_of_the_logits_is_kept_for_backward():
    """Saved-for-backward tensors: bf16 logits plus (B, T) vectors; the plain path (log_softmax of
    the fp32 logits) keeps a (B, T, V) fp32 copy."""
    B, T, V = 2, 8, 1000
    logits = torch.randn(B, T, V, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))

    def saved(fn):
        found = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t) or t, lambda t: t):
            fn()
        return [t for t in found if t.dtype == torch.float32 and t.numel() >= B * T * V]

    assert saved(lambda: logprobs_and_entropy(logits, tokens)) == []
    assert len(saved(lambda: token_logprobs(logits, tokens))) > 0  # the check can fail


# ---------------------------------------------------------------- the fused head (L6)


def test_linear_logprobs_hand_example_and_no_logits():
    """hidden [1, 0] and rows [0, 0], [ln 3, 0] make the logits [0, ln 3]: log p(1) = ln(3/4)."""
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]])
    lp, ent = linear_logprobs_and_entropy(torch.tensor([[[1.0, 0.0]]]), weight, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_linear_logprobs_equal_the_plain_path_values_and_gradients(chunk):
    """Against token_logprobs(h W^T + b): the same values and gradients in h, W and b (fp32)."""
    torch.manual_seed(0)
    h = torch.randn(3, 5, 16, requires_grad=True)
    w, b = torch.randn(50, 16, requires_grad=True), torch.randn(50, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 5))
    up_lp, up_ent = torch.randn(3, 5), torch.randn(3, 5)  # arbitrary upstream gradients

    def grads(fn):
        lp, ent = fn()
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        out = lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone(), b.grad.clone()
        h.grad = w.grad = b.grad = None
        return out

    fused = grads(lambda: linear_logprobs_and_entropy(h, w, tokens, 0.7, bias=b, chunk=chunk))
    plain = grads(lambda: token_logprobs(h @ w.T + b, tokens, 0.7))
    for got, want in zip(fused, plain):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_linear_logprobs_gradcheck():
    torch.manual_seed(1)
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3))

    def fused(h, w, b):
        return linear_logprobs_and_entropy(h, w, tokens, 0.9, bias=b, chunk=2)

    assert torch.autograd.gradcheck(fused, (h, w, b))


def test_linear_logprobs_under_bf16_autocast_match_bf16_logits():
    """Under autocast the head's matmul runs in bf16, as the model's own head would: the same
    logprobs as bf16 logits through the plain path, and gradients of the fp32 master weights in
    fp32."""
    torch.manual_seed(2)
    h, w = torch.randn(2, 4, 32), torch.randn(64, 32, requires_grad=True)
    tokens = torch.randint(0, 64, (2, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = linear_logprobs_and_entropy(h, w, tokens)
        logits = h @ w.T
        want, _ = token_logprobs(logits, tokens)
    assert logits.dtype == torch.bfloat16
    assert lp.dtype == torch.float32 and torch.allclose(lp, want, atol=1e-4)
    lp.sum().backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def weight_sized_tensors_made(fn, V, H):
    """How many new tensors of at least V * H elements the ops run by fn() make (views, in-place
    and out= ops make none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = not (func.is_view or func._schema.name.endswith("_") or "out" in (kwargs or {}))
            made.extend(t for t in (out if isinstance(out, (tuple, list)) else [out])
                        if fresh and isinstance(t, torch.Tensor) and t.numel() >= V * H)
            return out

    with Count():
        fn()
    return len(made)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_head_backward_makes_no_weight_sized_tensor_per_chunk(autocast):
    """The weight gradient is summed in place chunk by chunk: backward makes the same few (V, H)
    tensors (the gradient, and under bf16 autocast the weight's bf16 copy) for 1 chunk as for 12,
    and the gradient is the bf16 product summed in fp32."""
    torch.manual_seed(4)
    V, H = 40, 24
    h, w = torch.randn(1, 12, H), torch.randn(V, H, requires_grad=True)
    tokens = torch.randint(0, V, (1, 12))

    def backward_count(chunk):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = linear_logprobs_and_entropy(h, w, tokens, chunk=chunk)
        w.grad = None
        return weight_sized_tensors_made(lambda: (lp.sum() + ent.sum()).backward(), V, H)

    assert backward_count(12) == backward_count(6) == backward_count(1) == (2 if autocast else 1)
    if autocast:  # d/dW of sum(log p) = (onehot - p)^T h, with bf16 operands and an fp32 sum
        p = torch.softmax((h[0].bfloat16() @ w.detach().bfloat16().T).float(), -1)
        g = (torch.nn.functional.one_hot(tokens[0], V) - p).bfloat16().float()
        w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = linear_logprobs_and_entropy(h, w, tokens, chunk=5)
        lp.sum().backward()
        assert torch.allclose(w.grad, g.T @ h[0].bfloat16().float(), atol=1e-5)


def test_fused_head_chunk_is_sized_for_the_device(monkeypatch):
    """2^24 logits a chunk on a CPU (110 positions at Qwen2.5's 152k vocabulary), 2^27 on CUDA
    (883), at least one position."""
    from perf import logprobs

    assert (head_chunk("cpu", 151936), head_chunk("cuda", 151936)) == (110, 883)
    assert head_chunk("cuda", 2**28) == 1 and head_chunk("mps", 2**20) == 16
    chunks = []
    apply = logprobs._LinearLogprobsEntropy.apply
    spy = lambda *args: chunks.append(args[5]) or apply(*args)  # noqa: E731
    monkeypatch.setattr(logprobs._LinearLogprobsEntropy, "apply", spy)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    linear_logprobs_and_entropy(torch.randn(1, 3, 8), torch.randn(2**20, 8), tokens)
    assert chunks == [16]  # a CPU tensor: the CPU's size


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("m") / "tiny"))


def test_fused_head_is_refused_for_models_with_transformed_logits(tiny_folder):
    from transformers import AutoModelForCausalLM

    from perf.logprobs import fused_head_unsupported

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    assert fused_head_unsupported(model) is None
    model.config.final_logit_softcapping = 30.0  # Gemma 2 caps the logits after the head
    assert "final_logit_softcapping" in fused_head_unsupported(model)


# ---------------------------------------------------------------- the trainer's forward, every path


def grouped_rows(vocab, seed=0):
    """Right-padded rows of 3 groups of 2 (prompts of 5, 7 and 2 tokens; completions of 1-6), their
    response mask, prompt lengths and groups."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for P, lengths in [(5, [3, 6]), (7, [1, 4]), (2, [5, 2])]:
        prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
        rows += [(prompt, torch.randint(0, vocab, (C,), generator=g).tolist()) for C in lengths]
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    attention = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)], attention[i, : len(p) + len(c)] = torch.tensor(p + c), 1
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1
    prompt_lens = torch.tensor([len(p) for p, _ in rows])
    return ids, attention, mask, prompt_lens, torch.arange(len(rows)) // 2


def values_and_grads(model, fn, mask):
    """(logprobs, entropy) on the response tokens, and every weight's gradient of a loss of both."""
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    weights = torch.linspace(-1, 1, mask.shape[1])
    ((lp * weights + 0.3 * ent) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (lp * mask).detach(), (ent * mask).detach(), grads


def assert_same(got, want, atol=1e-5):
    """values_and_grads of two passes agree: logprobs, entropies and every gradient."""
    assert torch.allclose(got[0], want[0], atol=atol) and torch.allclose(got[1], want[1], atol=atol)
    assert got[2].keys() == want[2].keys() and len(want[2]) > 0
    for name, grad in want[2].items():
        assert torch.allclose(got[2][name], grad, atol=atol), name


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_sequence_logprobs_chunked_and_fused_give_the_plain_paths_numbers(tmp_path_factory, tie):
    """model.sequence_logprobs on the tiny model over padded rows: chunked_logprobs and
    fused_logprobs give the plain path's (log_softmax of the full logits) logprobs, entropies and
    gradients of every weight within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny(str(tmp_path_factory.getbasetemp() / f"tiny_{not tie}"), tie=tie)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    ids, attention, mask, _, _ = grouped_rows(model.config.vocab_size)

    def run(cfg):
        def forward():
            return sequence_logprobs(model, ids, 0.7, cfg, attention_mask=attention)

        return values_and_grads(model, forward, mask)

    plain = run(PLAIN)
    assert plain[0].abs().sum() > 0 and (plain[0] != 0).sum() == mask.sum()  # every response token
    assert len(plain[2]) == len(list(model.parameters()))  # the head's and the embedding's too
    for cfg in (CHUNKED, FUSED, dataclasses.replace(FUSED, chunked_logprobs=False)):
        assert_same(run(cfg), plain)


# ---------------------------------------------------------------- each prompt once (shared_prompt)


def test_tail_runs_pad_no_run_beyond_half():
    # 7 6 5 4 | 3 2: 3 <= 7 / 2 starts a run
    assert tail_runs([4, 7, 2, 5, 6, 3]) == [[1, 4, 3, 0], [5, 2]]
    assert tail_runs([96, 10, 96, 40, 12]) == [[0, 2], [3], [4, 1]]
    assert tail_runs([4, 7, 2], split=False) == [[0, 1, 2]]
    for tails in ([1] * 5, [9, 1, 5, 3, 7, 2, 8], list(range(1, 40))):
        runs = tail_runs(tails)
        assert sorted(r for run in runs for r in run) == list(range(len(tails)))
        for run in runs:  # longest first; no row at most half the longest
            assert tails[run[0]] == max(tails[i] for i in run)
            assert all(2 * tails[r] > tails[run[0]] for r in run)


def test_shared_prompt_micro_batches_keep_groups_whole_under_the_budget():
    """Cost of a micro-batch: its groups' prompts but the last token, once (groups x longest), plus
    every row's last prompt token + completion (rows x longest). Hand-worked: groups 0 (prompt 11)
    and 1 (prompt 21), G = 2."""
    # tails 10, 5, 20, 10
    lengths, prompt_lens, groups = [20, 15, 40, 30], [11, 11, 21, 21], [0, 0, 1, 1]
    cost = functools.partial(shared_prompt.shared_prompt_cost, lengths=lengths,
                             prompt_lens=prompt_lens, groups=groups)
    assert cost([0, 1], runs=False) == (1 * 10 + 2 * 10, 10 + 10 + 5)
    assert cost([0, 2], runs=False) == (2 * 20 + 2 * 20, 30 + 10 + 20)
    # tail runs: a tail at most half its run's longest starts a run of its own, padded to its length
    assert cost([0, 1]) == (1 * 10 + 10 + 5, 10 + 10 + 5)
    assert cost([0, 2]) == (2 * 20 + 20 + 10, 30 + 10 + 20)
    assert cost([0, 3]) == (2 * 20 + 2 * 10, 30 + 10 + 10)
    plan = functools.partial(shared_prompt.shared_micro_batches, lengths, prompt_lens, groups)
    assert plan(1000) == [[2, 3, 0, 1]]  # longest group first
    assert plan(60) == [[2, 3], [0, 1]]  # 20 + 20 + 10 = 50 fits, a third row would not
    # a group over the budget alone is split between its rows, each part computing the prompt once
    assert plan(45) == [[2], [3], [0, 1]]
    # the planner prices each micro-batch as computed: (plan, positions, real tokens)
    with_runs = Config(micro_batch_tokens=60)
    assert shared_prompt.plan_micro_batches(lengths, prompt_lens, groups, with_runs) == (
        [[2, 3], [0, 1]], (20 + 20 + 10) + (10 + 10 + 5), 50 + 25)
    padded_tails = Config(micro_batch_tokens=60, tail_runs=False)  # 20 + 2 x 20 = 60 fits
    assert shared_prompt.plan_micro_batches(lengths, prompt_lens, groups, padded_tails) == (
        [[2, 3], [0, 1]], (20 + 2 * 20) + (10 + 2 * 10), 50 + 25)
    # grpo's planner: a mini-batch's rows (here 4..7 of a batch of 8) back in the batch's numbering
    rows, sizes = [4, 5, 6, 7], ([0] * 4 + lengths, [0] * 4 + prompt_lens, [0] * 4 + [2, 2, 3, 3])
    shared = dataclasses.replace(with_runs, shared_prompt=True)
    assert grpo.plan_micro_batches(rows, *sizes, shared) == ([[6, 7], [4, 5]], 75, 75)
    # padded rows, rows x longest: 40 | 30 30 | 15
    padded = dataclasses.replace(with_runs, shared_prompt=False)
    want = [[6], [7, 4], [5]], 40 + 2 * 30 + 15, 105
    assert grpo.plan_micro_batches(rows, *sizes, padded) == want


@pytest.mark.parametrize("setup", ["tied", "untied", "checkpointing", "lora", "one run"])
@pytest.mark.parametrize("fused", [False, True])
def test_shared_prompt_forward_equals_the_padded_rows(tmp_path_factory, setup, fused):
    """Each group's prompt once (prompt pass + completions on its keys and values) gives the padded
    plain forward's logprobs, entropies and gradients to 1e-5 in fp32: tied and untied heads,
    gradient checkpointing, LoRA; the completion pass in runs by length (here 7 6 5 4 | 3 2 tokens)
    and as one padded run."""
    from transformers import AutoModelForCausalLM

    tie = setup != "untied"
    folder = build_tiny(str(tmp_path_factory.getbasetemp() / f"tiny_{not tie}"), tie=tie)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if setup == "checkpointing":
        model.gradient_checkpointing_enable()
    if setup == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    model.train()
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size)
    cfg = Config(fused_logprobs=fused, tail_runs=setup != "one run")

    def padded_pass():
        return sequence_logprobs(model, ids, 0.7, PLAIN, attention_mask=attention)

    def shared_pass():
        return shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 0.7, cfg)

    padded = values_and_grads(model, padded_pass, mask)
    shared = values_and_grads(model, shared_pass, mask)
    assert_same(shared, padded)
    # every response token, nothing else
    assert padded[0].abs().sum() > 0 and (shared[0] != 0).sum() == mask.sum()


def test_shared_prompt_rows_may_come_in_any_order_and_split_a_group(tiny_folder):
    """A micro-batch may hold part of a group (a group over the token budget), rows in any order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size, seed=3)
    rows = [5, 0, 3]  # one row each of groups 2, 0, 1
    with torch.no_grad():
        want, _ = sequence_logprobs(model, ids[rows], 1.0, PLAIN, attention_mask=attention[rows])
        got, _ = shared_prompt_logprobs(model, ids[rows], attention[rows], prompt_lens[rows],
                                        groups[rows], 1.0, FUSED)
    m = mask[rows]
    assert torch.allclose(got * m, want * m, atol=1e-5) and (want * m).abs().sum() > 0


def test_rows_of_a_group_whose_prompts_differ_are_an_error(tiny_folder):
    """Each prompt once computes a group's prompt from its first row: a group whose rows' prompts
    differ (a token, or a length) would train its other rows on the wrong prompt. An error naming
    the setting instead."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size)
    with torch.no_grad():
        shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 1.0, CHUNKED)  # alike
        other = ids.clone()
        other[3, 2] = (other[3, 2] + 1) % model.config.vocab_size  # row 3: group 1's second row
        with pytest.raises(ValueError, match="group 1 do not share.*--shared_prompt=false"):
            shared_prompt_logprobs(model, other, attention, prompt_lens, groups, 1.0, CHUNKED)
        shorter = prompt_lens.clone()
        shorter[1] -= 1  # group 0's second row: a prompt a token shorter
        with pytest.raises(ValueError, match="group 0 do not share"):
            shared_prompt_logprobs(model, ids, attention, shorter, groups, 1.0, CHUNKED)


def test_checkpointing_with_shared_prompts_needs_the_cache_switch(tiny_folder, monkeypatch):
    """Before transformers 5.15.0 a checkpointed decoder layer has no _can_checkpoint_with_cache
    and drops its cache argument: the completion pass would silently attend to its own tokens
    only. That is an error that names the fix (pre-flight's check: test_preflight.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).train()
    ids, attention, _, prompt_lens, groups = grouped_rows(model.config.vocab_size)

    def old_call(layer, *args, **kwargs):  # transformers 5.14.1: checkpointing drops the cache
        if layer.gradient_checkpointing and layer.training:
            kwargs["past_key_values"] = None
            forward = functools.partial(torch.nn.Module.__call__, layer, **kwargs)
            return layer._gradient_checkpointing_func(forward, *args)
        return torch.nn.Module.__call__(layer, *args, **kwargs)

    # the layer class of transformers 5.14.1
    monkeypatch.delattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", old_call)
    # no checkpointing: the switch is not needed
    shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 1.0, CHUNKED)
    model.gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match=r">= 5.15.0.*LlamaDecoderLayer cannot keep its cache"):
        shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 1.0, CHUNKED)
    monkeypatch.undo()
    with checkpoint_with_cache(model):  # the switch is there: set on every layer while open
        assert all(layer._can_checkpoint_with_cache for layer in model.model.layers)
    assert not any("_can_checkpoint_with_cache" in vars(layer) for layer in model.model.layers)


def run(out_dir, *args):
    """grpo.py on the tiny config in a subprocess."""
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--config",
           os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={out_dir}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_shared_prompt_and_fused_logprobs_give_the_plain_runs_numbers(tmp_path):
    """The same fixed-seed run with each prompt computed once and the fused head, and on the plain
    path (padded rows, log_softmax of the full logits): every logged figure but the positions
    computed (and pad_frac, their padding) agrees to fp32 rounding."""
    args = ["--engine=hf", "--dtype=float32", "--max_steps=2", "--beta=0.02", "--num_iterations=2",
            "--eval_every=0", "--micro_batch_tokens=192"]
    a = run(tmp_path / "plain", *args, "--shared_prompt=false", "--fused_logprobs=false",
            "--chunked_logprobs=false")
    b = run(tmp_path / "shared", *args, "--shared_prompt=true", "--fused_logprobs=true")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and y["tokens_computed"] < x["tokens_computed"]
        for key in ("reward", "loss", "grad_norm", "kl", "entropy", "approx_kl_old",
                    "sampler_logprob_diff_mean"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


# ---------------------------------------------------------------- on a CPU


def test_grouped_heads_on_cpu_give_transformers_sdpa_numbers():
    """sdpa_gqa_attention (grouped key/value heads handed to the kernel as they are) gives
    transformers' sdpa (heads copied first) logprobs, entropies and gradients to 1e-5, padded and
    with each prompt once, and the same logits when decoding left-padded prompts from a cache (the
    HF engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # head_dim 32, two query heads on each key/value head
    shape = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain, grouped = LlamaForCausalLM(LlamaConfig(**shape)), LlamaForCausalLM(LlamaConfig(**shape))
    grouped.load_state_dict(plain.state_dict())
    cpu.grouped_heads(grouped)
    kinds = plain.config._attn_implementation, grouped.config._attn_implementation
    assert kinds == ("sdpa", "sdpa_gqa")
    ids, attention, mask, prompt_lens, groups = grouped_rows(64)

    def padded(model):
        return lambda: sequence_logprobs(model, ids, 0.7, CHUNKED, attention_mask=attention)

    def shared():
        return shared_prompt_logprobs(grouped, ids, attention, prompt_lens, groups, 0.7, CHUNKED)

    want = values_and_grads(plain, padded(plain), mask)
    for forward in (padded(grouped), shared):
        assert_same(values_and_grads(grouped, forward, mask), want)
    prompts = torch.tensor([[0, 0, 5, 9, 3], [7, 1, 2, 8, 4]])  # the first left-padded
    prompt_mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    decoded = [model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=4,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0) for model in (plain, grouped)]
    assert torch.equal(decoded[0].sequences, decoded[1].sequences)
    pairs = zip(decoded[0].logits, decoded[1].logits)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("keep", [True, False])
def test_freed_memory_stays_in_a_cpu_run(tmp_path, keep):
    """After prepare_run on a CPU a freed 65 MB block serves the next 64 MB one with no page
    faults; in a process that did not call it, glibc maps each such block afresh and every page is
    faulted in again (ru_minflt counts them). keep=False runs no project code: it is the control,
    showing that the count catches a process that does not keep its freed memory."""
    prepare = f"""prepare.prepare_run(["--config", "config/tiny.py", "--out_dir={tmp_path}",
                  "--device=cpu"])"""
    code = f"""
import resource, torch
from run import prepare
{prepare if keep else ""}
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(2**24 + 2**18)  # 65 MB, every page touched, then freed
del x  # (1 MB to spare: a small allocation may take a piece of the freed block first)
before = faults()
y = torch.ones(2**24)
print(faults() - before)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    faults, pages = int(proc.stdout.split()[-1]), 2**26 // os.sysconf("SC_PAGE_SIZE")
    assert faults < pages // 10 if keep else faults > pages * 9 // 10


def test_a_bf16_run_on_a_cpu_caps_onednns_kernel_cache(tmp_path):
    """In bf16 oneDNN keeps a kernel with its own buffers per matrix shape (up to 1024): prepare_run
    caps the cache before any bf16 compute, in fp32 leaves it alone, and a capacity already in the
    environment stays."""
    code = f"""
import os
from perf import cpu
from run import prepare
def run(name, dtype):
    prepare.prepare_run(["--config", "config/tiny.py", "--out_dir={tmp_path}/" + name,
                      "--device=cpu", "--dtype=" + dtype])
    return os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
found = [run("fp32", "float32"), run("bf16", "bfloat16") == str(cpu.KERNEL_CACHE)]
os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "100"
print("capacities:", *found, run("mine", "bfloat16"))
"""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = proc.stdout.split("capacities:")[-1].split()
    assert found == ["None", "True", "100"], proc.stdout
