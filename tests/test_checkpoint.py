"""Checkpoints read back: the training state, the RNG states.   pytest tests/test_checkpoint.py

A run's checkpoints and out_dir end to end (save, kill, resume, changed settings, the lock) are in
test_grpo.py, where grpo.py writes and reads them.
"""

import json
import os
import random

import torch

import parallel
from checkpoint import load_checkpoint, rng_states
from config import config_from_argv
from data.sampler import PromptSampler

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
