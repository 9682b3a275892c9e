"""The pre-flight memory estimate against the device (O6).   pytest tests/test_preflight.py"""

import json
import os

import pytest

from config import ConfigError, load_config
from infra import memory, model_files, preflight
from infra.memory import count_params, estimate_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_count_params_hand_worked():
    # tiny: 2 layers x (attn 2*64*64 + 2*64*64 + mlp 3*64*128) + tied embedding 512*64
    assert count_params(memory.SHAPES["tiny"]) == 2 * (4 * 64 * 64 + 3 * 64 * 128) + 512 * 64
    # Qwen2.5-3B-Instruct has 3.09B parameters (its model card)
    assert (count_params(memory.SHAPES["Qwen/Qwen2.5-3B-Instruct"]) / 1e9
            == pytest.approx(3.09, abs=0.01))


def test_memory_estimate_hand_worked():
    cfg = load_config(overrides=["--micro_batch_tokens=2048", "--dtype=float32", "--beta=0"])
    est = estimate_memory(cfg, memory.SHAPES["tiny"])
    n = count_params(memory.SHAPES["tiny"])
    gib = 2**30
    assert est["weights"] * gib == 4 * n and est["grads"] * gib == 4 * n
    assert est["optimizer"] * gib == 8 * n and est["adam_step"] * gib == 4 * n
    assert est["weight_copies"] == 0  # fp32: autocast copies nothing
    # tiny: h 64, kv 64, i 128, 2 layers, V 512; fp32 (4 bytes), no checkpointing: each layer keeps
    # per token 16 h (norms) + 5 x 4 h (attention) + 4 x 4 i (MLP); the prompt pass keeps its keys
    # and values (2 x 64 x 4 bytes a layer)
    layer = 16 * 64 + 5 * 4 * 64 + 4 * 4 * 128
    assert est["activations"] * gib == 2 * layer * 2048 + 2 * 64 * 4 * 2 * 2048
    # the (b, T, V) fp32 logits and their gradient; the logprobs' 1024-position chunk (3 x fp32)
    assert est["head"] * gib == 2 * 4 * 2048 * 512 + 12 * 1024 * 512
    assert "reference" not in est  # beta = 0: no reference model (L4)
    with_ref = estimate_memory(load_config(overrides=["--beta=0.001"]), memory.SHAPES["tiny"])
    assert with_ref["reference"] * gib == 4 * n  # fp32, as prepare.build_models loads it
    # L9: a teacher is held as the reference is, in its own shape (tiny's)
    taught = estimate_memory(load_config(overrides=["--teacher=tiny"]), memory.SHAPES["tiny"])
    assert taught["teacher"] * gib == 4 * n
    assert "teacher" not in estimate_memory(load_config(overrides=["--teacher=tiny",
                                                                   "--ref_offload=true"]),
                                            memory.SHAPES["tiny"])
    ckpt_cfg = load_config(overrides=["--micro_batch_tokens=2048", "--dtype=float32", "--beta=0",
                                      "--gradient_checkpointing=true"])
    ckpt = estimate_memory(ckpt_cfg, memory.SHAPES["tiny"])
    # the layers' fp32 inputs, one layer recomputed, the prompt keys and values
    assert ckpt["activations"] * gib == 4 * 64 * 2 * 2048 + layer * 2048 + 2 * 64 * 4 * 2 * 2048


