"""What only a GPU shows: SDPA's kernels, the trainer's passes and the fused head on CUDA, one
real-shape 3B update against pre-flight, the vLLM engine on the device.

    pytest -m gpu tests/test_gpu.py

Every test here is marked gpu and takes the device as a parameter: its "cpu" case runs the same
set-up and calls on a CPU, in the default suite too, so the "cuda" case (skipped without CUDA) can
only fail for a reason of the GPU's. What a CPU cannot have (cuDNN, the memory-efficient SDPA
kernel, sleep mode, a 3B model) is skipped there, saying so. The vLLM ones also need vLLM to
import. Each vLLM engine starts in a process of its own (vLLM's parallel state is process-global):
this file run as a script is that process.
"""

import contextlib
import copy
import functools
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import config
from config import load_config
from model import build_tiny, load_policy, sdpa_off_cudnn, self_attending_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
pytestmark = pytest.mark.gpu


def sdpa_with_grads(q, k, v, mask, backends=None):
    """SDPA's output and the gradients of its sum in q, k, v; backends: those allowed, or all."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def all_finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# ---------------------------------------------------------------- SDPA on this GPU


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L", [704, 640])  # 704 % 128 == 64: the shape of the bug; 640 a control
def test_cudnn_sdpa_hazard_is_finite_with_the_projects_setting(L, device):
    """pytorch issue 196678: cuDNN's SDPA backward gives NaN grad_q with a mask, a key length of 64
    mod 128 and rows whose logsumexp is below ln(FLT_MAX) (Qwen2.5's heads). With the trainer's
    setting (model.sdpa_off_cudnn, which load_policy applies on CUDA) all is finite. (A CPU has no
    cuDNN: there the default backend alone runs.)"""
    torch.manual_seed(0)
    D = 64
    q = torch.randn(1, 1, L, D, device=device, dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 1, L, D, device=device, dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 1, L, D, device=device, dtype=torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every score ~ -120: logsumexp < -88.7
    mask = torch.ones(L, L, dtype=torch.bool, device=device).tril()[None, None]
    if device == "cuda":
        try:
            raw = sdpa_with_grads(q, k, v, mask, [SDPBackend.CUDNN_ATTENTION])
            print(f"L={L}: cuDNN alone, non-finite gradients: {not all_finite(*raw[1:])}")
        except RuntimeError as e:  # no cuDNN kernel for this shape: the hazard cannot arise either
            print(f"L={L}: cuDNN alone not run ({str(e).splitlines()[0][:80]})")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        sdpa_off_cudnn(device)
        assert all_finite(*sdpa_with_grads(q, k, v, mask))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["default", "efficient", "math"])
@pytest.mark.parametrize("L", [192, 200])  # 192 % 128 == 64
def test_padding_queries_attending_themselves_are_finite_on_each_sdpa_backend(backend, L, device):
    """A left-padded pass with model.self_attending_mask: no query row is fully masked, so every
    backend the trainer may use gives finite outputs and gradients, and the real rows equal fp32
    math's. Row 1 is left-padded by 3 tokens; head_dim 128 as Qwen2.5-3B's."""
    if device == "cpu" and backend == "efficient":
        pytest.skip("the memory-efficient SDPA kernel is CUDA's; a CPU has none")
    backends = {"default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                "math": [SDPBackend.MATH]}[backend]
    torch.manual_seed(0)
    B, H, D = 2, 4, 128
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16) for _ in range(3))
    valid = torch.ones(B, L, dtype=torch.long, device=device)
    valid[1, :3] = 0
    sdpa_model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    mask = self_attending_mask(sdpa_model, valid)  # (B, 1, L, L) bool
    assert mask.shape == (B, 1, L, L) and bool(mask.any(-1).all())
    sdpa_off_cudnn(device)
    out, gq, gk, gv = sdpa_with_grads(q, k, v, mask, backends)
    assert all_finite(out, gq, gk, gv)
    want = sdpa_with_grads(q.float(), k.float(), v.float(), mask, [SDPBackend.MATH])[0]
    real = valid.bool()[:, None, :, None].expand_as(out)
    assert (out.float() - want)[real].abs().max().item() < 2e-2  # bf16 against fp32


# ---------------------------------------------------------------- the trainer's passes, on CUDA


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("gpu") / "tiny"))


def grouped_rows(vocab, device, seed=0):
    """Right-padded rows of 4 groups of 2: prompts of 5, 7, 2 and 65 tokens (the prompt pass then
    has 64 keys, left-padded), completions of 1-70 tokens; their response mask, prompt lengths and
    groups, on the device."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for P, lengths in [(5, [3, 6]), (7, [1, 4]), (2, [5, 2]), (65, [70, 9])]:
        prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
        rows += [(prompt, torch.randint(0, vocab, (C,), generator=g).tolist()) for C in lengths]
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    attention = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)], attention[i, : len(p) + len(c)] = torch.tensor(p + c), 1
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1
    prompt_lens, groups = torch.tensor([len(p) for p, _ in rows]), torch.arange(len(rows)) // 2
    return [t.to(device) for t in (ids, attention, mask, prompt_lens, groups)]


