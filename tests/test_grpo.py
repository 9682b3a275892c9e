"""The training loop run as a user runs it: grpo.py in a subprocess on the tiny config.

    pytest tests/test_grpo.py

Each vLLM run spends ~20 s starting the engine on this CPU; the loop itself is ~0.1 s a step.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import config
import grpo
import rollout
from config import ConfigError, load_config
from episodes.task import Task
from infra import checkpoint, log
from infra.model_files import vllm_available
from run import prepare
from run.audit import replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
requires_vllm = pytest.mark.skipif(not vllm_available() and not os.environ.get("CI"),
                                   reason="vllm not installed")
TRAIN_KEYS = ("reward", "acc", "loss", "grad_norm", "entropy", "response_length", "lr",
              "effective_group_ratio")


def command(out_dir, *args):
    return [sys.executable, os.path.join(ROOT, "grpo.py"), "--config",
            os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={out_dir}", *args]


def run(out_dir, *args, timeout=600, both=False):
    """grpo.py in a subprocess; its stdout (with both=True: stdout and stderr)."""
    proc = subprocess.run(command(out_dir, *args), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr if both else proc.stdout


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_until(out_dir, checkpoint, *args):
    """Start grpo.py and kill -9 it as soon as `checkpoint` exists:
    a crash at an arbitrary moment."""
    proc = subprocess.Popen(command(out_dir, *args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    saved = os.path.join(out_dir, checkpoint)
    while not os.path.isdir(saved) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=requires_vllm), "hf"])
def test_smoke_run_learns_and_logs_consistently(tmp_path, engine):
    out = tmp_path / engine
    console = run(out, f"--engine={engine}", "--sample_every=1", "--sample_groups=4", both=True)
    # one line per step: vLLM's own logging stays at warnings,
    # and nothing harmless reads as a failure
    assert "Failed to load weights" not in console and " INFO " not in console
    # R2: fp32 on both sides, pushed every step: no parity warning
    assert "warning: step" not in console
    assert len([line for line in console.splitlines() if line.startswith("step ")]) == 20
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(20))
    for m in metrics:
        for key in ("step", "reward", "loss", "kl", "entropy", "response_length", "time/generate",
                    "time/update"):
            assert key in m
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        # the sampler's logprobs equal the trainer's on the same weights every step: the weights
        # moved (lr 2e-2) and were pushed each time, or this gap would grow from step 1 on (R2)
        assert m["sampler_logprob_diff_max"] < 1e-3
    # the logged reward is the mean of the dumped rewards, and the dump re-scores to the same values
    samples = read_jsonl(out / "samples.jsonl")
    for m in metrics:
        dumped = [s["reward"] for s in samples if s["step"] == m["step"]]
        assert len(dumped) == 16 and sum(dumped) / 16 == pytest.approx(m["reward"], abs=1e-6)
    assert replay(str(out / "samples.jsonl")) == 0
    # learning: the share of digits climbs on this trivially learnable reward
    first, last = [sum(m["reward"] for m in metrics[s]) / 5 for s in (slice(0, 5), slice(15, 20))]
    assert last > first + 0.3, (first, last)
    assert "eval/pass@1_greedy" in metrics[-1] and "eval/pass@4" in metrics[-1]
    assert (os.path.isfile(out / "ckpt_000020" / "config.json")
            and os.path.isfile(out / "config.json"))


def test_a_run_with_tool_calls_trains_only_on_the_models_tokens_and_logs_the_tools(tmp_path):
    """The tiny model never writes <python>; with ' ' and 'e' as the tags nearly every completion
    calls the sandbox (with garbage: mostly errors), its output is appended, masked out of the loss,
    and logged."""
    out = tmp_path / "tools"
    run(out, "--tools=true", "--tool_tags=' ',e", "--max_steps=3", "--sample_every=1",
        "--tool_error_penalty=0.1", "--eval_every=0")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 3
    for m in metrics:
        assert (m["tools/calls_per_completion"] > 0.5 and m["tools/share_using"] > 0.5
                and m["tools/output_tokens"] > 0)
        assert m["tools/error_rate"] > 0.5 and m["time/tools"] > 0 and math.isfinite(m["loss"])
        # over the model's tokens: the tool's have no sampler logprob
        assert m["sampler_logprob_diff_max"] < 1e-3
    assert "eval/tools/share_using" in metrics[-1]
    samples = read_jsonl(out / "samples.jsonl")
    called = [s for s in samples if len(s["turns"]) > 1]
    # the tool's turn is its output block, closed even where the token budget cut it
    for s in called:
        role, text = s["turns"][1]
        assert role == "tool", role
        assert text.startswith("\n<output>\n") and text.endswith("\n</output>\n"), text
    assert all("".join(text for _, text in s["turns"]).endswith(s["completion"][-3:])
               for s in called)
    # the penalty: each failed call costs 0.1 of a reward that is the share of digits (at most 1)
    assert any(s["reward"] < 0 for s in called)
    # the dumped rewards, penalty included, re-score alike
    assert replay(str(out / "samples.jsonl")) == 0


@requires_vllm
def test_resume_gives_the_same_run(tmp_path):
    """4 steps straight vs killed after the step-2 checkpoint + resumed: same prompts,
    same metrics."""
    common = ["--engine=vllm", "--max_steps=4", "--save_every=2", "--sample_every=1",
              "--sample_groups=4"]
    run(tmp_path / "straight", *common)
    run_until(tmp_path / "resumed", "ckpt_000002", *common)
    assert not os.path.exists(tmp_path / "resumed" / "ckpt_000004")
    stdout = run(tmp_path / "resumed", *common, "--resume=true")
    assert "resumed from" in stdout and "at step 2" in stdout
    a, b = (read_jsonl(tmp_path / "straight" / "metrics.jsonl"),
            read_jsonl(tmp_path / "resumed" / "metrics.jsonl"))
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for ma, mb in zip(a, b):
        for key in TRAIN_KEYS:
            assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), (ma["step"], key)

    def prompts(run):
        return [(s["step"], s["problem"]["id"], s["completion"])
                for s in read_jsonl(tmp_path / run / "samples.jsonl")]

    assert prompts("straight") == prompts("resumed")
    run_ids = [json.load(open(tmp_path / d / c / "trainer_state.json"))["run_id"]
               for d, c in (("resumed", "ckpt_000002"), ("resumed", "ckpt_000004"),
                            ("straight", "ckpt_000004"))]
    # a resumed run keeps its wandb run id; another run has its own
    assert run_ids[0] == run_ids[1] != run_ids[2]


def test_kill_at_any_moment_then_resume(tmp_path):
    """kill -9 twice (once while checkpoints are being written every step), then finish:
    nothing lost or doubled."""
    common = ["--engine=hf", "--max_steps=12", "--save_every=1", "--sample_every=1"]
    run_until(tmp_path, "ckpt_000003", *common)
    os.makedirs(tmp_path / ".tmp_ckpt_000099")  # what a kill during a save leaves behind
    (tmp_path / ".tmp_ckpt_000099" / "optimizer.pt").write_bytes(b"half a file")
    run_until(tmp_path, "ckpt_000007", *common, "--resume=true")
    run(tmp_path, *common, "--resume=true")
    steps = [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == list(range(12))
    # the half-written save is gone
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_ckpt")]
    kept = sorted(p for p in os.listdir(tmp_path) if p.startswith("ckpt_"))
    assert kept == ["ckpt_000011", "ckpt_000012"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt_000012")  # a complete, loadable HF folder


TINY = ["--config", os.path.join(ROOT, "config", "tiny.py")]


def fake_checkpoint(out_dir, step, *overrides):
    """A checkpoint folder as far as a resume reads it before a model loads: its step and config,
    and whole (if empty) files where checkpoint.damaged looks."""
    from safetensors.torch import save_file

    folder = out_dir / f"ckpt_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    saved = config.config_from_argv([*TINY, *overrides])
    checkpoint.save_config(saved, folder / "grpo_config.json")
    for name in ("optimizer.pt", "rng.pt"):
        torch.save({}, folder / name)
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


def write_log(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in steps) + tail)


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path, capsys):
    out = f"--out_dir={tmp_path}"
    write_log(tmp_path / "metrics.jsonl", [0, 1, 2])  # killed in step 3, before its first save
    write_log(tmp_path / "samples.jsonl", [0])
    with pytest.raises(ConfigError, match="run .*metrics.jsonl, samples.jsonl.* --resume=true"):
        prepare.prepare_run([*TINY, out])
    assert prepare.prepare_run([*TINY, out, "--resume=true"])[3] is None  # no checkpoint to load
    said = "no complete checkpoint yet: starting from step 0, its logs cleared"
    assert said in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert (tmp_path / "samples.jsonl").read_text() == ""
    prepare.prepare_run([*TINY, out])  # nothing of a run is left: a fresh run may start here too


def test_a_torn_last_log_line_is_dropped_before_any_model_loads(tmp_path, capsys):
    resume = [*TINY, f"--out_dir={tmp_path}", "--resume=true"]
    fake_checkpoint(tmp_path, 2)
    write_log(tmp_path / "metrics.jsonl", [0, 1, 2, 3], tail='{"step": 4, "rew')  # a full disk
    write_log(tmp_path / "samples.jsonl", [0, 0, 1], tail="\xff\xfe")
    assert prepare.prepare_run(resume)[3] == str(tmp_path / "ckpt_000002")
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert [m["step"] for m in read_jsonl(tmp_path / "samples.jsonl")] == [0, 0, 1]
    assert capsys.readouterr().out.count("its last line was cut off mid-write") == 2
    write_log(tmp_path / "metrics.jsonl", [0], tail='{"st\n' + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ConfigError, match="metrics.jsonl, line 2 is not a log record; delete that"):
        prepare.prepare_run(resume)


def test_a_run_owns_its_out_dir(tmp_path):
    """A fresh run refuses another run's checkpoint; a resume refuses changed settings unless told;
    a second process on the same out_dir fails at once, until the first is killed."""
    fake_checkpoint(tmp_path / "foreign", 5)  # another run's checkpoint, and no logs
    with pytest.raises(ConfigError, match=r"already holds a run \(ckpt_000005\)"):
        prepare.prepare_run([*TINY, f"--out_dir={tmp_path / 'foreign'}"])
    fake_checkpoint(tmp_path / "run", 4)
    resume = [*TINY, f"--out_dir={tmp_path / 'run'}", "--resume=true"]
    changed = "task 'digits' -> 'countdown', batch_size 16 -> 32. .* --resume_changed=true"
    with pytest.raises(ConfigError, match="settings changed since .*ckpt_000004 was saved: " +
                       changed):
        prepare.prepare_run([*resume, "--task=countdown", "--batch_size=32"])
    # how long, how often to eval and save, and how a step is computed may change
    prepare.prepare_run([*resume, "--max_steps=50", "--eval_every=5", "--save_every=1",
                         "--engine=hf"])
    prepare.prepare_run([*resume, "--batch_size=32", "--resume_changed=true"])
    # a second process: the lock names it; killed, it leaves its lock file and frees the out_dir
    second = [*TINY, f"--out_dir={tmp_path / 'b'}"]
    code = ("import sys, time; from run import prepare; prepare.prepare_run(sys.argv[1:]); "
            "print('ready', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, *second], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready\n" in iter(holder.stdout.readline, "")  # read up to its "ready" line
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid} on .*: one run per"):
            prepare.prepare_run(second)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "b" / ".lock").exists()
    prepare.prepare_run(second)
    prepare.prepare_run(second)  # this process holds the lock: a second call is fine


def test_lora_reference_is_the_base_and_only_adapters_train(tmp_path):
    from transformers import AutoModelForCausalLM

    policy = grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"),
                        f"--out_dir={tmp_path}", "--engine=hf",
                        "--lora_rank=4", "--beta=0.01", "--max_steps=3", "--lr=5e-2"])
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny_model", dtype=torch.float32)
    trained = dict(policy.named_parameters())
    for name, weight in base.named_parameters():  # every base weight untouched
        key = "base_model.model." + name.replace(".weight", ".base_layer.weight")
        assert torch.equal(trained.get(key, trained.get("base_model.model." + name)), weight), name
    # B starts at 0: it moved
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)
    ids, fp32 = (torch.tensor([[5, 17, 42, 99, 7, 3, 11]]),
                 config.config_from_argv(["--dtype=float32"]))
    with torch.no_grad(), policy.disable_adapter():
        ref_lp = grpo.forward_logprobs(policy, ids, torch.ones_like(ids), fp32, 1.0)[0]
    base_lp = grpo.forward_logprobs(base, ids, torch.ones_like(ids), fp32, 1.0)[0]
    assert torch.allclose(ref_lp, base_lp.detach(), atol=1e-6)
    with torch.no_grad():
        policy_lp = grpo.forward_logprobs(policy, ids, torch.ones_like(ids), fp32, 1.0)[0]
    assert (policy_lp - base_lp.detach()).abs().max() > 1e-4  # the adapters do change the policy
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(m["kl"] is not None and m["kl"] >= 0 for m in metrics) and metrics[-1]["kl"] > 0
    assert os.path.isfile(tmp_path / "ckpt_000003" / "adapter_config.json")


def test_bad_input_fails_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="model folder /nonexistent/model not found"):
        grpo.main([f"--out_dir={tmp_path}", "--model=/nonexistent/model"])
    proc = subprocess.run([sys.executable, "grpo.py", "--batch_size=30"], capture_output=True,
                          text=True, cwd=ROOT)
    assert (proc.returncode == 1
            and "config error: batch_size=30 is not divisible by group_size=4; use batch_size=28"
                " or 32" in proc.stderr)
    # an earlier run's log: a fresh run would append to it
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="already holds a run .* --resume=true, or give this run "
                                          "another --out_dir"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}"])
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match="> max_prompt_len=8"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
                   "--engine=hf",
                   "--max_prompt_len=8", "--max_completion_len=8", "--micro_batch_tokens=64"])


def test_micro_batches_respect_the_token_budget():
    lengths = [10, 50, 30, 30, 20, 5, 45]
    batches = grpo.micro_batches(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert all(len(b) * max(lengths[i] for i in b) <= 100 for b in batches)
    assert batches[0] == [1, 6]  # longest first: 2 x 50 fits, a third would not
    # one sequence is never split (pre-flight keeps it within budget)
    assert grpo.micro_batches([300], 100) == [[0]]


def test_pad_batch_masks_only_response_tokens():
    from rollout import Completion

    a = Completion([1, 2, 3], [4, 5], "", [-0.5, -0.25], False)
    b = Completion([1], [6, 7, 8], "", [-1.0, -2.0, -3.0], True)
    ids, attention, mask, lp = grpo.pad_batch([a, b], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 7, 8, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position t predicts ids[:, t + 1]: a's response tokens 4, 5 sit at t = 2, 3; b's 6, 7,
    # 8 at t = 0, 1, 2
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert lp.tolist() == [[0, 0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0]]


def test_every_loop_toggle_runs_and_shows_its_effect(tmp_path):
    """One run with the loop-level toggles on, each checked for the effect it should have."""
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=hf",
               "--max_steps=6", "--num_iterations=2",  # L7: a second epoch sees ratios != 1
               "--temperature=1.0", "--temperature_end=0.5",  # R4
               # F2: KL > high -> x 1.2
               "--beta=0.01", "--adaptive_kl=true", "--kl_window=2", "--kl_band=0,1e-9",
               "--ref_offload=true", "--ref_refresh_steps=3",  # F1
               "--dynamic_sampling=true", "--mask_truncated=true",  # R7, R6
               "--curriculum=true", "--curriculum_ramp_steps=2",  # D2
               "--entropy_coef=1e-3", "--clip_eps_high=0.28",  # L5, L1
               "--gradient_checkpointing=true", "--dtype=bfloat16",  # O5
               "--length_soft_limit=8", "--reward_weights=format:0.2"])  # W2, W3
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 6 and all(math.isfinite(m["loss"]) for m in metrics)
    for m in metrics:
        if m["truncated"] == 1.0:  # R6: every completion was cut off, so nothing is trained on
            assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
        else:  # L7: averaged over both epochs, and in the second the policy has moved
            assert m["approx_kl_old"] > 0 and m["grad_norm"] > 0
    assert any(m["truncated"] < 1.0 for m in metrics)
    assert [round(m["temperature"], 6) for m in metrics] == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    # scaled after 2 steps
    assert [m["beta"] for m in metrics][:3] == [0.01, 0.01, pytest.approx(0.012)]
    # R7: the log counts every group drawn (the first draw and the refills); the update,
    # the kept ones only
    for m in metrics:
        # groups with a reward spread
        informative = round(m["effective_group_ratio"] * m["drawn/prompts"])
        # each refill round draws the groups still missing: 1 to 4 of them
        assert 4 + m["refill_rounds"] <= m["drawn/prompts"] <= 4 * (1 + m["refill_rounds"])
        assert m["kept/prompts"] == min(4, informative)
    with open(tmp_path / "ckpt_000006" / "trainer_state.json") as f:
        state = json.load(f)
    # D2 state in the checkpoint
    assert state["sampler"]["calls"] >= 6 and state["sampler"]["pass_rate"]
    # F1: the reference was refreshed after the last step (every 3), so it equals the saved policy;
    # and the policy had moved off the base (a KL > 0), so the reference is no longer the base model
    from safetensors.torch import load_file

    ref = torch.load(tmp_path / "ckpt_000006" / "reference.pt")
    policy = load_file(tmp_path / "ckpt_000006" / "model.safetensors")
    assert all(torch.equal(ref[k], policy[k]) for k in policy) and any(m["kl"] > 0 for m in metrics)
    # W3: every completion past 8 tokens lost at least 0.05,
    # so no reward reaches the unshaped maximum
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert all(s["reward"] <= s["components"]["correct"] + 0.2 * s["components"]["format"]
               - 0.05 * (s["length"] > 8) + 1e-6 for s in samples)


def test_nonfinite_step_is_skipped_and_leaves_weights_alone():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.tensor([1.0, float("nan"), 1.0])
    norm, stepped = grpo.optimizer_step(optimizer, [w], 0.5, grad_clip=1.0)
    assert (not stepped and not math.isfinite(norm.item()) and w.tolist() == [1.0, 1.0, 1.0]
            and w.grad is None)
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    # a non-finite loss
    _, stepped = grpo.optimizer_step(optimizer, [w], float("inf"), grad_clip=1.0)
    assert not stepped and w.tolist() == [1.0, 1.0, 1.0]
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    norm, stepped = grpo.optimizer_step(optimizer, [w], 0.5, grad_clip=1.0)
    assert stepped and norm.item() == pytest.approx(5.0) and w.tolist() != [1.0, 1.0, 1.0]


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=requires_vllm), "hf"])
def test_a_learning_rate_that_destroys_the_model_stops_the_run_saying_so(tmp_path, engine):
    """lr=1e10: the first update blows the weights up. The HF engine crashed (an IndexError in
    sample_next), vLLM sampled token 0 ever after, every update a silent zero-gradient step, and the
    run exited 0. Now pre-flight warns, and the next generation stops the run naming lr."""
    proc = subprocess.run(command(tmp_path, f"--engine={engine}", "--lr=1e10", "--max_steps=6",
                                  "--eval_every=0"), capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 1
    assert "lr=1e+10 is far outside the usual range" in proc.stderr
    stopped = proc.stderr.strip().splitlines()[-1]
    assert stopped.startswith("stopped: the ") and "weights have diverged" in stopped
    assert "lr=1e+10" in stopped and "Traceback" not in proc.stderr
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0]  # what it did, kept


def test_non_finite_updates_in_a_row_stop_the_run_naming_lr(monkeypatch):
    """MAX_NONFINITE skipped updates in a row: the run stops (it went on with a broken model)."""
    monkeypatch.setattr(grpo.log, "MAX_NONFINITE", 2)
    cfg = config.load_config(overrides=["--lr=1e-3"])
    state = SimpleNamespace(step=7, nonfinite_in_a_row=0)
    assert grpo.log.count_nonfinite(False, state, cfg, float("nan"), torch.tensor(1.0)) == 1
    with pytest.raises(log.Diverged, match=r"step 7: 2 non-finite updates in a row: .* lr=0.001"):
        grpo.log.count_nonfinite(False, state, cfg, float("nan"), torch.tensor(float("inf")))
    assert grpo.log.count_nonfinite(True, state, cfg, 0.5, torch.tensor(1.0)) == 0
    assert state.nonfinite_in_a_row == 0


def test_the_bands_reach_their_users_in_order():
    """kl_band's low edge scales beta down, its high edge up (F2); the curriculum's buckets are
    hard below a pass rate of 0.2 and easy above 0.8 (D2)."""
    cfg = config.load_config(overrides=["--beta=0.01", "--adaptive_kl=true", "--kl_window=1",
                                        "--kl_band=0.05,0.1", "--curriculum=true"])
    state = SimpleNamespace(beta=0.01, kl_history=[])
    grpo.adapt_beta(state, 0.07, cfg)  # inside the band: unchanged
    assert state.beta == 0.01
    grpo.adapt_beta(state, 0.02, cfg)  # below 0.05: x 0.8
    assert state.beta == pytest.approx(0.008)
    grpo.adapt_beta(state, 0.2, cfg)  # above 0.1: x 1.2
    assert state.beta == pytest.approx(0.0096)
    sampler = prepare.make_sampler(cfg, None, range(10))
    # each prompt's first rate starts its moving average; the edges 0.2 and 0.8 are medium
    sampler.update([0, 1, 2, 3, 4], [0.19, 0.2, 0.5, 0.8, 0.81])
    # hard, medium x3, easy; prompt 5 never seen: medium
    assert [sampler.bucket(i) for i in range(6)] == [2, 1, 1, 1, 0, 1]


class Recorder:
    """Forwards every call to the real object and notes it: a thin wrapper, not a mock."""

    def __init__(self, target, log):
        self._target, self._log = target, log

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            detail = kwargs.get("tags") or kwargs.get("level") or ""
            self._log.append(f"{name}{detail}" if detail else name)
            return attr(*args, **kwargs)

        return call


@requires_vllm
def test_engine_handoff_order_over_two_steps(tmp_path):
    """R1: wake weights -> push -> wake KV -> reset prefix cache -> generate -> sleep,
    every step."""
    log = []

    def record(engine):
        # run the GPU code path; the CPU worker accepts sleep calls and ignores them
        engine.sleep_level = 2
        engine.llm = Recorder(engine.llm, log)
        return engine

    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=vllm", "--max_steps=2", "--eval_every=0"], wrap_engine=record)
    push = "collective_rpc"  # reload_weights with the trainer's tensors, never a path on disk
    # awake after start-up: nothing to wake
    step0 = [push, "reset_prefix_cache", "generate", "sleep2"]
    step = ["wake_up['weights']", push, "wake_up['kv_cache']", "reset_prefix_cache", "generate",
            "sleep2"]
    final_eval = ["wake_up['weights']", push, "wake_up['kv_cache']", "reset_prefix_cache",
                  "generate", "generate"]
    assert log == step0 + step + final_eval
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(m["sampler_logprob_diff_max"] < 1e-3 for m in metrics)
    assert all(m["mem/after_wake_gb"] > 0 and m["mem/after_sleep_gb"] > 0 for m in metrics)


@requires_vllm
def test_a_skipped_push_is_caught_by_the_parity_metric(tmp_path, capsys):
    def skip_second_push(engine):
        real_wake, calls = engine.wake, []

        def wake(weights):
            calls.append(1)
            if len(calls) != 2:
                real_wake(weights)

        engine.wake = wake
        return engine

    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=vllm", "--max_steps=3", "--eval_every=0"], wrap_engine=skip_second_push)
    gaps = [m["sampler_logprob_diff_mean"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert gaps[0] < 1e-5 and gaps[2] < 1e-5  # pushed: the sampler has the trainer's weights
    assert gaps[1] > 1e-3  # step 1 sampled with step 0's weights
    assert "warning: step 1: sampler vs trainer logprob gap" in capsys.readouterr().out


def test_dynamic_sampling_logs_and_feeds_every_group_drawn(tmp_path):
    """R7 on a task nothing solves: every group is all-wrong, so every one is dropped. The log and
    the curriculum must still see them (DAPO and verl log the statistics before the filter)."""
    never = tmp_path / "never.py"  # a reward of 0 whatever is sampled: no group has a spread
    never.write_text("def problems(split, n, seed):\n"
                     "    return [{'id': f'{split}{i}', 'q': str(i)} for i in range(n)]\n"
                     "def prompt(p):\n    return [{'role': 'user', 'content': 'Say ' + p['q']}]\n"
                     "def reward(completion, problem):\n    return {'correct': 0.0}\n")
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=hf", f"--task={never}", "--max_prompt_len=160", "--micro_batch_tokens=256",
               "--max_steps=2", "--eval_every=0", "--dynamic_sampling=true",
               "--dynamic_sampling_rounds=1", "--curriculum=true"])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]  # a step without an update is still logged
    for m in metrics:
        assert (m["frac_reward_zero_std"] == 1.0 and m["effective_group_ratio"] == 0.0
                and m["acc"] == 0.0)
        assert m["drawn/prompts"] == 8 and m["kept/prompts"] == 0 and m["skipped_empty_batch"] == 1
    with open(tmp_path / "ckpt_000002" / "trainer_state.json") as f:
        pass_rate = json.load(f)["sampler"]["pass_rate"]
    # D2: 16 prompts drawn in 4 rounds (a prompt may come twice), every one seen, and seen as hard
    assert len(pass_rate) >= 12 and set(pass_rate.values()) == {0.0}


@pytest.mark.parametrize("level, mode", [("token", "truncate"), ("token", "mask"),
                                         ("sequence", "truncate"), ("sequence", "mask")])
def test_each_is_correction_mode_trains(tmp_path, monkeypatch, level, mode):
    """R2: the HF engine samples from the trainer's own distribution, so rho = 1 up to float noise:
    every weight is ~1 and nothing is limited, in each mode; the loop runs and logs the weights.
    The weights are made at the run's level, with its is_cap and action at either level."""
    calls, weights = [], grpo.sampler_is_weights

    def recorded(*args, **kwargs):
        calls.append((kwargs["level"], kwargs["cap"], kwargs["action"]))
        return weights(*args, **kwargs)

    monkeypatch.setattr(grpo, "sampler_is_weights", recorded)
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=hf", "--max_steps=2", "--eval_every=0", f"--is_correction={level}_{mode}",
               "--is_cap=5"])
    assert calls and set(calls) == {(level, 5.0, mode)}
    for m in read_jsonl(tmp_path / "metrics.jsonl"):
        assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and m["is_limited_frac"] == 0.0
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0


