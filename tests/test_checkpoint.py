"""Checkpoints read back: the training state, the RNG states.   pytest tests/test_checkpoint.py

A run's checkpoints and out_dir end to end (save, kill, resume, changed settings, the lock) are in
test_grpo.py, where grpo.py writes and reads them.
"""

import json
import os
import random

import torch

from config import config_from_argv
from data.sampler import PromptSampler
from infra import checkpoint, parallel
from infra.checkpoint import load_checkpoint, rng_states

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "config", "tiny.py")


def test_resume_on_fewer_gpus_restores_this_devices_cuda_rng(tmp_path, monkeypatch):
    """rng.pt from a 4-GPU run (rank 0 saved every visible device's CUDA RNG), resumed on one GPU:
    only this device's state is set (indexing the others crashed), and a save keeps only its own."""
    cfg = config_from_argv(["--config", TINY, f"--out_dir={tmp_path}"])
    policy = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(policy.parameters())
    sampler = PromptSampler(10, cfg.seed)
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": states}
    torch.save(rng, tmp_path / "rng.pt")
    torch.save(parallel.full_state(policy, optimizer)[1], tmp_path / "optimizer.pt")
    trainer_state = {"step": 3, "beta": 0.0, "kl_history": [], "nonfinite_in_a_row": 0,
                     "sampler": sampler.state_dict()}
    (tmp_path / "trainer_state.json").write_text(json.dumps(trainer_state))
    restored = []

    def set_rng_state(state, device="cuda"):  # one GPU: device 0 (the current one) only
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        restored.append(state)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    # torch.cuda.set_rng_state_all calls this one
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)
    assert load_checkpoint(str(tmp_path), cfg, policy, None, optimizer, sampler).step == 3
    assert len(restored) == 1 and torch.equal(restored[0], states[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[2])  # this GPU's
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    assert torch.equal(rng_states()["cuda"], states[2])


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before(tmp_path, capsys):
    """A tiny run saved at steps 2 and 4; ckpt_000004's optimizer.pt then cut off (a copy that
    stopped), or its weights: the resume goes on from step 2, saying why, and the logs are cut back
    to it; only when no checkpoint is whole is it an error."""
    import grpo
    from infra.checkpoint import damaged

    out = tmp_path / "run"
    common = ["--config", TINY, f"--out_dir={out}", "--engine=hf", "--save_every=2",
              "--eval_every=0"]
    grpo.main([*common, "--max_steps=4"])
    assert damaged(str(out / "ckpt_000004")) is None
    optimizer = out / "ckpt_000004" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    assert damaged(str(out / "ckpt_000004")) == "optimizer.pt is not whole (cut off or overwritten)"
    capsys.readouterr()
    grpo.main([*common, "--max_steps=5", "--resume=true"])
    said = capsys.readouterr().out
    assert "ckpt_000004 is damaged (optimizer.pt is not whole" in said and "at step 2" in said
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]  # 2 and 3 again, then 4
    weights = out / "ckpt_000005" / "model.safetensors"  # the last two are kept: 4 and 5
    weights.write_bytes(weights.read_bytes()[:-10])
    assert damaged(str(out / "ckpt_000005")) == "model.safetensors is cut off"


def test_a_log_line_whose_step_is_not_a_whole_number_is_named(tmp_path):
    import pytest

    from config import ConfigError
    from infra.checkpoint import truncate_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 0}\n{"step": "1"}\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"line 2: step '1' is not a whole number"):
        truncate_log(str(log), 2)


def test_a_path_setting_written_two_ways_is_the_same_run(tmp_path, monkeypatch):
    """task=./tasks/digits.py and task=tasks/digits.py name one file: no change on resume."""
    from config import load_config
    from infra.checkpoint import changed_settings

    monkeypatch.chdir(ROOT)
    saved = json.loads(json.dumps(vars(load_config(overrides=["--task=./tasks/digits.py"]))))
    assert changed_settings(load_config(overrides=["--task=tasks/digits.py"]), saved) == []
    other = load_config(overrides=["--task=tasks/larger.py"])
    assert changed_settings(other, saved) == [("task", "./tasks/digits.py", "tasks/larger.py")]