def values_and_grads(model, fn, mask, bf16):
    """Response-token logprobs and each parameter's gradient of a loss of logprobs and entropy."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(mask.device.type, dtype=torch.bfloat16, enabled=bf16):
        lp, ent = fn()
    weights = torch.linspace(-1, 1, mask.shape[1], device=mask.device)
    ((lp * weights + 0.3 * ent) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (lp * mask).detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prompt_forward_equals_the_padded_rows_on_the_device(tiny_folder, dtype,
                                                                     checkpointing, fused, device):
    """Each prompt once (a left-padded prompt pass, completions on its keys and values) against the
    padded forward, as the trainer runs it on CUDA: equal in fp32 (1e-4), finite and close in bf16
    autocast, with gradient checkpointing and the fused head."""
    from config import Config
    from model import self_attending_mask, sequence_logprobs
    from perf import shared_prompt

    shared_prompt_logprobs = functools.partial(
        shared_prompt.shared_prompt_logprobs, sequence_logprobs=sequence_logprobs,
        self_attending_mask=self_attending_mask)

    overrides = [f"--dtype={dtype}", f"--gradient_checkpointing={checkpointing}"]
    _, model = load_policy(load_config(overrides=overrides), tiny_folder, device)
    model.train()
    ids, attention, mask, prompt_lens, groups = grouped_rows(model.config.vocab_size, device)
    bf16 = dtype == "bfloat16"
    def padded_pass():
        plain = Config(fused_logprobs=False, chunked_logprobs=False)
        return sequence_logprobs(model, ids, 0.7, plain, attention_mask=attention)

    def shared_pass():
        cfg = Config(fused_logprobs=fused)
        return shared_prompt_logprobs(model, ids, attention, prompt_lens, groups, 0.7, cfg)

    padded = values_and_grads(model, padded_pass, mask, bf16)
    shared = values_and_grads(model, shared_pass, mask, bf16)
    assert shared[1].keys() == padded[1].keys() and len(padded[1]) > 0
    assert all_finite(shared[0], *shared[1].values())
    lp_err = (shared[0] - padded[0]).abs().max().item()
    grad_err = max((shared[1][n] - g).abs().max().item() for n, g in padded[1].items())
    print(f"{device} {dtype} checkpointing={checkpointing} fused={fused}: "
          f"logprob diff {lp_err:.1e}, grad diff {grad_err:.1e}")
    if bf16:
        assert ((shared[0] - padded[0]).abs().sum() / mask.sum()).item() < 0.05
    else:
        assert lp_err < 1e-4 and grad_err < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_hf_engine_prefill_of_left_padded_prompts_on_the_device(tiny_folder, device):
    """The HF engine in bf16 on the device: prompts of 3 and 65 tokens decoded in one left-padded
    batch give finite logprobs within the bf16 parity bound of the trainer's."""
    from grpo import forward_logprobs, pad_batch
    from rollout import HFEngine

    cfg = load_config(overrides=["--dtype=bfloat16"])
    tokenizer, policy = load_policy(cfg, tiny_folder, device)
    prompts = [[5, 17, 42], list(range(10, 75))]
    groups = HFEngine(policy, tokenizer, dtype="bfloat16").generate(
        prompts, 3, seeds=list(range(6)), temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16)
    rows = [c for g in groups for c in g]
    assert all(c.logprobs and all(math.isfinite(x) for x in c.logprobs) for c in rows)
    padded = pad_batch(rows, tokenizer.pad_token_id)
    ids, attention, mask, sampler_lp = (t.to(device) for t in padded)
    with torch.no_grad():
        lp, _ = forward_logprobs(policy, ids, attention, cfg, 1.0)
    gap = ((lp - sampler_lp).abs() * mask).sum().item() / mask.sum().item()
    assert gap < config.PARITY_WARN[cfg.dtype]