@pytest.mark.parametrize("dtype, warns", [("float32", True), ("bfloat16", False)])
def test_the_parity_warning_bound_is_the_compute_dtypes(capsys, dtype, warns):
    """A mean sampler-trainer gap of 5e-3 is a fault in fp32 (bound 1e-3: the two sides agree to
    ~1e-6) and rounding in bf16 (bound 0.1); a warning waits 10 steps before the next."""
    cfg = config.load_config(overrides=[f"--dtype={dtype}"])
    capsys.readouterr()
    next_warning = log.warn_on_parity({"sampler_logprob_diff_mean": 5e-3}, cfg, 3, 0)
    assert next_warning == (13 if warns else 0)
    printed = capsys.readouterr().out
    assert ("logprob gap 5.00e-03 > 0.001 (config.PARITY_WARN, float32)" in printed) == warns


def test_report_to_sends_each_step_to_the_loggers_it_names(tmp_path, monkeypatch):
    """report_to=wandb,tensorboard: wandb under $WANDB_PROJECT (TRL's way) with the run's id, so a
    resume goes on with the same wandb run, and tensorboard in out_dir/tb, each step's numbers;
    "none" neither. Neither package is needed: stand-ins record what the Logger asks of them."""
    import types

    calls = []
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or wandb,
                                  log=lambda metrics, step: calls.append(("log", step, metrics)))

    class SummaryWriter:
        def __init__(self, folder):
            calls.append(("tb", folder))

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, value, step))

    tensorboard = types.SimpleNamespace(SummaryWriter=SummaryWriter)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setenv("WANDB_PROJECT", "countdown")
    metrics = {"step": 3, "reward": 0.5, "time/step": 1.0, "note": "text"}
    log.Logger(config.Config(out_dir=str(tmp_path), report_to="none"), "run-1").log(metrics)
    assert calls == []
    both = config.Config(out_dir=str(tmp_path), report_to="wandb,tensorboard")
    log.Logger(both, "run-1").log(metrics)
    (_, init), tb, logged, *scalars = calls
    assert init["project"] == "countdown" and init["id"] == "run-1" and init["resume"] == "allow"
    assert init["config"]["report_to"] == "wandb,tensorboard"
    assert tb == ("tb", str(tmp_path / "tb")) and logged == ("log", 3, metrics)
    assert scalars == [("scalar", k, metrics[k], 3) for k in ("step", "reward", "time/step")]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2  # metrics.jsonl whatever report_to says