def test_memory_estimate_of_the_3b_run_hand_worked(capsys):
    """config/countdown_3b.py on one GPU: fp32 weights and reference, bf16 autocast, checkpointing,
    the fused head."""
    gib = 2**30
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    cfg = load_config(path)
    est = estimate_memory(cfg, memory.SHAPES[cfg.model])
    # 36 x (2 x 2048^2 + 2 x 2048 x 256 + 3 x 2048 x 11008) + 151936 x 2048 (tied)
    n = 3_085_697_024
    assert count_params(memory.SHAPES[cfg.model]) == n
    per_param = {"weights": 4, "reference": 4, "grads": 4, "optimizer": 8, "adam_step": 4}
    for key, bytes_per_param in per_param.items():
        assert est[key] * gib == bytes_per_param * n, key
    layers = 36 * (2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 11008)
    assert est["weight_copies"] * gib == 2 * layers  # bf16 copies of every decoder layer's weights
    # fp32 layer inputs; one layer: 16 h + 5 bf16 casts of h + 5 x 2 h (attention) + 4 x 2 i (MLP);
    # the prompt keys and values in bf16
    one_layer = 16 * 2048 + 5 * 2 * 2048 + 5 * 2 * 2048 + 4 * 2 * 11008
    assert est["activations"] * gib == (4 * 2048 * 36 + one_layer + 2 * 256 * 2 * 36) * 16384
    # the head's bf16 copy, its fp32 gradient, 883 positions (2^27 logits) x V x (3 x 4 + 2) bytes
    assert est["head"] * gib == 2 * 151936 * 2048 + 4 * 151936 * 2048 + 14 * 883 * 151936
    assert memory.resident_memory(est) * gib == 16 * n  # weights, reference, moments
    micro_batch = 2 * layers + est["activations"] * gib + est["head"] * gib
    peak = 20 * n + max(4 * n, micro_batch)  # + the gradients
    assert memory.update_peak(est) * gib == pytest.approx(peak, rel=1e-12)
    assert 73 < peak / gib < 74
    preflight.preflight(load_config(path), device_gb=80)
    table = capsys.readouterr().out
    assert "  weights         11.50  fp32 master weights (model.load_policy)" in table
    assert "  update peak     73.66  resident + grads + max(adam_step, weight_copies" in table


def test_lora_and_offloaded_reference_terms():
    """A LoRA base is loaded in fp32 like any policy; ref_offload keeps the reference on the CPU."""
    gib, shape = 2**30, memory.SHAPES["Qwen/Qwen2.5-3B-Instruct"]
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    n, lora = count_params(shape), 16 * 36 * (4 * 2048 + 2 * (2048 + 256) + 3 * (2048 + 11008))
    est = estimate_memory(load_config(path, ["--lora_rank=16"]), shape)
    assert est["weights"] * gib == 4 * (n + lora) and est["optimizer"] * gib == 8 * lora
    assert "reference" not in est  # the base with its adapters disabled
    assert "reference" not in estimate_memory(load_config(path, ["--ref_offload=true"]), shape)


def test_memory_check_against_the_device(tmp_path, capsys):
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    est = preflight.preflight(load_config(path), device_gb=80)
    assert 11 < est["weights"] < 12  # 3.09B fp32 master weights
    assert "update peak" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="one update needs .* lower micro_batch_tokens"):
        preflight.preflight(load_config(path), device_gb=40)
    with pytest.raises(ConfigError, match="lower gpu_memory_utilization"):
        preflight.preflight(load_config(path, ["--gpu_memory_utilization=0.6"]), device_gb=80)


def test_the_24gb_run_file_fits_a_24gb_device(capsys):
    """config/countdown_3b_24gb.py passes pre-flight for 24 GiB: the update and, beside it asleep,
    vLLM's share with the trainer's resident state; the full fine-tuning run file does not."""
    path = os.path.join(ROOT, "config", "countdown_3b_24gb.py")
    est = preflight.preflight(load_config(path), device_gb=24)
    assert memory.update_peak(est) < 0.95 * 24
    assert 0.35 * 24 + memory.resident_memory(est) < 0.95 * 24
    assert "pre-flight: device 24.0 GiB" in capsys.readouterr().out
    with pytest.raises(ConfigError):
        preflight.preflight(load_config(os.path.join(ROOT, "config", "countdown_3b.py")),
                            device_gb=24)


def test_unknown_model_skips_the_estimate_with_a_note(capsys):
    assert preflight.preflight(load_config(overrides=["--model=/nonexistent/model"])) is None
    assert "memory estimate skipped" in capsys.readouterr().out


def test_model_shape_from_a_local_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 8, '
                                          '"intermediate_size": 16, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')
    shape = memory.model_shape(str(tmp_path))
    assert count_params(shape) == 4 * 8 * 8 + 3 * 8 * 16 + 2 * 10 * 8  # untied by default


