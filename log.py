"""What a run writes as it goes: the console line, metrics.jsonl, sample dumps, phase times, memory.

One line per step from rank 0 (`step 12 | reward 0.41 | acc 0.22 | ...`); every metric appended to
out_dir/metrics.jsonl; whole groups to out_dir/samples.jsonl every sample_every steps (W6), which
`python task.py --replay` re-scores (W5); wandb and tensorboard only when asked for,
imported lazily.
"""

import dataclasses
import json
import logging
import os
import time
from contextlib import contextmanager

import torch

import parallel

# the phases every step times (time/<phase> in metrics.jsonl): one list for the bench and the plot
PHASES = ["generate", "tools", "score", "push", "sleep", "ref", "old", "update", "checkpoint",
          "eval"]


class HarmlessReloadWarning(logging.Filter):
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every push: rotary caches are buffers
    it computes itself, not weights, and it restores them. Harmless, so it must not read as a
    failure."""

    def filter(self, record):
        return not record.getMessage().endswith("RotaryEmbedding: Failed to load weights")


def quiet_harmless_vllm_warning():
    """Drop vLLM's warning on every weight push that is no failure (HarmlessReloadWarning)."""
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_log.addFilter(HarmlessReloadWarning())


@contextmanager
def timed(times, key):
    """Add the seconds of the with-block to times[key] (the keys are PHASES)."""
    start = time.perf_counter()
    yield
    times[key] = times.get(key, 0.0) + time.perf_counter() - start


def peak_memory_gb():
    """Peak memory so far: CUDA allocations on a GPU, the process's peak resident set on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_gb():
    """GPU memory in use on this device (all processes),
    or this process's resident memory on a CPU."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def dump_samples(cfg, step, batch, advantages, problems, tokenizer):
    """W6: every sample_every steps, a few of rank 0's whole groups to samples.jsonl
    (task.py --replay re-scores)."""
    if not cfg.sample_every or step % cfg.sample_every or parallel.rank() > 0:
        return
    with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
        for r in range(min(cfg.sample_groups * cfg.group_size, len(batch))):
            c = batch.completions[r]
            f.write(json.dumps({
                "step": step, "problem": problems[batch.problem[r]], "completion": c.text,
                "reward": batch.rewards[r].item(), "advantage": advantages[r].item(),
                "length": len(c.completion_ids),
                "completion_ids": c.completion_ids,  # what TRL-style reward functions got (replay)
                "components": {k: v[r].item() for k, v in batch.components.items()},
                **({"turns": turns(c, tokenizer), "tool_errors": c.tool_errors}
                   if c.mask is not None else {})}) + "\n")


def turns(completion, tokenizer):
    """A tool rollout's completion as its turns:
    [["model", text], ["tool", text], ...] from the token mask."""
    out, ids = [], completion.completion_ids
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or completion.mask[t] != completion.mask[start]:
            out.append(["model" if completion.mask[start] else "tool",
                        tokenizer.decode(ids[start:t])])
            start = t
    return out


class Logger:
    """One console line per step, every metric appended to metrics.jsonl,
    wandb/tensorboard on request."""

    def __init__(self, cfg, run_id):
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.wandb = self.tb = None
        if cfg.wandb_project:
            import wandb

            # run_id is kept in every checkpoint, so a resumed run continues the same wandb run
            self.wandb = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg),
                                    resume="allow", id=run_id)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(cfg.out_dir, "tb"))

    def log(self, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        shown = ("reward", "acc", "format", "kl", "response_length", "loss", "grad_norm",
                 "time/step")
        line = " | ".join(f"{k} {metrics[k]:.4g}" for k in shown if metrics.get(k) is not None)
        print(f"step {step} | {line}", flush=True)