def test_ref_refresh_without_a_reference_fails_in_preflight(tmp_path):
    with pytest.raises(ConfigError, match="beta=0 means there is none"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
                   "--engine=hf", "--ref_refresh_steps=2"])  # tiny.py has beta = 0
    assert not os.path.exists(tmp_path / "tiny_model")  # nothing was built


def test_a_gpu_run_on_a_cpu_fails_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on this machine: no hub
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        grpo.main(["--config", path, f"--out_dir={tmp_path}", "--device=cpu"])
    monkeypatch.setattr(prepare, "check_model_source", lambda path: None)  # as if downloaded
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sized for a GPU.*--device=cpu"):
            grpo.main(["--config", path, f"--out_dir={tmp_path}"])
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_temperature_mismatch_is_caught_by_the_parity_metric(tmp_path, capsys, dtype):
    """R2/R5: an engine that samples at another temperature than the trainer assumes trips the
    warning, in either dtype (the bf16 threshold sits above bf16 rounding, not above real
    faults)."""
    def hotter(engine):
        real = engine.generate

        def generate(prompts, n, *, temperature, **kw):
            return real(prompts, n, temperature=temperature * 4 if temperature > 0 else 0.0, **kw)

        engine.generate = generate
        return engine

    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=hf",
               "--max_steps=3", "--eval_every=0", f"--dtype={dtype}"], wrap_engine=hotter)
    gaps = [m["sampler_logprob_diff_mean"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    # the random tiny model starts near uniform, where temperature changes little;
    # it sharpens within steps
    assert max(gaps) > config.PARITY_WARN[dtype], gaps
    assert "sampler vs trainer logprob gap" in capsys.readouterr().out


@requires_vllm
def test_bf16_rounding_alone_does_not_warn(tmp_path, capsys):
    """R2: a bf16 sampler beside the fp32-master trainer differs by rounding only: far above fp32's
    ~2e-7 (measured 6e-4..1.1e-3 on the tiny model), far below the bf16 bound, so a run with nothing
    wrong does not warn."""
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               "--engine=vllm", "--max_steps=3", "--eval_every=0", "--dtype=bfloat16"])
    gaps = [m["sampler_logprob_diff_mean"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert all(1e-4 < g < config.PARITY_WARN["bfloat16"] for g in gaps), gaps
    assert "warning: step" not in capsys.readouterr().out


# ------------------------------------------------------ the loss and advantage variants in the loop

# two epochs: the ratio leaves 1, so the variants differ
VARIANT_RUN = ["--engine=hf", "--max_steps=2", "--eval_every=0", "--num_iterations=2",
               "--beta=0.01", "--sample_every=1", "--sample_groups=4"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={out}",
               *VARIANT_RUN])
    return read_jsonl(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [["--adv_baseline=leave-one-out"], ["--adv_scale=batch"],
                                     ["--policy_loss=cispo"],
                                     ["--policy_loss=sapo", "--sapo_tau_pos=2", "--sapo_tau_neg=3"],
                                     ["--policy_loss=gpg"], ["--dual_clip=1.05"],
                                     ["--kl_estimator=k1"], ["--kl_estimator=k2"],
                                     ["--mini_batches=2", "--num_iterations=1"],
                                     ["--entropy_top_quantile=0.2"], ["--adv_pass_k=2"],
                                     ["--adv_per_component=true"], ["--length_reward=0.5"]],
                         ids=lambda v: ",".join(x[2:] for x in v))
def test_each_loss_and_advantage_variant_trains_and_shows_its_effect(tmp_path, plain_run, variant):
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}",
               *VARIANT_RUN, *variant])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    # step 0 samples before any update: the same groups (length_reward adds to their rewards)
    assert metrics[0]["acc"] == plain_run[0]["acc"]
    assert metrics[0]["reward"] == plain_run[0]["reward"] or variant == ["--length_reward=0.5"]
    name, value = variant[0][2:].split("=")
    groups = [s for s in read_jsonl(tmp_path / "samples.jsonl") if s["step"] == 0]
    groups = [groups[i : i + 4] for i in range(0, len(groups), 4)]  # G = 4
    if name == "adv_baseline":  # RLOO: G / (G - 1) times the centred reward, over the group's std
        for g in groups:
            r = [s["reward"] for s in g]
            std = max(torch.tensor(r).std().item(), 1e-4)
            want = [4 / 3 * (x - sum(r) / 4) / std for x in r]
            assert [s["advantage"] for s in g] == pytest.approx(want, abs=1e-5)
    elif name == "adv_scale":
        # TRL's "batch": centred reward / the std of all the batch's rewards (all dumped)
        std = torch.tensor([s["reward"] for g in groups for s in g]).std().item()
        for g in groups:
            r = [s["reward"] for s in g]
            want = [(x - sum(r) / 4) / std for x in r]
            assert [s["advantage"] for s in g] == pytest.approx(want, abs=1e-5)
    elif name == "policy_loss":
        assert metrics[0]["loss"] != pytest.approx(plain_run[0]["loss"], abs=1e-6)
    elif name == "dual_clip":
        # a bound just above 1 meets some bad tokens whose ratio rose in the second epoch
        assert all(0 < m["dual_clip_frac"] < 0.5 for m in metrics)
        assert metrics[0]["loss"] != pytest.approx(plain_run[0]["loss"], abs=1e-6)
    elif name == "kl_estimator":
        # the same tokens and weights at step 0, another estimate of their KL
        assert metrics[0]["kl"] != pytest.approx(plain_run[0]["kl"], abs=1e-9)
    elif name == "mini_batches":
        # one epoch, 2 steps: the second mini-batch meets a policy the first one moved
        assert (all(m["optimizer_steps"] == 2 for m in metrics)
                and plain_run[0]["optimizer_steps"] == 2)
        # with one step per batch it is exactly 0
        assert all(m["approx_kl_old"] > 0 for m in metrics)
    elif name == "adv_pass_k":  # A5: each group's advantages for its best of 2
        from advantage import pass_k_advantages

        for g in groups:
            want = pass_k_advantages(torch.tensor([s["reward"] for s in g]), 4, 2).tolist()
            assert [s["advantage"] for s in g] == pytest.approx(want, abs=1e-5)
    elif name == "adv_per_component":  # A6: the terms apart, over the whole (dumped) batch
        from advantage import component_advantages
        from rewards import reward_terms

        rows = [s for g in groups for s in g]
        components = {k: torch.tensor([s["components"][k] for s in rows])
                      for k in rows[0]["components"]}
        terms, weights, names = reward_terms(torch.tensor([s["reward"] for s in rows]),
                                             components, {})
        assert names == ["correct", "format", "shaping"]
        want = component_advantages(terms, weights, 4).tolist()
        assert [s["advantage"] for s in rows] == pytest.approx(want, abs=1e-5)
    elif name == "length_reward":  # W3: its own component, half of it in the reward
        from rewards import length_rewards

        for g in groups:
            want = length_rewards(torch.tensor([s["length"] for s in g]),
                                  torch.tensor([s["components"]["correct"] for s in g]), 4)
            assert [s["components"]["length_reward"] for s in g] == pytest.approx(want.tolist())
        assert any(s["components"]["length_reward"] != 0 for g in groups for s in g)
        for s in (s for g in groups for s in g):
            base = s["components"]["correct"] + 0.1 * s["components"]["format"]
            assert s["reward"] == pytest.approx(base + 0.5 * s["components"]["length_reward"],
                                                abs=1e-6)
    elif name == "entropy_top_quantile":
        # the policy gradient reaches the top 20% of tokens by entropy
        assert (all(0.2 <= m["pg_token_frac"] < 0.3 for m in metrics)
                and "pg_token_frac" not in plain_run[0])