def weight_sized_tensors_made(fn, numel):
    """New tensors of at least `numel` elements that the ops run by fn() make (not views, in-place
    or out= results)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = not (func.is_view or func._schema.name.endswith("_") or "out" in (kwargs or {}))
            made.extend(t for t in (out if isinstance(out, (tuple, list)) else [out])
                        if fresh and isinstance(t, torch.Tensor) and t.numel() >= numel)
            return out

    with Count():
        fn()
    return len(made)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_head_on_cuda_sums_the_weight_gradient_in_place(monkeypatch, device):
    """On CUDA the fused head takes 2^27-logit chunks, and under bf16 autocast cuBLAS adds each
    chunk's bf16 product into the fp32 weight gradient (addmm with out_dtype): the same two (V, H)
    tensors (the bf16 weight copy and the gradient) for 1 chunk as for 6, and the gradient is the
    bf16 operands' product summed in fp32 (summing in bf16 would be ~3e-3 off, rounding each
    chunk's product to bf16 ~2e-3, in relative norm). A CPU widens each chunk's bf16 operands to
    fp32 instead (no mixed-dtype addmm there), with the same two weight-sized tensors."""
    from infra.memory import head_chunk
    from perf import logprobs
    from perf.logprobs import linear_logprobs_and_entropy

    torch.manual_seed(0)
    V, H, N = 8192, 2048, 1200  # a chunk's (N, V) buffers stay smaller than (V, H)
    hidden = torch.randn(1, N, H, device=device)
    weight = (torch.randn(V, H, device=device) * 0.05).requires_grad_()
    tokens = torch.randint(0, V, (1, N), device=device)
    h = hidden[0].bfloat16()
    p = torch.softmax((h @ weight.detach().bfloat16().T).float(), -1)  # bf16 logits, as the head's
    want = (F.one_hot(tokens[0], V) - p).bfloat16().float().T @ h.float()  # d sum(log p) / dW
    chunks = []
    apply = logprobs._LinearLogprobsEntropy.apply
    spy = lambda *args: chunks.append(args[5]) or apply(*args)  # noqa: E731
    monkeypatch.setattr(logprobs._LinearLogprobsEntropy, "apply", spy)
    for chunk in (None, N // 6):
        weight.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            lp, _ = linear_logprobs_and_entropy(hidden, weight, tokens, chunk=chunk)
        assert weight_sized_tensors_made(lambda: lp.sum().backward(), V * H) == 2
        assert ((weight.grad - want).norm() / want.norm()).item() < 2e-4
    assert chunks == [head_chunk(device, V), N // 6]
    if device == "cuda":
        assert chunks[0] == 2**27 // V


# ---------------------------------------------------------------- one real-shape update

# on a CPU the same set-up and update at a size it holds: Qwen2.5-3B's layout, one narrow layer
CPU_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("device", DEVICES)
def test_3b_update_time_and_peak_memory_against_preflight(device):
    """One countdown_3b update as `python grpo.py --config config/countdown_3b.py` runs it on one
    GPU, on random weights of Qwen2.5-3B's shape: fp32 policy and reference, bf16 autocast,
    checkpointing, the fused head, shared prompts, AdamW; a Countdown-shaped batch. Two steps (the
    second with AdamW's moments): finite, and on the GPU the peak within pre-flight's estimate.
    The CPU case runs the same calls on a narrow one-layer model and 16 completions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dev.bench import batch_shape, synthetic_batch
    from grpo import Passes, accumulate_gradients, batch_logprobs, optimizer_step, prepare_update
    from infra.memory import SHAPES, estimate_memory, update_peak

    on_gpu = device == "cuda"
    run_file = os.path.join(ROOT, "config", "countdown_3b.py")
    cfg = load_config(run_file, [] if on_gpu else ["--batch_size=16"])
    shape = SHAPES[cfg.model] if on_gpu else {**SHAPES[cfg.model], **CPU_SHAPE}
    estimate = update_peak(estimate_memory(cfg, shape))
    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        if total < estimate + 2:
            pytest.skip(f"pre-flight's {estimate:.0f} GiB does not fit this {total:.0f} GiB GPU")
    sdpa_off_cudnn(device)  # as load_policy does
    torch.manual_seed(0)
    with torch.device(device):  # qkv biases, as Qwen2.5's; the shape names its context length
        policy = Qwen2ForCausalLM(Qwen2Config(**shape)).float()
    policy.gradient_checkpointing_enable()
    policy.config.use_cache = False
    policy.train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)  # fp32 on the device (build_models)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas,
                                  weight_decay=cfg.weight_decay)
    prompt_lens, completion_lens = batch_shape(cfg, None, "countdown")
    batch = synthetic_batch(cfg, range(shape["vocab_size"]), prompt_lens, completion_lens)
    ub = prepare_update(batch, torch.randn(len(batch)), cfg, 0, device)
    state = SimpleNamespace(beta=cfg.beta)
    peaks = []
    for step in range(2):
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        passes = Passes(ref=batch_logprobs(ref, ub, cfg, cfg.temperature)[0])
        loss = accumulate_gradients(policy, ub, ub.minis[0], passes, cfg, cfg.temperature, state,
                                    {}, None, "")
        grad_norm, stepped = optimizer_step(optimizer, params, loss, cfg.grad_clip)
        if on_gpu:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        print(f"{device} step {step}: {time.perf_counter() - start:.1f} s, loss {loss:.4g}, "
              f"grad_norm {float(grad_norm):.4g}, peak {peaks[-1] if peaks else 0:.1f} GiB "
              f"allocated (pre-flight {estimate:.1f} GiB; {int(ub.tokens)} tokens, "
              f"{len(ub.micro)} micro-batches)")
        assert stepped and math.isfinite(loss) and math.isfinite(float(grad_norm))
    del policy, ref, optimizer, params, passes, ub
    if on_gpu:
        torch.cuda.empty_cache()  # for the vLLM engines' processes after this test
        assert max(peaks) <= estimate  # pre-flight is not low
        assert max(peaks) > 0.8 * estimate  # nor far too high