def test_fsdp_memory_estimate_is_sharded(monkeypatch):
    gib, shape = 2**30, memory.SHAPES["Qwen/Qwen2.5-3B-Instruct"]
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    one = estimate_memory(load_config(path), shape)
    monkeypatch.setenv("WORLD_SIZE", "8")
    fsdp = estimate_memory(load_config(path), shape)
    ddp = estimate_memory(load_config(path, ["--parallel=ddp"]), shape)
    for k in ("weights", "optimizer", "grads", "reference", "adam_step"):
        assert fsdp[k] == pytest.approx(one[k] / 8) and ddp[k] == one[k]
    assert ddp["ddp_buckets"] == one["grads"] and "ddp_buckets" not in fsdp
    for k in ("activations", "head", "weight_copies"):
        assert ddp[k] == one[k]
    # each rank still runs whole micro-batches, on weights FSDP2 gathers in bf16: a bf16 residual
    # stream, nothing for autocast to cast; the root (tied embeddings and head) and two layers
    one_layer = 16 * 2048 + 5 * 2 * 2048 + 4 * 2 * 11008
    assert fsdp["activations"] * gib == (2 * 2048 * 36 + one_layer + 2 * 256 * 2 * 36) * 16384
    layer = 2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 11008
    assert fsdp["weight_copies"] * gib == 2 * (151936 * 2048 + 2 * layer)
    # the gathered head is bf16 already: no copy, the fp32 gradient and the chunks
    assert fsdp["head"] * gib == 4 * 151936 * 2048 + 14 * 883 * 151936
    # sharded over 8 ranks, the update that one process cannot fit on a 40 GB card fits
    preflight.preflight(load_config(path), device_gb=40)


def test_a_gpu_sized_run_on_a_cpu_asks_for_device_cpu(monkeypatch):
    monkeypatch.setattr(preflight, "device_memory_gib", lambda device_gb=None: None)  # no GPU here
    path = os.path.join(ROOT, "config", "countdown_3b.py")
    with pytest.raises(ConfigError,
                       match=r"needs ~\d+ GiB: it is sized for a GPU.*pass --device=cpu"):
        preflight.preflight(load_config(path))
    # asked for explicitly: it starts
    assert preflight.preflight(load_config(path, ["--device=cpu"]))["weights"] > 11
    assert preflight.preflight(load_config())["weights"] < 1  # the default run is CPU-sized