def test_mini_batches_split_by_global_group_so_n_ranks_split_as_one():
    """Group g goes to mini-batch g % M:
    the union over ranks of each rank's mini-batch k is one process's."""
    one = grpo.mini_batch_rows(8, 2, 2, first_group=0)  # 4 groups of G = 2
    assert one == [[0, 1, 4, 5], [2, 3, 6, 7]]
    rank0 = grpo.mini_batch_rows(4, 2, 2, first_group=0)
    rank1 = grpo.mini_batch_rows(4, 2, 2, first_group=2)
    for k in range(2):
        # rank 1's rows are global rows 4..7
        assert sorted(rank0[k] + [4 + r for r in rank1[k]]) == one[k]
    assert grpo.mini_batch_rows(6, 2, 1, first_group=0) == [[0, 1, 2, 3, 4, 5]]


# ---------------------------------------------------------------- seeds


def test_no_two_rows_turns_or_steps_of_a_run_share_a_seed():
    """Row j of slot i at step t, tool turn k: one seed each over a long run (64 prompts x G = 8 a
    step, 3 turns, consecutive steps and steps far apart), eval's stream apart from training's; N
    ranks' slices are one process's seeds, and the seeds are a pure function of the key (a resumed
    run, another process, gets them)."""
    from episodes.turns import turn_seed
    from rollout import derive_seed

    cfg = config.load_config(overrides=["--group_size=8", "--batch_size=512", "--seed=1337"])
    steps = [*range(150), *range(7850, 8000)]
    seeds = [turn_seed(s, k) for t in steps for s in grpo.sampling_seeds(cfg, t, 0, 64)
             for k in range(3)]
    assert len(seeds) == 300 * 64 * 8 * 3 and len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)  # vLLM keeps seeds as int64
    # consecutive steps share none (with seed + step + slot * K + j they shared 56 of 64)
    for t in (0, 1, 7918):
        now, after = grpo.sampling_seeds(cfg, t, 0, 64), grpo.sampling_seeds(cfg, t + 1, 0, 64)
        assert not set(now) & set(after)
    assert not set(rollout.row_seeds((1337, "eval"), 0, 64, 8)) & set(seeds)
    # two ranks, 32 prompts each: rank 1's slots are 32..63 of the global batch
    halves = grpo.sampling_seeds(cfg, 5, 0, 32) + grpo.sampling_seeds(cfg, 5, 32, 32)
    assert halves == grpo.sampling_seeds(cfg, 5, 0, 64)
    want = [derive_seed(1337, "train", 5, 0, j) for j in range(8)]
    assert grpo.sampling_seeds(cfg, 5, 0, 1) == want
    # blake2b: the same in every process
    assert derive_seed(1337, "train", 0, 0, 0) == 1204145446159308702


