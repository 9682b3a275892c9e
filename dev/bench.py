"""Where every second of a GRPO step goes, and what the update costs in memory (M1).

    python -m dev.bench               # the default CPU run, both engines, 3 timed steps each
    python -m dev.bench --config config/tiny.py --steps 10 --engines hf
    python -m dev.bench --memory      # update peak vs one plain forward+backward, same micro-batch
    # reference + update with/without shared prompts, tail runs, fused logprobs
    python -m dev.bench --passes run
    # O4: padded vs packed
    python -m dev.bench --packing countdown --config config/tiny.py --micro_batch_tokens=8192
    # the update alone, FSDP2
    torchrun --nproc_per_node=1 -m dev.bench --update --config config/countdown_3b.py

Phases: each engine runs grpo.py in a subprocess (eval and checkpoints off) for warmup + steps + 1
steps; the warm-up steps and the last one (which holds the final eval and save) are dropped, and
the per-phase seconds that every step logs to metrics.jsonl are summarised. Overhead is the step
time minus generation and the passes an update must run (reference, old, update).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from infra.log import PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def run_engine(engine, config, overrides, steps, warmup):
    """Per-step metrics of the timed steps of one engine."""
    with tempfile.TemporaryDirectory() as out:
        # the final eval is not timed
        cmd = [sys.executable, os.path.join(ROOT, "grpo.py"),
               *(["--config", config] if config else []),
               f"--out_dir={out}", f"--engine={engine}", f"--max_steps={warmup + steps + 1}",
               "--eval_every=0", "--save_every=0", "--sample_every=0", "--test_size=4", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{engine} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows[warmup:-1]


def summarise(engine, rows):
    """Print the phase table and return the JSON summary."""
    step = statistics.median(r["time/step"] for r in rows)
    print(f"\n{engine}: {len(rows)} timed steps, median {step:.2f} s a step")
    print(f"{'phase':12s} {'median s':>9s} {'share':>7s}")
    out = {"engine": engine, "step_s": step}
    for phase in PHASES:
        seconds = statistics.median(r.get(f"time/{phase}", 0.0) for r in rows)
        out[f"{phase}_s"] = seconds
        print(f"{phase:12s} {seconds:9.3f} {seconds / step:7.1%}")
    overhead = statistics.median(r["time/step"] - r["time/generate"] - r["time/ref"] - r["time/old"]
                                 - r["time/update"] for r in rows)
    out["overhead_s"], out["overhead_share"] = overhead, overhead / step
    out["gen_tokens_per_s"] = (sum(r["gen_tokens"] for r in rows)
                               / sum(r["time/generate"] for r in rows))
    out["train_tokens_per_s"] = sum(r["tokens"] for r in rows) / sum(r["time/update"] for r in rows)
    out["peak_memory_gb"] = max(r["mem/peak_gb"] for r in rows)
    print(f"{'overhead':12s} {overhead:9.3f} {overhead / step:7.1%}   (step - generate - ref - old "
          "- update)")
    print(f"generation {out['gen_tokens_per_s']:.0f} tokens/s | update "
          f"{out['train_tokens_per_s']:.0f} tokens/s | peak memory {out['peak_memory_gb']:.2f} GB")
    return out


def peak_of(fn, device):
    """Extra peak memory (GB) while fn runs: CUDA allocations, or the resident set on a CPU
    (Linux)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    def status(key):
        with open("/proc/self/status") as f:
            # KiB -> GiB
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 2**20

    import ctypes

    # From here on the resident set follows the live tensors: every block of 1 MB or more gets its
    # own mapping, returned to the kernel when freed, and the heap's free top is trimmed. (glibc's
    # default raises its mapping threshold as blocks are freed and keeps what it frees, so its peak
    # depends on what ran before.) The setting stays: time nothing after a peak.
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # malloc.h
    libc.mallopt(M_MMAP_MAX, 65536)
    libc.mallopt(M_MMAP_THRESHOLD, 2**20)
    libc.mallopt(M_TRIM_THRESHOLD, 2**20)
    libc.malloc_trim(0)  # hand freed memory back first, so the allocator's cache is not the base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


