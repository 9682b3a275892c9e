"""R8: the sampler process one batch ahead (run/async_rollouts.py), and the off-policy loss.

    pytest tests/test_async_rollouts.py

The runs are grpo.py on the tiny config with the HF engine (each row drawn from its own seed, so
two runs of the same settings sample alike), in a subprocess as a user runs it.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dev.compare_runs import compare
from loss import grpo_loss, sampler_is_weights
from run.async_rollouts import load_pending

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = ["--engine=hf", "--async_rollouts=true", "--eval_every=0", "--sample_every=1",
         "--sample_groups=4"]


def command(out_dir, *args):
    return [sys.executable, os.path.join(ROOT, "grpo.py"), "--config",
            os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={out_dir}", *args]


def run(out_dir, *args):
    proc = subprocess.run(command(out_dir, *args), capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("staleness", [1, 2])
def test_batch_t_is_made_with_the_weights_after_t_minus_staleness_updates(tmp_path, staleness):
    """Every row of step t was sampled with the weights after max(0, t - max_staleness) updates,
    whatever the two processes' speeds (each version is tagged in the ring; the sampler reads that
    one), logged as `staleness`; an eval step's batch is made with its own weights."""
    run(tmp_path, *ASYNC, "--max_steps=5", f"--max_staleness={staleness}")
    versions = {}
    for row in read_jsonl(tmp_path / "samples.jsonl"):
        versions.setdefault(row["step"], set()).add(row["policy_version"])
    assert versions == {t: {max(0, t - staleness)} for t in range(5)}
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["staleness"] for m in metrics] == [min(t, staleness) for t in range(5)]
    assert all(m["time/wait"] >= 0 and "time/sampler_idle" in m for m in metrics)
    assert "eval/pass@1_greedy" in metrics[-1]  # the final eval, made by the sampler
    evals = tmp_path / "evals"
    run(evals, *ASYNC, "--max_steps=4", "--eval_every=2")
    metrics = read_jsonl(evals / "metrics.jsonl")
    assert [m["staleness"] for m in metrics] == [0, 1, 0, 1]  # steps 0 and 2: on-policy evals
    assert [m.get("eval/updates") for m in metrics] == [0, None, 2, 4]
    # the sampler holds the trainer's very weights where a batch is on-policy (fp32 both sides),
    # and one update's worth of difference where it is a step behind (lr 2e-2 moves them)
    gaps = [m["sampler_logprob_diff_max"] for m in metrics]
    assert gaps[0] < 1e-3 and gaps[2] < 1e-3 and gaps[1] > 1e-2 and gaps[3] > 1e-2, gaps