# ------------------------------------------------------- reward components across refills and ranks

COLLECT = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import grpo
from infra import parallel
from run import prepare
from config import load_config
from rollout import Completion
from episodes.task import Task


class Engine:
    """Row 0 of every group answers "1", the others "0" (every group has a spread); records the
    seeds."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, n, *, seeds, **sampling):
        self.seeds += seeds
        return [[Completion(list(p), [7], "1" if j == 0 else "0", [-1.0], False) for j in range(n)]
                for p in prompts]


class InOrder:
    """Prompts 0, 1, 2, ... in order."""

    def __init__(self):
        self.next = 0

    def sample(self, k, step=None):
        self.next += k
        return list(range(self.next - k, self.next))


def reward(completion, problem):
    if problem["i"] in (2, 3):  # the first draw's last two prompts: all of rank 1's under 2 ranks
        raise ValueError("this reward fails")
    return {"correct": float(completion == "1"), **({"bonus": 0.5} if problem["i"] < 2 else {})}


parallel.setup("cpu")
cfg = load_config(overrides=["--batch_size=16", "--group_size=4", "--dynamic_sampling=true",
                             "--reward_timeout=0"])
problems = [{"id": str(i), "i": i} for i in range(20)]
train = prepare.Split(Task("test", None, None, reward), problems, [[100 + i] for i in range(20)])
engine, sampler, steps = Engine(), InOrder(), []
for step in range(2):
    batch, drawn, rounds = grpo.collect_rollouts(engine, sampler, train, cfg, step, 1.0, {})
    steps.append({"drawn": drawn.problem,
                  "components": {k: v.tolist() for k, v in drawn.components.items()},
                  "kept": {k: v.tolist() for k, v in batch.gathered().components.items()}})
# a file per rank: two ranks' lines on one forwarded stdout can interleave
with open(f"result{parallel.rank()}.json", "w") as f:
    json.dump({"rank": parallel.rank(), "steps": steps, "seeds": engine.seeds}, f)
'''


def collect(tmp_path, ranks):
    """COLLECT's two steps of collect_rollouts on 1 process or 2 gloo ranks: each rank's result."""
    script = tmp_path / "collect.py"
    script.write_text(COLLECT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}"]
    cmd = (launcher if ranks > 1 else [sys.executable]) + [str(script), ROOT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(ranks)]
    return sorted(results, key=lambda r: r["rank"])


def test_reward_components_agree_across_refills_and_ranks(tmp_path):
    """A task reports "bonus" for prompts 0 and 1 only, and its reward raises on prompts 2 and 3
    (all of rank 1's under 2 ranks). The refill lacks "bonus", rank 1 has only errors: every rank
    still logs the union of names, 0 where a row did not report one, the same on both ranks, and the
    first draw is one process's."""
    one, = collect(tmp_path, 1)
    two = collect(tmp_path, 2)
    assert len(two) == 2
    names = ["bonus", "correct", "errors", "timeouts"]
    for result in (one, *two):
        step0 = result["steps"][0]
        assert sorted(step0["components"]) == names and sorted(step0["kept"]) == names
        rows = step0["drawn"]  # the problem of each row drawn (G = 4 rows each)
        comps = step0["components"]
        assert comps["bonus"] == [0.5 if p < 2 else 0.0 for p in rows]
        assert comps["errors"] == [float(p in (2, 3)) for p in rows]
        assert comps["correct"] == [float(r % 4 == 0 and p not in (2, 3))
                                    for r, p in enumerate(rows)]
        assert comps["timeouts"] == [0.0] * len(rows)
    for key in ("drawn", "components", "kept"):  # every rank holds the same global view
        assert [s[key] for s in two[0]["steps"]] == [s[key] for s in two[1]["steps"]]
    first_draw = [p for p in range(4) for _ in range(4)]
    assert one["steps"][0]["drawn"][:16] == two[0]["steps"][0]["drawn"][:16] == first_draw
    # one refill of 2 prompts
    assert one["steps"][0]["drawn"][16:] == [p for p in (4, 5) for _ in range(4)]
    # 2 a rank
    assert two[0]["steps"][0]["drawn"][16:] == [p for p in (4, 5, 6, 7) for _ in range(4)]
    # seeds: the first draw's rows are one process's, split by rank; no seed twice in either run
    first = one["seeds"][:16]
    assert two[0]["seeds"][:8] + two[1]["seeds"][:8] == first
    assert len(set(one["seeds"])) == len(one["seeds"])
    seeds = two[0]["seeds"] + two[1]["seeds"]
    assert len(set(seeds)) == len(seeds)


# ---------------------------------------------------------------- init_from and the reference (F1)


@pytest.mark.parametrize("lora", [False, True])
def test_init_from_is_the_reference_so_the_first_kl_is_zero(tmp_path, lora):
    """init_from a perturbed copy of the model, beta > 0: before any update the policy is the
    reference, in full fine-tuning as with LoRA (whose reference is its base, init_from), so step
    0's KL is exactly 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model import build_tiny

    folder = build_tiny(str(tmp_path / "tiny"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.1)
    model.save_pretrained(tmp_path / "init")
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "init")
    out = tmp_path / "run"
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={out}",
               "--engine=hf",
               f"--init_from={tmp_path / 'init'}", "--beta=0.01", "--max_steps=2", "--eval_every=0",
               "--test_size=4", *(["--lora_rank=4"] if lora else [])])
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics[0]["kl"] == 0.0
    assert metrics[1]["kl"] > 0  # after an update the policy has moved away from it


def test_training_and_eval_generate_with_the_tasks_stop_strings(tmp_path):
    """A task file's STOP reaches every generate call, training's and eval's: a completion that
    holds the string ends with the token that completes it, kept, not truncated; others hold
    none."""
    task = tmp_path / "stops.py"
    task.write_text(open(os.path.join(ROOT, "tasks", "digits.py")).read() + '\nSTOP = ["e"]\n')
    calls = []

    def spy(engine):
        generate = engine.generate
        calls.append(engine.tokenizer)

        def recorded(prompts, n, **kwargs):
            groups = generate(prompts, n, **kwargs)
            calls.append((kwargs["stop"], [c for g in groups for c in g]))
            return groups

        engine.generate = recorded
        return engine

    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path / 'out'}",
               "--engine=hf", f"--task={task}", "--max_steps=1", "--eval_every=0", "--test_size=4"],
              wrap_engine=spy)
    tokenizer, *calls = calls
    # the step's rollouts, then the greedy and the sampled eval
    assert [stop for stop, _ in calls] == [["e"]] * 3
    completions = [c for _, cs in calls for c in cs]
    assert any(c.stop_string == "e" for c in completions) and any(c.truncated for c in completions)
    for c in completions:
        if c.stop_string:
            assert c.stop_string == "e" and "e" in c.text and not c.truncated
            assert "e" not in tokenizer.decode(c.completion_ids[:-1], skip_special_tokens=True)
        else:
            assert "e" not in c.text


# ------------------------------------------------------------ zero-variance groups (R7, no refill)


class LengthScripted:
    """Completion j of prompt p says "1" if p's script has a 1 at j, else "0"; completion j has
    j + 1 tokens, so every row's token count is known."""

    def __init__(self, scripts):
        self.scripts = scripts

    def generate(self, prompts, n, *, seeds, **sampling):
        from rollout import Completion

        return [[Completion(list(p), [7] * (j + 1), str(self.scripts[p[0]][j]), [-1.0] * (j + 1),
                            False) for j in range(n)] for p in prompts]


def three_groups(cfg):
    """(batch, drawn) of one step over three prompts of 4 completions: all right, all wrong, mixed
    (1, 0, 0, 1); completion j has j + 1 tokens."""
    problems = [{"id": str(i)} for i in range(3)]
    train = prepare.Split(Task("test", None, None, lambda c, p: {"correct": float(c == "1")}),
                       problems, [[0], [1], [2]])

    class InOrder:
        def sample(self, k, step=None):
            return list(range(k))

    scripts = {0: [1, 1, 1, 1], 1: [0, 0, 0, 0], 2: [1, 0, 0, 1]}
    batch, drawn, _ = grpo.collect_rollouts(LengthScripted(scripts), InOrder(), train, cfg, 0,
                                            1.0, {})
    return batch, drawn


@pytest.mark.parametrize("drop", [True, False])
def test_the_filter_without_refill_trains_only_on_mixed_groups(drop):
    """Three groups of 4: all right, all wrong, mixed. With dynamic sampling's filter and no refill
    round (DAPO's filter alone) only the mixed group reaches the loss, and the token-mean divides
    by its tokens alone (1 + 2 + 3 + 4 = 10, not 30); the log still counts every group drawn, and
    says which share was dropped."""
    from advantage import group_stats

    cfg = config.load_config(overrides=["--batch_size=12", "--group_size=4", "--reward_timeout=0",
                                        "--adv_zero_std_groups=false",
                                        f"--dynamic_sampling={drop}",
                                        "--dynamic_sampling_rounds=0"])
    batch, drawn = three_groups(cfg)
    advantages = grpo.group_advantages(batch.rewards, 4)
    ub = grpo.prepare_update(batch, advantages, cfg, pad_id=0, device="cpu")
    stats = group_stats(drawn.rewards, 4, correct=drawn.components["correct"])
    metrics = log.rollout_metrics(0, drawn, stats, batch, 0, 0.0, 1.0, cfg)
    assert drawn.problem == [p for p in range(3) for _ in range(4)]  # the log sees all three
    assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)
    if drop:
        assert batch.problem == [2, 2, 2, 2] and ub.num_tokens == 10
        assert metrics["dropped_groups"] == pytest.approx(2 / 3) and metrics["kept/prompts"] == 1
        assert metrics["kept/acc"] == 0.5
    else:
        assert batch.problem == drawn.problem and ub.num_tokens == 30
        assert "dropped_groups" not in metrics
    # the loss of the kept rows: the uniform groups' zero advantages would only have diluted it
    lp = torch.zeros_like(ub.mask)
    loss, _ = grpo.grpo_loss(lp, lp, ub.advantages, ub.mask, cfg, num_tokens=ub.num_tokens,
                             num_seqs=len(batch))
    # a ratio of 1: loss = -sum(A_i x tokens_i) / num_tokens; mixed group A = (+a, -a, -a, +a)
    a = ub.advantages[ub.groups == ub.groups.max()].abs().max().item()
    assert loss.item() == pytest.approx(-a * (1 - 2 - 3 + 4) / ub.num_tokens, abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_groups_with_a_zero_gradient_count_but_are_not_computed(tmp_path, beta):
    """Without dynamic sampling's filter every group stays in the token-mean (30 tokens). With beta
    0 the all-right and all-wrong groups have a zero gradient, so no pass computes them (the mixed
    group's 10 tokens are computed) and the gradient is the one of computing every row; with a KL
    term they have a gradient of their own, and every row is computed."""
    from infra.model_files import build_tiny

    cfg = config.load_config(overrides=["--batch_size=12", "--group_size=4", "--reward_timeout=0",
                                        f"--beta={beta}",
                                        "--dtype=float32"])
    batch, _ = three_groups(cfg)
    idle = grpo.zero_gradient_rows(batch, cfg)
    assert idle == (set(range(8)) if beta == 0 else set())
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(build_tiny(str(tmp_path / "tiny")))
    advantages = grpo.group_advantages(batch.rewards, 4)

    def gradient_and_loss(idle):
        ub = grpo.prepare_update(batch, advantages, cfg, pad_id=0, device="cpu", idle=idle)
        assert ub.num_tokens == 30  # every group counts in the token-mean
        computed = sorted(r for mb in ub.micro for r in mb)
        ref = torch.zeros_like(ub.mask) if beta else None  # a reference other than the policy
        policy.zero_grad()
        loss = grpo.accumulate_gradients(policy, ub, ub.minis[0], grpo.Passes(ref=ref), cfg, 1.0,
                                         SimpleNamespace(beta=beta), {}, None, "update")
        return computed, loss, [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                for p in policy.parameters()]

    computed, loss, grads = gradient_and_loss(idle)
    all_rows, full_loss, full_grads = gradient_and_loss(frozenset())
    assert all_rows == list(range(12))
    assert computed == ([8, 9, 10, 11] if beta == 0 else all_rows)
    assert loss == pytest.approx(full_loss, abs=1e-7)
    assert max((a - b).abs().max().item() for a, b in zip(grads, full_grads)) < 1e-6


def test_the_parity_gap_is_the_mean_over_the_tokens_compared(tmp_path):
    """R2's sampler_logprob_diff_mean over the computed rows' tokens only: with the shortcut the
    all-right and all-wrong groups (20 of 30 tokens) have no pass, so the gap is the mixed group's
    10 tokens' mean |pi_old - sampler| (the sampler said -1.0 for each), not their sum over 30."""
    from transformers import AutoModelForCausalLM

    from infra.model_files import build_tiny

    cfg = config.load_config(overrides=["--batch_size=12", "--group_size=4", "--reward_timeout=0",
                                        "--dtype=float32"])
    batch, _ = three_groups(cfg)
    policy = AutoModelForCausalLM.from_pretrained(build_tiny(str(tmp_path / "tiny")))
    advantages = grpo.group_advantages(batch.rewards, 4)
    ub = grpo.prepare_update(batch, advantages, cfg, pad_id=0, device="cpu",
                             idle=grpo.zero_gradient_rows(batch, cfg))
    parity = []
    grpo.accumulate_gradients(policy, ub, ub.minis[0], grpo.Passes(), cfg, 1.0,
                              SimpleNamespace(beta=0.0), {}, parity, "update")
    logprobs, _ = grpo.batch_logprobs(policy, ub, cfg, 1.0)  # the computed rows: 8 to 11
    mixed = ub.mask[8:].bool()
    want = (logprobs[8:][mixed] + 1.0).abs().mean().item()
    update = grpo.Update(0.0, torch.tensor(0.0), 0, 1, 0, {}, parity)
    metrics = log.step_metrics(update, ub, lr=1e-3)
    assert mixed.sum() == 10 and ub.num_tokens == 30
    assert metrics["sampler_logprob_diff_mean"] == pytest.approx(want, rel=1e-6)
    assert metrics["sampler_logprob_diff_max"] == pytest.approx(
        (logprobs[8:][mixed] + 1.0).abs().max().item(), rel=1e-6)


HALF_FLAT = """from rewards import digits_reward


def problems(split, n, seed):
    return [{"id": f"{split}:{i}"} for i in range(n)]


def prompt(problem):
    return [{"role": "user", "content": "Write only digits: " + problem["id"]}]


def reward(completion, problem):
    if int(problem["id"].split(":")[1]) % 2:  # odd problems: every completion alike
        return {"format": 0.0, "parsed": 1.0, "correct": 0.5}
    return digits_reward(completion)
"""


def test_the_zero_gradient_shortcut_keeps_the_whole_run(tmp_path):
    """skip_zero_gradient on and off give the same run: the same samples and every training
    figure, step after step. Odd problems score every completion alike, so their groups have a zero
    gradient; with a mini-batch per group (4 prompts a step, mini_batches=4) two of a step's four
    are left with no row to compute. AdamW must still step there (zero gradient: its momentum moves
    the weights), as after the full computation; a skipped step diverges from then on. A mini-batch
    is one group, so the computed groups' passes are the same in both runs, bit for bit."""
    from dev.compare_runs import compare

    task = tmp_path / "half_flat.py"
    task.write_text(HALF_FLAT)
    runs = {}
    for skip in (True, False):
        runs[skip] = tmp_path / f"skip_{skip}"
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={runs[skip]}",
                   "--engine=hf", f"--task={task}", "--train_size=4", "--mini_batches=4",
                   "--max_steps=6", "--eval_every=0", "--sample_every=1",
                   f"--skip_zero_gradient={skip}"])
    on, off = (read_jsonl(runs[skip] / "metrics.jsonl") for skip in (True, False))
    assert all(m["zero_gradient_steps"] == 2 for m in on)  # the case under test, every step
    assert all(m["optimizer_steps"] == 4 and m["skipped_nonfinite"] == 0 for m in on + off)
    assert all(m["zero_gradient_steps"] == 0 for m in off)  # off, every row is computed
    assert sum(m["tokens_computed"] for m in on) < sum(m["tokens_computed"] for m in off)
    # what the shortcut changes by design: the work, and the means over the rows it computed
    ignore = {"tokens_computed", "pad_frac", "zero_gradient_steps", "entropy", "ratio",
              "approx_kl_old", "clip_frac_low", "clip_frac_high", "sampler_logprob_diff_mean",
              "sampler_logprob_diff_max"}
    found = compare(runs[True], runs[False], ignore=ignore)
    assert found == {"metrics.jsonl": [], "samples.jsonl": []}