def test_every_setting_that_changes_what_is_learned_is_a_run_setting():
    """RUN_SETTINGS is every setting but FREE_SETTINGS (a new setting is the run's unless named
    there): the loss's and the advantage's settings, the reward's, the sampling's, the data's, the
    optimizer's are all in it; the free ones are settings, none misspelt."""
    import dataclasses

    import config
    from advantage import AdvantageSettings
    from config import load_config
    from infra.checkpoint import FREE_SETTINGS, RUN_SETTINGS, changed_settings
    from loss import LossSettings

    names = {f.name for f in dataclasses.fields(config.Config) if f.init}
    assert set(FREE_SETTINGS) <= names
    fields = dataclasses.fields(LossSettings) + dataclasses.fields(AdvantageSettings)
    objective = {f.name for f in fields}
    learned = {*objective, *config.REWARD_KEYS, "reward_weights", "model", "init_from", "lora_rank",
               "task", "data_path", "seed", "group_size", "batch_size", "num_iterations",
               "mini_batches", "temperature", "top_p", "top_k", "beta", "kl_estimator", "lr",
               "warmup_steps", "min_lr_ratio", "weight_decay", "adam_betas", "grad_clip",
               "dynamic_sampling", "dynamic_sampling_rounds", "mask_truncated", "is_correction",
               "is_cap", "is_floor", "old_logprobs", "async_rollouts", "max_staleness",
               "tools", "max_turns", "env_reward", "adaptive_kl", "kl_window", "kl_band",
               "data_seed", "train_size", "data_name", "data_columns", "curriculum",
               "curriculum_ramp_steps",
               "temperature_end", "ref_refresh_steps", "lora_alpha", "length_reward",
               "adv_per_component"}
    assert set(checkpoint.DELETED_RUN_SETTINGS) <= set(config.DELETED)
    assert learned <= set(RUN_SETTINGS), learned - set(RUN_SETTINGS)
    # a resume names a changed objective setting, and lets a free one change
    saved = json.loads(json.dumps(dataclasses.asdict(load_config())))
    changed = load_config(overrides=["--adv_clip=2", "--micro_batch_tokens=512"])
    assert changed_settings(changed, saved) == [("adv_clip", 0.0, 2.0)]
    # a deleted setting saved off its old default is named with what stands for it; at it, not
    assert changed_settings(load_config(), {**saved, "is_seq_cap": 3.0, "kl_up": 1.2,
                                            "format_weight": 0.1, "length_penalty": 0.05,
                                            "adv_std_floor": 1e-4, "curriculum_bands": [0.2, 0.8],
                                            "curriculum_hard_below": 0.2}) == []
    steeper = changed_settings(load_config(), {**saved, "length_penalty": 0.1})
    assert [(k, was) for k, was, _ in steeper] == [("length_penalty", 0.1)]
    assert "0.05 per 32 tokens" in steeper[0][2]
    bands = changed_settings(load_config(), {**saved, "curriculum_bands": [0.3, 0.8]})
    assert [(k, was) for k, was, _ in bands] == [("curriculum_bands", [0.3, 0.8])]
    # one held by another setting now is compared as that setting (config.upgrade)
    assert changed_settings(load_config(), {**saved, "format_weight": 0.2}) == [
        ("reward_weights", "format:0.2", "")]
    assert changed_settings(load_config(overrides=["--reward_weights=format:0.20"]),
                            {**saved, "format_weight": 0.2}) == []
    # an older reward_weights' format entry did nothing (format_weight weighed it): not the run's
    assert changed_settings(load_config(overrides=["--reward_weights=format:0.5"]), {
        **saved, "format_weight": 0.1, "reward_weights": "format:0.5,parsed:1"}) == [
        ("reward_weights", "", "format:0.5")]
    before_bands = {k: v for k, v in saved.items() if k != "kl_band"}  # as an older version saved
    assert changed_settings(load_config(overrides=["--kl_band=0.01,0.1"]),
                            {**before_bands, "kl_low": 0.02, "kl_high": 0.08}) == [
        ("kl_band", [0.02, 0.08], [0.01, 0.1])]
    # an older sequence-level run's cap (is_seq_cap, default 3) is is_cap's now (default 2)
    sequence = json.loads(json.dumps(dataclasses.asdict(load_config(
        overrides=["--is_correction=sequence_truncate"]))))
    older = {**sequence, "is_correction": "sequence", "is_mode": "truncate", "is_seq_cap": 3.0}
    now = load_config(overrides=["--is_correction=sequence_truncate"])
    assert changed_settings(now, older) == [("is_cap", 3.0, 2.0)]
    capped = load_config(overrides=["--is_correction=sequence_truncate", "--is_cap=3"])
    assert changed_settings(capped, older) == []
    # an older run's level and is_mode are compared as the one is_correction that names both
    token_mask = {**saved, "is_correction": "token", "is_mode": "mask"}
    assert changed_settings(load_config(overrides=["--is_correction=token_truncate"]),
                            token_mask) == [("is_correction", "token_mask", "token_truncate")]
    assert changed_settings(load_config(overrides=["--is_correction=token_mask"]), token_mask) == []
    assert changed_settings(load_config(), {**saved, "is_seq_cap": 5.0}) == []  # unused: IS off
    assert changed_settings(load_config(), {**saved, "drop_zero_std_groups": True}) == [
        ("drop_zero_std_groups", True, "deleted: " + config.DELETED["drop_zero_std_groups"][1])]


def test_a_changed_task_option_is_a_changed_run():
    """The task file's options (its OPTIONS: the problems' difficulty, the verifier's) are all the
    run's, saved as task_options or, by an older version, beside the settings."""
    import dataclasses

    from config import load_config
    from infra.checkpoint import changed_settings

    saved = json.loads(json.dumps(dataclasses.asdict(load_config(overrides=["--task=countdown"]))))
    same = load_config(overrides=["--task=countdown", "--countdown_numbers=3,4"])
    assert changed_settings(same, saved) == []  # the default, written out
    harder = load_config(overrides=["--task=countdown", "--countdown_max_number=200"])
    assert changed_settings(harder, saved) == [("countdown_max_number", 99, 200)]
    older = {**{k: v for k, v in saved.items() if k != "task_options"}, **saved["task_options"]}
    assert changed_settings(harder, older) == [("countdown_max_number", 99, 200)]
    # an eval set's options are free, as eval_tasks is
    evals = json.loads(json.dumps(dataclasses.asdict(load_config(
        overrides=["--eval_tasks=countdown", "--countdown_numbers=5"]))))
    other = load_config(overrides=["--eval_tasks=countdown", "--countdown_numbers=4"])
    assert changed_settings(other, evals) == []
