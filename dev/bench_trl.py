"""This loop against TRL's GRPOTrainer on the same work, step time side by side in one run.

    # this script's own, optional dependency (trl 1.16 runs on our transformers)
    pip install --no-deps trl
    python -m dev.bench_trl             # the default run's work: SmolLM2-135M-Instruct, fp32, math
    python -m dev.bench_trl --steps 3 --dtype=bfloat16    # bf16 autocast on both sides

Both sides get the same model, prompts (the task's, through the chat template), reward (the task's
reward function), batch (prompts_per_step x group_size completions, one optimizer step per batch),
completion length, temperature, lr and beta, with transformers generation on both (TRL's default
use_vllm=False; ours --engine=hf); then ours again with its vLLM engine. Each side runs warmup +
steps steps; the median of the timed steps is printed, and the ratios.
"""

import argparse
import json
import statistics
import tempfile
import time

from config import config_from_argv
from dev import bench


def trl_steps(cfg, steps):
    """Seconds of each of TRL GRPOTrainer's optimizer steps
    (generation, scoring, reference, update) on cfg's work."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from episodes.task import load_problems, load_task
    from model import model_path

    task = load_task(cfg)
    problems = load_problems(cfg, task, "train")
    rows = [{"prompt": task.prompt(p), "problem": json.dumps(p)} for p in problems]
    path = model_path(cfg)

    def reward(completions, problem, **_):  # TRL passes the dataset's other columns by name
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [task.reward(t, json.loads(p)) for t, p in zip(texts, problem)]
        return [float(s["correct"] if isinstance(s, dict) else s) for s in scores]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)

    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=cfg.batch_size,
            num_generations=cfg.group_size, max_completion_length=cfg.max_completion_len,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0),
            learning_rate=cfg.lr,
            lr_scheduler_type="constant", beta=cfg.beta, num_iterations=1, epsilon=cfg.clip_eps,
            loss_type="dapo",  # DAPO's token mean over the batch: our loss_agg = token-mean
            scale_rewards="group", use_cpu=not torch.cuda.is_available(),
            bf16=cfg.dtype == "bfloat16",
            logging_steps=1, report_to="none", save_strategy="no", seed=cfg.seed,
            disable_dropout=True)
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_list(rows),
                              processing_class=AutoTokenizer.from_pretrained(path),
                              callbacks=[timer])
        trainer.train()
    return timer.seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a run file; default: config.py's defaults")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--sides", default="trl,hf,vllm",
                        help="which of trl, hf (ours), vllm (ours) to run")
    args, overrides = parser.parse_known_args()
    cfg = config_from_argv((["--config", args.config] if args.config else []) + overrides)
    medians = {}
    for side in args.sides.split(","):
        if side == "trl":
            seconds = trl_steps(cfg, args.warmup + args.steps)[args.warmup:]
        else:  # grpo.py in a subprocess, eval and checkpoints off (bench.run_engine)
            seconds = [r["time/step"] for r in bench.run_engine(side, args.config, overrides,
                                                                args.steps, args.warmup)]
        medians[side] = statistics.median(seconds)
        print(f"{side}: {len(seconds)} timed steps, median {medians[side]:.1f} s a step",
              flush=True)
    if "trl" in medians:
        for side in ("hf", "vllm"):
            if side in medians:
                print(f"ours with the {side} engine: {medians[side] / medians['trl']:.2f}x TRL's "
                      "step time")
    batch = [cfg.batch_size // cfg.group_size, cfg.group_size]
    print(json.dumps({"dtype": cfg.dtype, "batch": batch,
                      "max_completion_len": cfg.max_completion_len, "median_step_s": medians}))


if __name__ == "__main__":
    main()