def memory(argv, vocab=0):
    """Peak memory of our update on one full micro-batch against a plain HF forward+backward; with
    `vocab`, on a random-weight model of the config's shape with that vocabulary (151936:
    Qwen2.5's)."""
    import dataclasses

    import torch

    from config import config_from_argv
    from loss import grpo_loss
    from model import load_policy, model_path, sequence_logprobs

    cfg = config_from_argv(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if vocab:
        from transformers import LlamaConfig, LlamaForCausalLM

        from infra.memory import SHAPES

        torch.manual_seed(0)
        shape = {**SHAPES[cfg.model], "vocab_size": vocab}
        policy = LlamaForCausalLM(LlamaConfig(**shape)).to(device)
        if cfg.gradient_checkpointing:  # as load_policy does
            policy.gradient_checkpointing_enable()
    else:
        _, policy = load_policy(cfg, model_path(cfg), device)
    L = min(cfg.micro_batch_tokens, cfg.max_prompt_len + cfg.max_completion_len)
    B = cfg.micro_batch_tokens // L
    ids = torch.randint(0, policy.config.vocab_size, (B, L), device=device)
    attention, mask = torch.ones_like(ids), torch.ones(B, L - 1, device=device)
    mask[:, : L // 2] = 0  # the prompt half gets no loss

    def plain():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            loss = policy(input_ids=ids, attention_mask=attention, labels=ids).loss
        loss.backward()
        policy.zero_grad(set_to_none=True)

    def update(naive, fused=False):
        # naive: what most GRPO code does, a full fp32 log_softmax over (B, T, V) kept for backward
        vcfg = dataclasses.replace(cfg, fused_logprobs=fused, chunked_logprobs=not naive)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            lp, entropy = sequence_logprobs(policy, ids, cfg.temperature, vcfg,
                                            attention_mask=attention)
        loss, _ = grpo_loss(lp, lp.detach(), torch.randn(B, device=device), mask, cfg,
                            ref_logprobs=lp.detach(),
                            beta=cfg.beta, entropy=entropy)
        loss.backward()
        policy.zero_grad(set_to_none=True)

    plain(), update(False), update(True), update(False, fused=True)  # warm the allocator
    plain_gb = min(peak_of(plain, device) for _ in range(2))
    ours_gb = min(peak_of(lambda: update(False), device) for _ in range(2))
    fused_gb = min(peak_of(lambda: update(False, fused=True), device) for _ in range(2))
    naive_gb = min(peak_of(lambda: update(True), device) for _ in range(2))
    print(f"micro-batch {B} x {L} tokens, vocabulary {policy.config.vocab_size}, gradient "
          f"checkpointing {policy.is_gradient_checkpointing}, on {device}: plain HF "
          f"forward+backward {plain_gb:.3f} GB | GRPO update {ours_gb:.3f} GB "
          f"({ours_gb / plain_gb:.2f}x) | with fused_logprobs {fused_gb:.3f} GB "
          f"({fused_gb / plain_gb:.2f}x; {fused_gb / ours_gb:.2f}x the update's) | with a full "
          f"fp32 log_softmax {naive_gb:.3f} GB ({naive_gb / plain_gb:.2f}x)")
    print(json.dumps({"micro_batch": [B, L], "vocab": policy.config.vocab_size,
                      "gradient_checkpointing": policy.is_gradient_checkpointing,
                      "plain_gb": plain_gb,
                      "grpo_update_gb": ours_gb, "fused_logprobs_gb": fused_gb,
                      "naive_log_softmax_gb": naive_gb, "ratio": ours_gb / plain_gb}))


# (name, shared_prompt, tail_runs, fused_logprobs); the first is the plain padded path
PASS_VARIANTS = [
    ("padded rows, full logits", False, False, False),
    ("padded rows, fused logprobs", False, False, True),
    ("shared prompt, one run, full logits", True, False, False),
    ("shared prompt, tail runs, full logits", True, True, False),
    ("shared prompt, tail runs, fused", True, True, True),
]


def synthetic_batch(cfg, tokenizer, prompt_lens, completion_lens, seed=0):
    """Rollouts of random tokens with the given lengths, G rows per prompt sharing it
    (what prepare_update takes)."""
    import random

    import torch

    from rollout import Completion, Rollouts

    rng = random.Random(seed)
    V, G = len(tokenizer), cfg.group_size
    completions = []
    for g, P in enumerate(prompt_lens):
        prompt = [rng.randrange(V) for _ in range(P)]
        for C in completion_lens[g * G : (g + 1) * G]:
            completions.append(Completion(prompt, [rng.randrange(V) for _ in range(C)], "",
                                          [0.0] * C, False))
    n = len(completions)
    lengths = torch.tensor([len(c.completion_ids) for c in completions])
    return Rollouts(problem=list(range(n)), completions=completions, rewards=torch.zeros(n),
                    components={},
                    lengths=lengths, truncated=torch.zeros(n), tool_calls=torch.zeros(n),
                    tool_errors=torch.zeros(n), tool_tokens=torch.zeros(n))


def batch_shape(cfg, tokenizer, shape):
    """Prompt lengths (one per group) and completion lengths (one per row) of a benchmark batch.
    "run": the config's task prompts, completions of 1..max_completion_len tokens; "countdown":
    prompts of 130-170 and completions of 300-1000 tokens (a Countdown run's)."""
    import random

    from episodes.task import load_problems, load_task, tokenize_prompts

    rng, n_prompts = random.Random(0), cfg.batch_size // cfg.group_size
    if shape == "run":
        task = load_task(cfg)
        problems = load_problems(cfg, task, "train")[:n_prompts]
        prompt_lens = [len(p) for p in tokenize_prompts(tokenizer, task, problems,
                                                        cfg.max_prompt_len)]
        return prompt_lens, [rng.randint(1, cfg.max_completion_len) for _ in range(cfg.batch_size)]
    return ([rng.randint(130, 170) for _ in range(n_prompts)],
            [rng.randint(300, 1000) for _ in range(cfg.batch_size)])


def passes(argv, shape, repeats):
    """Reference pass and update (forward + backward) seconds, positions computed and peak memory,
    for each PASS_VARIANTS on one batch, side by side in this process. shape "run": the config's
    model and task prompts, completions of 1..max_completion_len tokens; "countdown": the tiny model
    (or the config's), prompts of ~150 and completions of 300-1000 tokens."""
    import dataclasses

    import torch

    from config import config_from_argv
    from grpo import Passes, accumulate_gradients, batch_logprobs, prepare_update
    from model import load_policy, model_path
    from perf.cpu import cap_kernel_cache, keep_freed_memory

    cfg = config_from_argv(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # times as the trainer's (prepare.prepare_run)
        keep_freed_memory()
    if device == "cpu" and cfg.dtype == "bfloat16":
        cap_kernel_cache()
    tokenizer, policy = load_policy(cfg, model_path(cfg), device)
    policy.train()
    prompt_lens, completion_lens = batch_shape(cfg, tokenizer, shape)
    batch = synthetic_batch(cfg, tokenizer, prompt_lens, completion_lens)
    advantages = torch.randn(len(batch))
    state = dataclasses.make_dataclass("State", [("beta", float)])(cfg.beta)
    print(f"{len(prompt_lens)} prompts x {cfg.group_size}: prompts "
          f"{min(prompt_lens)}-{max(prompt_lens)} tokens, completions "
          f"{min(completion_lens)}-{max(completion_lens)}, micro_batch_tokens "
          f"{cfg.micro_batch_tokens}, {cfg.dtype}, {device}")
    results, updates = [], []
    for name, shared, runs, fused in PASS_VARIANTS:
        vcfg = dataclasses.replace(cfg, shared_prompt=shared, tail_runs=runs, fused_logprobs=fused)
        ub = prepare_update(batch, advantages, vcfg, tokenizer.pad_token_id, device)

        def ref_pass():
            batch_logprobs(policy, ub, vcfg, cfg.temperature)

        ref = batch_logprobs(policy, ub, vcfg, cfg.temperature)[0] - 0.01  # a KL term to compute

        # this variant's, bound now: its peak is taken after the loop
        def update(ub=ub, ref=ref, vcfg=vcfg):
            accumulate_gradients(policy, ub, ub.minis[0], Passes(ref=ref), vcfg, cfg.temperature,
                                 state, {}, None, "")
            policy.zero_grad(set_to_none=True)

        if not results:  # warm the allocator once
            ref_pass(), update()
        ref_s = min(_seconds(ref_pass, device) for _ in range(repeats))
        update_s = min(_seconds(update, device) for _ in range(repeats))
        updates.append(update)
        results.append({"variant": name, "tokens": int(ub.tokens),
                        "tokens_computed": int(ub.computed),
                        "pad_frac": 1 - ub.computed_real / ub.computed, "ref_s": ref_s,
                        "update_s": update_s, "micro_batches": len(ub.micro)})
    # after all the timing: on a CPU peak_of changes the allocator's setting
    for r, update in zip(results, updates):
        r["update_peak_gb"] = peak_of(update, device)
    base = results[0]
    print(f"{'variant':38s} {'computed':>9s} {'pad':>6s} {'ref s':>7s} {'update s':>9s} "
          f"{'ref+upd':>8s} {'peak GB':>8s} {'peak':>6s}")
    for r in results:
        total = (r["ref_s"] + r["update_s"]) / (base["ref_s"] + base["update_s"])
        print(f"{r['variant']:38s} {r['tokens_computed']:9d} {r['pad_frac']:6.1%} "
              f"{r['ref_s']:7.2f} {r['update_s']:9.2f} {total:7.2f}x {r['update_peak_gb']:8.3f} "
              f"{r['update_peak_gb'] / base['update_peak_gb']:5.2f}x")
    print(json.dumps(results))
    return results


def packed_logprobs(model, ids, attention, temperature):
    """O4, padding-free packing: sequence_logprobs of right-padded rows, computed as one (1, T)
    sequence of their real tokens with positions restarting at each row. transformers
    (masking_utils) reads the restarts from position_ids and keeps attention within each row for
    every attention implementation: flash_attention_2 as variable-length sequences, sdpa and eager
    as a dense (T, T) block-diagonal mask. Returns (b, L-1) each."""
    import torch

    from perf.logprobs import logprobs_and_entropy

    lengths = attention.sum(1).tolist()
    flat = torch.cat([ids[r, :n] for r, n in enumerate(lengths)])[None]  # (1, T)
    positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]
    # no attention_mask and no cache: then transformers reads the restarts as the mask
    # (with a cache it does not)
    logits = model(input_ids=flat, position_ids=positions, use_cache=False).logits
    # (1, T-1); row ends are unused
    lp, entropy = logprobs_and_entropy(logits[:, :-1], flat[:, 1:], temperature)
    # (b,) each row's first flat position
    starts = torch.tensor([0] + lengths[:-1], device=ids.device).cumsum(0)
    cols = torch.arange(ids.shape[1] - 1, device=ids.device)
    # (b, L-1) flat position of each row's column
    index = (starts[:, None] + cols).clamp(max=flat.shape[1] - 2)
    real = cols < (attention.sum(1) - 1)[:, None]
    return tuple(torch.where(real, v[0][index], 0.0) for v in (lp, entropy))


def packing(argv, shape, repeats):
    """O4 measured: forward + backward of the padded rows' micro-batches (longest first under the
    token budget) against the same micro-batches packed into one sequence each (packed_logprobs), on
    one batch; prints positions computed, padding, seconds and the largest logprob difference."""
    import dataclasses

    import torch

    from config import config_from_argv
    from grpo import prepare_update
    from model import load_policy, model_path, sequence_logprobs

    cfg = dataclasses.replace(config_from_argv(argv), shared_prompt=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer, policy = load_policy(cfg, model_path(cfg), device)
    policy.train()
    batch = synthetic_batch(cfg, tokenizer, *batch_shape(cfg, tokenizer, shape))
    ub = prepare_update(batch, torch.randn(len(batch)), cfg, tokenizer.pad_token_id, device)
    weights = ub.mask * ub.advantages[:, None]

    def run(packed):
        lps = []
        for mb in ub.micro:
            L = int(ub.attention[mb].sum(1).max())
            ids, attention = ub.ids[mb, :L], ub.attention[mb, :L]
            if packed:
                lp, _ = packed_logprobs(policy, ids, attention, cfg.temperature)
            else:
                lp, _ = sequence_logprobs(policy, ids, cfg.temperature, cfg,
                                          attention_mask=attention)
            (lp * weights[mb, : L - 1]).sum().backward()
            lps.append((lp * ub.mask[mb, : L - 1]).detach())
        policy.zero_grad(set_to_none=True)
        return lps

    padded, packed = run(False), run(True)  # the warm-up, and the exactness check
    diff = max(float((a - b).abs().max()) for a, b in zip(padded, packed))
    padded_s = min(_seconds(lambda: run(False), device) for _ in range(repeats))
    packed_s = min(_seconds(lambda: run(True), device) for _ in range(repeats))
    real = int(ub.attention.sum())
    result = {"shape": shape, "attn_implementation": policy.config._attn_implementation,
              "micro_batches": len(ub.micro), "padded_positions": int(ub.computed),
              "packed_positions": real,
              "pad_frac": 1 - real / ub.computed, "padded_s": padded_s, "packed_s": packed_s,
              "max_logprob_diff": diff}
    print(f"{len(ub.micro)} micro-batches, {result['attn_implementation']} attention: padded rows "
          f"{int(ub.computed)} positions ({result['pad_frac']:.1%} padding) {padded_s:.2f} s | "
          f"packed {real} positions {packed_s:.2f} s ({packed_s / padded_s:.2f}x) | largest "
          f"logprob difference {diff:.1e}")
    print(json.dumps(result))
    return result


def _seconds(fn, device):
    import time

    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def update_only(argv, steps, warmup, micro_batches):
    """Step time and peak memory of the update alone (micro-batched forward+backward, AdamW step) on
    a random-weight model of the config's shape: no download, no sampler. FSDP2 or DDP under
    torchrun."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from config import config_from_argv
    from grpo import forward_logprobs, optimizer_step
    from infra import parallel
    from infra.memory import SHAPES, estimate_memory
    from loss import grpo_loss

    cfg = config_from_argv(argv)
    rank, world, device = parallel.setup("cuda" if torch.cuda.is_available() else "cpu")
    # a Llama of the same shape: the same matmuls and memory as Qwen2 (bar biases)
    shape = SHAPES[cfg.model]
    torch.manual_seed(0)
    with torch.device(device):
        policy = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=4096)).float()
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    train_model = parallel.wrap(policy, cfg.parallel, cfg.dtype)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.adam_betas)
    L = min(cfg.micro_batch_tokens, cfg.max_prompt_len + cfg.max_completion_len)
    B = cfg.micro_batch_tokens // L
    ids = torch.randint(0, shape["vocab_size"], (B, L), device=device)
    attention, mask = torch.ones_like(ids), torch.ones(B, L - 1, device=device)
    mask[:, : cfg.max_prompt_len] = 0  # no loss on the prompt
    num_tokens = int(parallel.all_sum(mask.sum() * micro_batches))
    times = []
    for step in range(warmup + steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(micro_batches):
            with parallel.no_grad_sync(train_model, last=i == micro_batches - 1):
                lp, entropy = forward_logprobs(train_model, ids, attention, cfg, cfg.temperature)
            # random advantages, and a reference 0.01 nats off so the KL term computes something
            loss, _ = grpo_loss(lp, lp.detach(), torch.randn(B, device=device), mask, cfg,
                                ref_logprobs=lp.detach() - 0.01,
                                beta=cfg.beta, num_tokens=num_tokens,
                                num_seqs=B * micro_batches * world)
            (loss * world).backward()
        optimizer_step(optimizer, trainable, parallel.all_sum(loss.item()), cfg.grad_clip)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[warmup:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    est = estimate_memory(cfg, shape)
    result = {"model_shape": cfg.model, "parallel": cfg.parallel if parallel.launched else "none",
              "world": world, "dtype": cfg.dtype, "micro_batch": [B, L],
              "micro_batches": micro_batches,
              "update_step_s": step_s, "tokens_per_s_per_rank": B * L * micro_batches / step_s,
              "peak_memory_gb": peak,
              "estimated_gb": est["weights"] + est["optimizer"] + est["grads"]
              + est["activations"]}
    if rank == 0:
        print(f"update of {micro_batches} x ({B} x {L}) tokens on {world} rank(s), "
              f"{result['parallel']}, {cfg.dtype}: {step_s:.2f} s, "
              f"{result['tokens_per_s_per_rank']:.0f} tokens/s a rank, peak {peak:.1f} GiB "
              f"(pre-flight estimate {result['estimated_gb']:.1f} GiB without the reference)")
        print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a run file; default: config.py's defaults")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--engines", default="vllm,hf")
    parser.add_argument("--memory", action="store_true",
                        help="measure the update's peak memory instead")
    parser.add_argument("--vocab", type=int, default=0,
                        help="with --memory: a random model with this vocabulary")
    parser.add_argument("--update", action="store_true",
                        help="time the update alone on random weights (torchrun)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="with --update: micro-batches per step")
    parser.add_argument("--passes", choices=["run", "countdown"], default=None,
                        help="time the reference pass and the update with and without shared "
                             "prompts / fused logprobs")
    parser.add_argument("--packing", choices=["run", "countdown"], default=None,
                        help="time padded micro-batches against the same packed into one sequence "
                             "each (O4)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --passes/--packing: timed repeats, fastest kept")
    args, overrides = parser.parse_known_args()
    config_args = (["--config", args.config] if args.config else []) + overrides
    if args.memory:
        return memory(config_args, args.vocab)
    if args.passes:
        return passes(config_args, args.passes, args.repeats)
    if args.packing:
        return packing(config_args, args.packing, args.repeats)
    if args.update:
        return update_only(config_args, args.steps, args.warmup, args.micro_batches)
    results = [summarise(e, run_engine(e, args.config, overrides, args.steps, args.warmup))
               for e in args.engines.split(",")]
    if len(results) == 2:
        ratio = results[0]["gen_tokens_per_s"] / results[1]["gen_tokens_per_s"]
        print(f"\n{results[0]['engine']} generates {ratio:.1f}x the tokens/s of "
              f"{results[1]['engine']}")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