# ---------------------------------------------------------------- vLLM on the device


def vllm_on_the_device(folder, level, out, device):
    """Run as a script (one engine per process): a VLLMEngine at sleep level `level`, woken, pushed
    the policy's weights, sampled; put to sleep; the policy perturbed and pushed between the two
    wakes; sampled again. Writes the trainer's parity gaps and the samples as JSON to `out`. bf16 on
    a GPU; fp32 on a CPU (any CPU runs it; there sleep is a no-op and a call is seeded from its
    first row's seed, perf.cpu.seed_vllm)."""
    from grpo import forward_logprobs, pad_batch
    from model import push_weights_iter
    from rollout import VLLMEngine

    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = load_config(overrides=["--model=tiny", f"--dtype={dtype}", f"--vllm_sleep_level={level}",
                                 "--gpu_memory_utilization=0.2", "--max_prompt_len=64",
                                 "--max_completion_len=24", "--seed=0"])
    tokenizer, policy = load_policy(cfg, folder, device)
    texts = ("Write only digits, like 4 2 7:", "<think> 1 + 2")
    prompts = [tokenizer(text).input_ids for text in texts]

    def sample(first_seed, temperature=1.0):  # greedy: one completion a prompt (vLLM's rule)
        n = 4 if temperature else 1
        seeds = list(range(first_seed, first_seed + n * len(prompts)))  # one per row
        return engine.generate(prompts, n, seeds=seeds, temperature=temperature, top_p=1.0,
                               top_k=-1, max_tokens=24)

    def gap(groups):  # mean |sampler logprob - trainer logprob| over the sampled tokens
        rows = [c for g in groups for c in g]
        padded = pad_batch(rows, tokenizer.pad_token_id)
        ids, attention, mask, sampler_lp = (t.to(device) for t in padded)
        with torch.no_grad():
            lp, _ = forward_logprobs(policy, ids, attention, cfg, 1.0)
        return ((lp - sampler_lp).abs() * mask).sum().item() / mask.sum().item()

    def ids(groups):
        return [[c.completion_ids for c in g] for g in groups]

    engine = VLLMEngine(folder, cfg, device)
    engine.wake(push_weights_iter(policy))
    first = sample(0)
    result = {"gap_first": gap(first), "bound": config.PARITY_WARN[cfg.dtype],
              "seeds_0": ids(first), "seeds_0_again": ids(sample(0)), "seeds_100": ids(sample(100)),
              "greedy_first": ids(sample(0, 0.0))}
    on_gpu = device == "cuda"
    awake = torch.cuda.mem_get_info()[0] if on_gpu else 0
    engine.sleep()
    result["freed_gib"] = (torch.cuda.mem_get_info()[0] - awake) / 2**30 if on_gpu else 0.0
    with torch.no_grad():  # a new policy, pushed between the two wakes
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    result["gap_stale"] = gap(first)  # the first samples against the new policy: the check can fail
    engine.wake(push_weights_iter(policy))
    second = sample(0)
    result.update(gap_second=gap(second), greedy_second=ids(sample(0, 0.0)))
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module", params=DEVICES)
def vllm_runs(request, tiny_folder, tmp_path_factory):
    """vllm_on_the_device at sleep levels 0, 1 and 2 on a GPU (0 alone on a CPU, which has no sleep
    mode), each in its own process; (device, their results by level)."""
    pytest.importorskip("vllm")
    device = request.param
    if device == "cuda":
        torch.cuda.empty_cache()  # what this process's allocator keeps, the engines can use
    out = tmp_path_factory.mktemp(f"vllm_{device}")
    runs = {}
    for level in (0, 1, 2) if device == "cuda" else (0,):
        path = out / f"level{level}.json"
        cmd = [sys.executable, os.path.abspath(__file__), tiny_folder, str(level), str(path),
               device]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[level] = json.loads(path.read_text())
    return device, runs


