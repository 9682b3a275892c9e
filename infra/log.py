"""What a run writes as it goes: the console line, metrics.jsonl, sample dumps, phase times, memory.

One line per step from rank 0 (`step 12 | reward 0.41 | acc 0.22 | ...`); every metric appended to
out_dir/metrics.jsonl; whole groups to out_dir/samples.jsonl every sample_every steps (W6), which
`python -m episodes.task --replay` re-scores (W5); wandb and tensorboard only when report_to names
them, imported lazily.
"""

import dataclasses
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

import torch

from config import PARITY_WARN, reporters
from infra import parallel

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


@contextmanager
def output_to(path):
    """Inside the block, what this process writes to stdout and stderr goes to the file `path`:
    the file descriptors, so C++ warnings and the libraries' own loggers and progress bars go too
    (vLLM's start-up: Triton, NUMA, thread binding, none of it actionable in a run). On an error the
    file's end is printed before the error propagates: nothing that explains it is lost."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    ok = False
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    if not ok:
        with open(path, errors="replace") as f:
            print(f"--- the end of {path}:\n{f.read()[-4000:]}", file=sys.stderr)


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
    """W6 (every sample_every steps): a few of rank 0's whole groups to samples.jsonl
    (python -m episodes.task --replay re-scores)."""
    if parallel.rank() > 0:
        return
    with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
        for r in range(min(cfg.sample_groups * cfg.group_size, len(batch))):
            c = batch.completions[r]
            f.write(json.dumps({
                "step": step, "problem": problems[batch.problem[r]], "completion": c.text,
                "reward": batch.rewards[r].item(), "advantage": advantages[r].item(),
                "length": len(c.completion_ids),
                "completion_ids": c.completion_ids,  # what TRL-style reward functions got (replay)
                # R8: the weights it was sampled with, in updates
                **({"policy_version": batch.policy_version}
                   if batch.policy_version is not None else {}),
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
        self.max_steps = cfg.max_steps
        self.step_seconds = []  # this process's steps, for the time left
        self.started = time.perf_counter()  # the run summary's wall time
        self.wandb = self.tb = None
        loggers = reporters(cfg.report_to)
        if "wandb" in loggers:
            import wandb

            # the project is named by WANDB_PROJECT, as under TRL; run_id is kept in every
            # checkpoint, so a resumed run continues the same wandb run
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo"), id=run_id,
                                    config=dataclasses.asdict(cfg), resume="allow")
        if "tensorboard" in loggers:
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
        shown = ("reward", "acc", "reward/parsed", "kl", "response_length", "loss", "grad_norm",
                 "eval/pass@1_greedy", "time/step")
        line = " | ".join(f"{k} {metrics[k]:.4g}" for k in shown if metrics.get(k) is not None)
        self.step_seconds.append(metrics["time/step"])
        # the median step (an eval's step is the slow one) times the steps still to run
        left = sorted(self.step_seconds)[len(self.step_seconds) // 2] * (self.max_steps - step - 1)
        print(f"step {step} | {line} | left {int(left // 60)}m{int(left % 60):02d}s", flush=True)


# ---------------------------------------------------------------- metrics (M1), parity (R2)


def scored(rewards):
    """The rewards but the NaN of completions no TRL reward function scored."""
    return rewards[~rewards.isnan()]


def mean_of(components, name):
    """The mean of a reward component, or None when the task does not report it."""
    return components[name].mean().item() if name in components else None


def rollout_metrics(step, drawn, stats, batch, rounds, beta, temperature, cfg, turns=False):
    """M1 and A4 over every rollout drawn this step (all ranks); with R7, the kept batch's too.
    turns: rollouts have turns (task.multi_turn); tools/ counts a tool call or environment turn."""
    comps = drawn.components
    out = {
        "step": step,
        # over the scored completions: TRL's unscored (NaN) ones are left out, as TRL logs them
        "reward": scored(drawn.rewards).mean().item(),
        "reward_std": scored(drawn.rewards).std().item(),
        **{f"reward/{k}": v.mean().item() for k, v in comps.items()
           if k not in ("errors", "timeouts")},
        "reward/errors": int(comps["errors"].sum()),  # completions whose reward raised or hung
        "reward/timeouts": int(comps["timeouts"].sum()),  # of those, the ones past reward_timeout
        "acc": mean_of(comps, "correct"),  # None for a task without a notion of correct
        "format": mean_of(comps, "format"),  # the <think>/<answer> layout; a boxed answer: parsed
        "response_length": drawn.lengths.mean().item(),
        "truncated": drawn.truncated.mean().item(),
        "gen_tokens": int(drawn.lengths.sum()),
        "group_std": stats["group_std"],
        "effective_group_ratio": stats["effective_group_ratio"],
        "frac_reward_zero_std": stats["frac_reward_zero_std"],
    }
    if turns:  # multi-turn rollouts: how much the model uses the tool, and how well
        calls = drawn.tool_calls.sum().item()
        out["tools/calls_per_completion"] = calls / len(drawn)
        out["tools/error_rate"] = drawn.tool_errors.sum().item() / calls if calls else None
        out["tools/share_using"] = (drawn.tool_calls > 0).float().mean().item()
        out["tools/output_tokens"] = int(drawn.tool_tokens.sum())  # context, not trained on
    if cfg.dynamic_sampling:  # R7: what the update trained on
        kept = batch.gathered()
        out["kept/prompts"] = len(kept) // cfg.group_size
        # the share of the groups drawn that the update left out (no refill: the batch shrinks)
        out["dropped_groups"] = 1 - len(kept) / len(drawn)
        out["kept/reward"] = scored(kept.rewards).mean().item() if len(kept) else None
        out["kept/acc"] = mean_of(kept.components, "correct") if len(kept) else None
        out["drawn/prompts"] = len(drawn) // cfg.group_size
    out["beta"] = beta
    out["temperature"] = temperature
    out["refill_rounds"] = rounds
    return out


def step_metrics(update, ub, lr):
    """M1 of the update: global sums over ranks, token means, parity, token counts, memory."""
    sums = {k: parallel.all_sum(v) for k, v in update.sums.items()}
    n_tok = max(sums.get("num_tokens", 0.0), 1.0)
    out = {
        "loss": update.loss,
        "kl": sums["kl"] / n_tok if "kl" in sums else None,
        "grad_norm": update.grad_norm.item(),
        "lr": lr,
        "skipped_nonfinite": update.skipped,  # optimizer steps not taken: loss or norm not finite
        "optimizer_steps": update.steps,  # AdamW steps taken, those with a zero gradient among them
        "zero_gradient_steps": update.zero_gradient,  # no row with a reward spread: momentum only
        "skipped_empty_batch": 0,  # 1: R7's filter left no group, no update (grpo.main)
    }
    for k in ("clip_frac_low", "clip_frac_high", "approx_kl_old", "ratio", "entropy",
              "is_weight_mean", "is_limited_frac", "dual_clip_frac", "pg_token_frac",
              "teacher_kl"):
        if k in sums:
            out[k] = sums[k] / n_tok
    if sums.get("rows"):  # R2, R8: completions a "_mask" is_correction left no token of
        out["is_masked_rows"] = sums["rows_masked"] / sums["rows"]
    out["sampler_logprob_diff_mean"] = None
    out["sampler_logprob_diff_max"] = None
    # R2 over the tokens compared (the computed rows'), not the batch's: idle rows have no pass
    compared = parallel.all_sum(sum(n for _, _, n in update.parity))
    if compared > 0:
        gap = parallel.all_sum(sum(s for s, _, _ in update.parity))
        out["sampler_logprob_diff_mean"] = gap / compared
        out["sampler_logprob_diff_max"] = parallel.all_max(max((m for _, m, _ in update.parity),
                                                               default=0.0))
    out["tokens"] = int(ub.tokens)
    out["tokens_computed"] = int(ub.computed)  # below `tokens` when prompts are shared
    # None when no row was computed (every group without a reward spread)
    out["pad_frac"] = 1 - ub.computed_real / ub.computed if ub.computed else None
    out["mem/peak_gb"] = peak_memory_gb()
    return out


def warn_on_parity(metrics, cfg, step, next_warning):
    """R2: warn, at most every 10 steps, when the sampler's logprobs stray from the trainer's."""
    gap = metrics["sampler_logprob_diff_mean"]
    bound = PARITY_WARN[cfg.dtype]
    # R8: a batch made with older weights differs by its staleness too: on-policy batches only
    if gap is None or metrics.get("staleness", 0) > 0 or gap <= bound or step < next_warning:
        return next_warning
    print(f"warning: step {step}: sampler vs trainer logprob gap {gap:.2e} > "
          f"{bound} (config.PARITY_WARN, {cfg.dtype}); usual causes: stale weights (a push "
          "skipped, or weights reloaded from disk), a temperature mismatch, or top_p/top_k < 1 "
          "(the trainer does not truncate)")
    return step + 10


def end_step(cfg, step, metrics, t_step, final_eval, logger, save):
    """M2 after the last update (final_eval()), the log line (written before the checkpoint, so a
    resume never loses it), the checkpoint when one is due. Returns the checkpoint's seconds
    (logged next step)."""
    last = step == cfg.max_steps - 1
    if last:
        t0 = time.perf_counter()
        metrics.update(final_eval())
        metrics["eval/updates"] = step + 1
        metrics["time/eval"] = metrics.get("time/eval", 0.0) + time.perf_counter() - t0
    metrics["time/step"] = time.perf_counter() - t_step
    if logger is not None:  # rank 0
        logger.log(metrics)
    t0 = time.perf_counter()
    if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
        save()
    if last and logger is not None:
        print(run_summary(cfg, step, metrics, time.perf_counter() - logger.started))
    return time.perf_counter() - t0


def run_summary(cfg, step, metrics, seconds):
    """The console's last lines: steps and wall time, the final eval of each eval set (its greedy
    pass@1, avg@n, pass@n, maj@n, parsed), where the checkpoint and metrics.jsonl are."""
    minutes, secs = divmod(round(seconds), 60)
    lines = [f"done: {step + 1} steps ({cfg.max_steps} planned), {minutes}m{secs:02d}s in this "
             "process"]
    n = cfg.eval_n  # pass@k at k = n only, as avg@n and maj@n are
    shown = ("pass@1_greedy", f"avg@{n}", f"pass@{n}", f"maj@{n}", "format", "parsed",
             "response_length")
    sets = {}  # "" (the training task's test split) or an eval set's name -> its final metrics
    for key, value in metrics.items():
        name, _, metric = key.removeprefix("eval/").rpartition("/")
        if key.startswith("eval/") and metric in shown and isinstance(value, (int, float)):
            sets.setdefault(name, []).append(f"{metric} {value:.3f}")
    for name, figures in sets.items():
        lines.append(f"  final eval{' ' + name if name else ''}: " + " | ".join(figures))
    where = os.path.join(cfg.out_dir, f"ckpt_{step + 1:06d}")
    lines.append(f"  checkpoint {where} | metrics {os.path.join(cfg.out_dir, 'metrics.jsonl')}")
    return "\n".join(lines)


MAX_NONFINITE = 5  # L6: skipped updates in a row that stop the run (grpo.update_policy)


def count_nonfinite(stepped, state, cfg, loss, grad_norm):
    """L6: 1 if the step was skipped (non-finite loss or grad norm), else 0; MAX_NONFINITE in a
    row stop the run."""
    state.nonfinite_in_a_row = 0 if stepped else state.nonfinite_in_a_row + 1
    if stepped:
        return 0
    print(f"step {state.step}: non-finite loss {loss} or grad norm {grad_norm.item()}; "
          "update skipped")
    if state.nonfinite_in_a_row >= MAX_NONFINITE:  # else the run goes on with a broken model
        raise diverged(cfg, f"step {state.step}: {state.nonfinite_in_a_row} non-finite updates in "
                            "a row")
    return 1


class Diverged(RuntimeError):
    """The policy's outputs or updates are no longer finite: the run stops, saying why."""


def diverged(cfg, what):
    """Diverged, naming its likely cause (L6)."""
    return Diverged(f"{what}: the policy's weights have diverged. The likely cause is the learning "
                    f"rate, lr={cfg.lr:g} (usual: 1e-6 to 1e-5 for full fine-tuning of a 1-8B "
                    "model, up to ~1e-4 with LoRA or a ~100M model); lower it and go on from the "
                    "last checkpoint: --resume=true --resume_changed=true --lr=...")