def test_the_phase_list_is_the_loops_order_and_the_readmes():
    """grpo.py's docstring lists the phases of a step; train_step calls them in that order (the
    sampling ones through rollout_phase), and the README shows the same list (one text, not two
    that drift)."""
    import inspect

    listed = grpo.__doc__.split("one named function a phase:\n", 1)[1].split("\n\n", 1)[0]
    listed = [line[4:] for line in listed.splitlines()]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read().split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    assert readme == listed
    step = inspect.getsource(grpo.train_step).split("rollout_phase(run", 1)[1]
    loop = inspect.getsource(grpo.rollout_phase).split("return run.rollouts.next", 1)[1] + step
    def last_call(name):  # end_step: its last call; a whole name (not _update_policy's tail)
        calls = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(name)}\(", loop)]
        return calls[-1] if calls else -1

    where = [last_call(line.split()[0]) for line in listed]
    assert -1 not in where and where == sorted(where), list(zip(listed, where))


def test_the_run_ends_with_a_summary_on_the_console(tmp_path):
    """The final eval of each eval set, steps, wall time, the checkpoint and metrics.jsonl: the
    console's last lines, as metrics.jsonl's last record has them."""
    from infra.log import run_summary

    out = run(tmp_path, "--engine=hf", "--max_steps=2", "--eval_every=0", "--eval_n=2",
              f"--eval_tasks={os.path.join(ROOT, 'tasks', 'digits.py')}")
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    tail = out.strip().splitlines()[-4:]
    assert re.fullmatch(r"done: 2 steps \(2 planned\), 0m\d\ds in this process", tail[0]), tail
    greedy, avg, pass_k = (last[f"eval/{k}"] for k in ("pass@1_greedy", "avg@2", "pass@2"))
    assert tail[1].startswith(f"  final eval: pass@1_greedy {greedy:.3f} | ")
    assert f"avg@2 {avg:.3f}" in tail[1] and f"pass@2 {pass_k:.3f}" in tail[1]
    assert tail[2].startswith("  final eval digits: pass@1_greedy ")  # the extra eval set
    assert tail[3] == (f"  checkpoint {tmp_path / 'ckpt_000002'} | metrics "
                       f"{tmp_path / 'metrics.jsonl'}")
    assert (tmp_path / "ckpt_000002").is_dir()
    cfg = load_config(overrides=["--out_dir=o", "--max_steps=9"])
    assert run_summary(cfg, 4, {"eval/maj@4": 0.5, "eval/updates": 5, "loss": 1.0}, 61.4) == (
        "done: 5 steps (9 planned), 1m01s in this process\n  final eval: maj@4 0.500\n"
        "  checkpoint o/ckpt_000005 | metrics o/metrics.jsonl")


def test_on_policy_distillation_trains_toward_a_teacher_and_refuses_another_vocabulary(tmp_path):
    """teacher=FOLDER: its logprobs of the student's tokens once per batch (time/teacher), the
    per-token reverse KL logged (teacher_kl); with the task reward off, the teacher's signal alone
    moves the policy. A teacher whose tokenizer is not the student's stops the run before it
    trains, saying so."""
    from transformers import AutoTokenizer

    from model import build_tiny

    teacher = build_tiny(str(tmp_path / "teacher"), seed=7)  # the same tokenizer, other weights
    alone = ["--reward_weights=correct:0,format:0", "--unparsed_penalty=0"]
    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path / 'a'}",
               "--engine=hf", "--max_steps=2", "--eval_every=0", f"--teacher={teacher}", *alone])
    metrics = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert all(m["reward"] == 0 and m["teacher_kl"] > 0 and m["time/teacher"] > 0
               and m["grad_norm"] > 0 for m in metrics)
    other = tmp_path / "other"
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<extra>"])
    build_tiny(str(other), seed=7)
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="has another tokenizer .* share one vocabulary"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"),
                   f"--out_dir={tmp_path / 'b'}", "--engine=hf", "--max_steps=2",
                   f"--teacher={other}"])
    assert not os.path.exists(tmp_path / "b" / "metrics.jsonl")
    with pytest.raises(ConfigError, match="model folder .*nowhere not found"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"),
                   f"--out_dir={tmp_path / 'c'}", f"--teacher={tmp_path / 'nowhere'}"])
