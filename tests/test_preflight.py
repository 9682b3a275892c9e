"""The pre-flight memory estimate against the device (SPEC O6).   pytest tests/test_preflight.py"""

import json
import os

import pytest

import preflight
from config import ConfigError, load_config
from preflight import count_params, estimate_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_count_params_hand_worked():
    # tiny: 2 layers x (attn 2*64*64 + 2*64*64 + mlp 3*64*128) + tied embedding 512*64
    assert count_params(preflight.SHAPES["tiny"]) == 2 * (4 * 64 * 64 + 3 * 64 * 128) + 512 * 64
    # Qwen2.5-3B-Instruct has 3.09B parameters (its model card)
    assert count_params(preflight.SHAPES["Qwen/Qwen2.5-3B-Instruct"]) / 1e9 == pytest.approx(3.09, abs=0.01)


def test_memory_estimate_hand_worked():
    cfg = load_config(overrides=["--micro_batch_tokens=2048", "--dtype=float32", "--beta=0"])
    est = estimate_memory(cfg, preflight.SHAPES["tiny"])
    n = count_params(preflight.SHAPES["tiny"])
    gib = 2**30
    assert est["weights"] * gib == 4 * n and est["grads"] * gib == 4 * n and est["optimizer"] * gib == 8 * n
    # 2 layers x 17 x 64 elements per token at 4 bytes + logits and their grad at 2 x 4 bytes x 512
    assert est["activations"] * gib == 2048 * (4 * 17 * 64 * 2 + 8 * 512)
    assert "reference" not in est  # beta = 0: no reference model (L4)
    assert "reference" in estimate_memory(load_config(overrides=["--beta=0.001"]), preflight.SHAPES["tiny"])
    ckpt_cfg = load_config(overrides=["--micro_batch_tokens=2048", "--dtype=float32", "--beta=0",
                                      "--gradient_checkpointing=true"])
    ckpt = estimate_memory(ckpt_cfg, preflight.SHAPES["tiny"])
    assert ckpt["activations"] < est["activations"]


def test_memory_check_against_the_device(tmp_path, capsys):
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    est = preflight.preflight(load_config(path, ["--device_memory_gb=80"]))
    assert 11 < est["weights"] < 12  # 3.09B fp32 master weights
    assert "update peak" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="one update needs .* lower micro_batch_tokens"):
        preflight.preflight(load_config(path, ["--device_memory_gb=40"]))
    with pytest.raises(ConfigError, match="lower gpu_memory_utilization"):
        preflight.preflight(load_config(path, ["--device_memory_gb=80", "--gpu_memory_utilization=0.6"]))


def test_unknown_model_skips_the_estimate_with_a_note(capsys):
    assert preflight.preflight(load_config(overrides=["--model=/nonexistent/model"])) is None
    assert "memory estimate skipped" in capsys.readouterr().out


def test_model_shape_from_a_local_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2}')
    shape = preflight.model_shape(str(tmp_path))
    assert count_params(shape) == 4 * 8 * 8 + 3 * 8 * 16 + 2 * 10 * 8  # untied by default


def test_fsdp_memory_estimate_is_sharded(monkeypatch):
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    one = estimate_memory(load_config(path), preflight.SHAPES["Qwen/Qwen2.5-3B-Instruct"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    fsdp = estimate_memory(load_config(path), preflight.SHAPES["Qwen/Qwen2.5-3B-Instruct"])
    ddp = estimate_memory(load_config(path, ["--parallel=ddp"]), preflight.SHAPES["Qwen/Qwen2.5-3B-Instruct"])
    for k in ("weights", "optimizer", "grads", "reference"):
        assert fsdp[k] == pytest.approx(one[k] / 8) and ddp[k] == one[k]
    assert fsdp["activations"] == one["activations"]  # each rank still runs whole micro-batches
    # sharded over 8 ranks, the update that one process cannot fit on a 40 GB card fits
    preflight.preflight(load_config(path, ["--device_memory_gb=40"]))


def test_a_gpu_sized_run_on_a_cpu_asks_for_device_cpu(monkeypatch):
    monkeypatch.setattr(preflight, "device_memory_gib", lambda cfg: None)  # a machine without a GPU
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    with pytest.raises(ConfigError, match=r"needs ~\d+ GiB: it is sized for a GPU.*pass --device=cpu"):
        preflight.preflight(load_config(path))
    assert preflight.preflight(load_config(path, ["--device=cpu"]))["weights"] > 11  # asked for explicitly: it starts
    assert preflight.preflight(load_config())["weights"] < 1  # the default run is CPU-sized


def test_a_context_beyond_the_models_fails(tmp_path):
    long = ["--max_prompt_len=8000", "--max_completion_len=1000", "--micro_batch_tokens=9000",
            "--device=cpu"]
    with pytest.raises(ConfigError, match="= 9000 tokens, beyond smollm2-135m.s context of 8192"):
        preflight.preflight(load_config(overrides=long))
    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
             "num_attention_heads": 2, "max_position_embeddings": 300}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    with pytest.raises(ConfigError, match="256 \\+ 96 = 352 tokens, beyond .*'s context of 300"):
        preflight.preflight(load_config(overrides=[f"--model={tmp_path}"]))
    preflight.preflight(load_config(overrides=[f"--model={tmp_path}", "--max_completion_len=44"]))


def test_a_kv_cache_the_machine_cannot_give_fails(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu_vllm = ["--engine=vllm", "--device=cpu"]
    with pytest.raises(ConfigError, match="vllm_cpu_kv_cache_gb=100000: vLLM takes that many GiB"):
        preflight.preflight(load_config(overrides=[*cpu_vllm, "--vllm_cpu_kv_cache_gb=100000"]))
    monkeypatch.setattr(preflight, "available_memory_gib", lambda: 3.5)
    with pytest.raises(ConfigError, match="kv_cache_gb=4: .* this machine has 3.5 GiB free"):
        preflight.preflight(load_config(overrides=[*cpu_vllm, "--vllm_cpu_kv_cache_gb=4"]))
    preflight.preflight(load_config(overrides=[*cpu_vllm, "--vllm_cpu_kv_cache_gb=3"]))
    preflight.preflight(load_config(overrides=["--engine=hf", "--device=cpu",
                                               "--vllm_cpu_kv_cache_gb=4"]))