@pytest.mark.parametrize("level", [0, 1, 2])
def test_vllm_sleep_level_wake_push_wake(vllm_runs, level):
    """R1 + R2 on the device: after sleep (level 1 offloads the weights, 2 drops them) the weights
    pushed between waking the weights and waking the KV cache are the ones that sample."""
    device, runs = vllm_runs
    if level not in runs:
        pytest.skip(f"sleep level {level} needs a GPU: vLLM on a CPU has no sleep mode")
    run = runs[level]
    bound = run["bound"]
    assert run["gap_first"] < bound and run["gap_second"] < bound  # the trainer's own weights
    assert run["gap_stale"] > 3 * bound  # against weights it does not hold, the gap shows
    assert run["greedy_second"] != run["greedy_first"]
    if level > 0:  # asleep, the KV cache (and at level 2 the weights) went back to the GPU
        assert run["freed_gib"] > 1.0


def test_vllm_per_request_seeds_are_reproducible(vllm_runs):
    """Each row's sampling follows its seed: the same seeds give the same samples, other seeds
    other samples, whatever ran in between (on a GPU each request carries its seed; on a CPU the
    call is seeded from its first row's)."""
    _, runs = vllm_runs
    run = runs[0]
    assert run["seeds_0"] == run["seeds_0_again"]
    assert run["seeds_0"] != run["seeds_100"]


if __name__ == "__main__":  # python tests/test_gpu.py FOLDER LEVEL OUT DEVICE: one engine's process
    vllm_on_the_device(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