def test_an_async_run_learns_one_step_behind_the_plain_one(tmp_path):
    """The tiny run's reward climbs with the sampler a batch ahead too (from ~0.05 to ~0.9 in 20
    steps, a step or two behind the plain run)."""
    run(tmp_path, *ASYNC)
    rewards = [m["reward"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards


def test_a_kill_9_mid_run_then_resume_is_the_straight_run(tmp_path):
    """kill -9 once ckpt_000002 exists, resume: the checkpoint holds batch 2 (made with the weights
    after 1 update, which it no longer has) and the prompt sampler's state as of batch 1, so the
    resumed run is the straight one, sample for sample and metric for metric."""
    common = [*ASYNC, "--max_steps=5", "--save_every=2"]
    run(tmp_path / "straight", *common)
    out = tmp_path / "resumed"
    proc = subprocess.Popen(command(out, *common), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    while not (out / "ckpt_000002").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "ckpt_000005").exists()
    pending = load_pending(out / "ckpt_000002")  # loads outside grpo.py's process
    assert [(m.step, m.version) for m in pending] == [(2, 1)]
    said = run(out, *common, "--resume=true").stdout
    assert "resumed from" in said and "at step 2" in said
    found = compare(tmp_path / "straight", out)
    assert found == {"metrics.jsonl": [], "samples.jsonl": []}


KILLER = """import itertools, os, signal
from rewards import digits_reward

CALLS = itertools.count()


def problems(split, n, seed):
    return [{"id": f"{split}{i}"} for i in range(n)]


def prompt(problem):
    return [{"role": "user", "content": "Write digits: " + problem["id"]}]


def reward(completion, problem):
    if next(CALLS) == 40:  # in the sampler's process (reward_timeout=0): step 2's scoring
        os.kill(os.getpid(), signal.SIGKILL)
    return digits_reward(completion)
"""


def test_a_sampler_that_dies_stops_the_trainer_saying_so(tmp_path):
    """The sampler is killed mid-step: the trainer stops with the cause (exit 1, no hang), and
    every step it finished is in metrics.jsonl."""
    task = tmp_path / "killer.py"
    task.write_text(KILLER)
    proc = subprocess.run(command(tmp_path / "run", *ASYNC, f"--task={task}", "--max_steps=5",
                                  "--reward_timeout=0"),
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 1
    assert "the sampler process died" in proc.stderr
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize("error", [ConnectionResetError, BrokenPipeError, EOFError])
def test_a_pipe_that_breaks_mid_message_is_the_sampler_dying(error):
    """However its end of the pipe goes (reset, broken, closed), the trainer says the sampler died,
    in one line, not the pipe's traceback."""
    from run.async_rollouts import AsyncRollouts

    class Broken:
        def poll(self, timeout):
            return True

        def recv(self):
            raise error(104, "Connection reset by peer") if error is not EOFError else error()

    class Dead:
        exitcode = -9

        def join(self, timeout):
            pass

    rollouts = AsyncRollouts.__new__(AsyncRollouts)  # only its pipe and process: no sampler
    rollouts.conn, rollouts.process = Broken(), Dead()
    with pytest.raises(RuntimeError, match=r"the sampler process died \(exit code -9\)") as e:
        rollouts.receive()
    assert e.value.__suppress_context__


def test_a_sampler_that_raises_stops_the_trainer_with_its_traceback(tmp_path):
    """An error in the sampler process (here: a model folder it cannot read) reaches the trainer
    as the sampler's own traceback, at the trainer's first wait for a batch."""
    import grpo
    from config import load_config
    from data.sampler import PromptSampler
    from run.async_rollouts import AsyncRollouts, Phases

    cfg = load_config(overrides=["--model=tiny", "--engine=hf", "--async_rollouts=true",
                                 f"--out_dir={tmp_path}", "--task=digits"])
    missing = str(tmp_path / "no_model_here")
    phases = Phases(grpo.collect_rollouts, grpo.temperature_at, grpo.eval_is_due)
    rollouts = AsyncRollouts(cfg, missing, "cpu", torch.nn.Linear(2, 2), PromptSampler(10, 0), 0,
                             phases)
    try:
        with pytest.raises(RuntimeError, match="(?s)the sampler process failed:.*no_model_here"):
            rollouts.next(0, {})
    finally:
        rollouts.close()


def test_the_off_policy_loss_against_a_hand_worked_batch():
    """Two completions of one token each, A = +1 and -1, made by a stale q. Trainer pi_old = pi
    (one step a batch), q: 0.25 and 0.8 where pi gives 0.5 and 0.2. Token IS in the band [0.5, 2]:
    rho = pi_old / q = 2 and 0.25. Truncate: w = 2 and 0.5 -> loss = -(2 * 1 * 1 + 0.5 * -1 * 1) / 2
    = -0.75. Mask: w = 1 and 0 -> -(1) / 2 = -0.5, and the second row is masked whole. With
    old_logprobs="sampler" the ratio itself is pi / q, 2 and 0.25, and PPO's clip acts: 1.2 for A
    > 0, 0.8 for A < 0 (the min takes the clipped side of each) -> -(1.2 * 1 + 0.8 * -1) / 2 =
    -0.2."""
    lp = torch.log(torch.tensor([[0.5], [0.2]])).requires_grad_()
    q = torch.log(torch.tensor([[0.25], [0.8]]))
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    w, m = sampler_is_weights(lp, q, mask, level="token", action="truncate", cap=2.0, floor=0.5)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5])
    loss, _ = grpo_loss(lp, lp.detach(), adv, mask, is_weights=w)
    assert loss.item() == pytest.approx(-0.75)
    w, m = sampler_is_weights(lp, q, mask, level="token", action="mask", cap=2.0, floor=0.5)
    assert w.flatten().tolist() == [1.0, 0.0] and (m["rows_masked"], m["rows"]) == (1, 2)
    assert grpo_loss(lp, lp.detach(), adv, mask, is_weights=w)[0].item() == pytest.approx(-0.5)
    loss, metrics = grpo_loss(lp, q, adv, mask)  # old_logprobs="sampler": the ratio is pi / q
    assert loss.item() == pytest.approx(-(1.2 * 1 + 0.8 * -1) / 2)
    assert metrics["ratio"] == pytest.approx((2.0 + 0.25) / 2)
    # a sequence-level band masks whole rows: a row of two tokens, rho 2 and 2 -> 4 > cap 3
    two = torch.log(torch.tensor([[0.5, 0.5]]))
    w, m = sampler_is_weights(two, torch.log(torch.tensor([[0.25, 0.25]])), torch.ones(1, 2),
                              level="sequence", action="mask", cap=3.0, floor=1 / 3)
    assert w.tolist() == [[0.0, 0.0]] and m["rows_masked"] == 1 and math.isclose(
        m["is_limited_frac"], 1.0)