def test_preflight_cli_prints_the_table():
    """python -m infra.preflight --config ... prints the table (with a device named, the fit)."""
    import subprocess
    import sys

    path = os.path.join(ROOT, "config", "countdown_3b.py")
    cmd = [sys.executable, "-m", "infra.preflight", "--config", path]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU named: the table alone
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    est = estimate_memory(load_config(path), memory.SHAPES["Qwen/Qwen2.5-3B-Instruct"])
    lines = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    rows = {line[2:16].strip(): float(line[16:23]) for line in lines}
    assert rows.pop("update peak") == pytest.approx(memory.update_peak(est), abs=0.005)
    assert rows.pop("resident") == pytest.approx(memory.resident_memory(est), abs=0.005)
    assert rows == pytest.approx(est, abs=0.005)
    small = subprocess.run(cmd + ["--device_memory_gb=40", "--device=cpu"], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
    assert small.returncode == 1, small.stderr  # --device is a setting, not the flag cut short
    assert "device                   = 'cpu'" in small.stdout
    assert "config error: one update needs ~73.7 GiB of 40.0" in small.stdout
    nan = subprocess.run(cmd + ["--device_memory_gb=nan"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert nan.returncode == 2 and "invalid gib value: 'nan'" in nan.stderr


def test_a_context_beyond_the_models_fails(tmp_path):
    long = ["--max_prompt_len=8000", "--max_completion_len=1000", "--micro_batch_tokens=9000",
            "--device=cpu"]
    with pytest.raises(ConfigError, match="= 9000 tokens, beyond smollm2-135m.s context of 8192"):
        preflight.preflight(load_config(overrides=long))
    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
             "num_attention_heads": 2, "max_position_embeddings": 300}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    with pytest.raises(ConfigError, match="256 \\+ 64 = 320 tokens, beyond .*'s context of 300"):
        preflight.preflight(load_config(overrides=[f"--model={tmp_path}"]))
    preflight.preflight(load_config(overrides=[f"--model={tmp_path}", "--max_completion_len=44"]))
    # the tiny test model too (its positions: 1024, as build_tiny makes it)
    tiny = ["--model=tiny", "--max_prompt_len=1000", "--max_completion_len=64",
            "--micro_batch_tokens=1100"]
    with pytest.raises(ConfigError, match="= 1064 tokens, beyond tiny's context of 1024"):
        preflight.preflight(load_config(overrides=tiny))
    assert memory.SHAPES["tiny"]["max_position_embeddings"] == 1024


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


def test_a_weight_ring_the_machine_cannot_hold_fails_before_a_model_loads(monkeypatch, tmp_path):
    """async_rollouts keeps max_staleness + 1 fp32 copies of the pushed weights in shared memory:
    the size is the real ring's, and one past the free memory fails with what to lower."""
    from model import build_tiny, load_policy, push_weights_iter

    cfg = load_config(overrides=["--model=tiny", "--engine=hf", "--async_rollouts=true",
                                 "--max_staleness=3"])
    _, policy = load_policy(cfg, build_tiny(str(tmp_path / "tiny")), "cpu")
    pushed = sum(t.numel() for _, t in push_weights_iter(policy))
    # the estimate leaves out norms; tied: lm_head is pushed as a tensor of its own
    built = {**memory.SHAPES["tiny"], "vocab_size": policy.config.vocab_size}
    assert count_params(built) + built["vocab_size"] * 64 == pytest.approx(pushed, rel=0.01)
    ring = 4 * (count_params(memory.SHAPES["tiny"]) + 512 * 64) * 4 / 2**30  # 4 copies, 4 bytes
    monkeypatch.setattr(preflight, "available_memory_gib", lambda: 0.99 * ring)
    monkeypatch.setattr(preflight, "shared_memory_gib", lambda: 1e6)
    with pytest.raises(ConfigError, match=r"max_staleness=3 keeps 4 fp32 copies .* lower "
                                          "max_staleness"):
        preflight.preflight(cfg)
    monkeypatch.setattr(preflight, "available_memory_gib", lambda: 1.01 * ring)
    preflight.preflight(cfg)
    monkeypatch.setattr(preflight, "shared_memory_gib", lambda: 0.99 * ring)  # a small /dev/shm
    with pytest.raises(ConfigError, match="RAM and /dev/shm"):
        preflight.preflight(cfg)
    # not async: no ring
    preflight.preflight(load_config(overrides=["--model=tiny", "--engine=hf", "--max_staleness=3"]))
    with pytest.raises(ConfigError, match=r"max_staleness=1000000000 keeps"):  # this machine
        preflight.preflight(load_config(overrides=["--model=tiny", "--engine=hf",
                                                   "--async_rollouts=true",
                                                   "--max_staleness=1000000000"]))


# ---------------------------------------------------------------- the model's source, the library


def test_missing_or_broken_model_folders_fail_clearly(tmp_path, monkeypatch):
    from infra.model_files import check_model_source

    with pytest.raises(ConfigError, match="not found"):
        check_model_source("./no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_model_source(str(tmp_path / "empty"))
    monkeypatch.setattr(model_files, "hub_cached", lambda name: True)
    # a hub name in the local cache is left to the loader
    check_model_source("Qwen/Qwen2.5-3B-Instruct")


def test_a_hub_name_that_cannot_be_fetched_is_a_config_error(monkeypatch):
    from infra.model_files import check_model_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet
    fetch_it = "not in the Hugging Face cache.*hf download Qwen/Qwen2.5-3B-Instruct"
    with pytest.raises(ConfigError, match=fetch_it):
        check_model_source("Qwen/Qwen2.5-3B-Instruct")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    # nothing listens on the discard port: unreachable
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="the hub cannot be reached"):
        check_model_source("Qwen/Qwen2.5-3B-Instruct")


def test_checkpointing_with_shared_prompts_needs_the_cache_switch(tmp_path, monkeypatch):
    """Before transformers 5.15.0 a checkpointed decoder layer drops its cache argument (each prompt
    once would then be wrong: test_perf.py); pre-flight fails with the fix, before any model
    loads. Either setting off needs no switch."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from run import prepare

    # the layer class of transformers 5.14.1
    monkeypatch.delattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
    ckpt = load_config(overrides=["--gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match=r"shared_prompt needs transformers >= 5.15.0"):
        preflight.check_cache_switch(ckpt)
    with pytest.raises(ConfigError, match=r"shared_prompt needs transformers >= 5.15.0"):
        preflight.preflight(ckpt)
    tiny = ["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}"]
    fix = r"--gradient_checkpointing=false or --shared_prompt=false"
    with pytest.raises(ConfigError, match=fix):
        prepare.prepare_run([*tiny, "--gradient_checkpointing=true"])
    assert not os.listdir(tmp_path)  # nothing built, nothing written
    preflight.check_cache_switch(load_config(overrides=["--gradient_checkpointing=true",
                                                        "--shared_prompt=false"]))
    preflight.check_cache_switch(load_config())
    monkeypatch.undo()
    preflight.check_cache_switch(ckpt)  # this transformers has the switch
