"""Checkpoints and the run's ownership of its out_dir: save, resume, keep the logs in step.

A checkpoint is one folder, ckpt_<step>: the policy's weights as save_pretrained writes them (the
LoRA adapter only, with LoRA), the tokenizer, optimizer.pt, rng.pt, trainer_state.json (the step,
beta, the sampler's state) and grpo_config.json. It is written to a temp folder and renamed, so a
kill at any moment leaves the last one whole, and a resume continues the same run, data order
included (D3).

The saved config (save_config, load_saved) is JSON of every setting, beside the metrics and in
every checkpoint; one an older version saved is read in today's settings (upgrade).
"""

import dataclasses
import errno
import fcntl
import glob
import json
import os
import random
import shutil
import socket
import zipfile
from dataclasses import dataclass

import torch

from config import (
    DELETED,
    MERGED,
    Config,
    ConfigError,
    coerce,
    declared_options,
    derive,
    pairs,
    reward_weights,
    run_options,
    task_parts,
    task_path,
)
from infra import parallel

# ---------------------------------------------------------------- the saved config


def save_config(cfg, path):
    """Write the final config as JSON (beside metrics and in every checkpoint)."""
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)


def upgrade(saved):
    """A config an older version saved (save_config's JSON) in today's settings: a deleted
    setting's value moves to the setting that holds it now (a weight only off its old default,
    which is today's)."""
    saved = dict(saved)
    if "is_seq_cap" in saved and saved.get("is_correction") == "sequence":  # a completion's rho
        saved["is_cap"] = saved["is_seq_cap"]  # is capped by is_cap now
    if saved.get("is_correction") in ("token", "sequence"):  # the level and is_mode, one name now
        saved["is_correction"] += "_" + saved.get("is_mode", "truncate")
    old = [k for k in ("correct_weight", "format_weight") if k in saved]
    if old:  # reward_weights could not weigh correct, format or parsed then: those did nothing
        weights = {k: v for k, v in pairs("reward_weights", saved.get("reward_weights", "")).items()
                   if k not in ("correct", "format", "parsed")}
        weights.update({k.removesuffix("_weight"): saved[k] for k in old
                        if saved[k] != DELETED[k][0]})
        saved["reward_weights"] = ",".join(f"{k}:{v}" for k, v in weights.items())
    if "env_timeout" in saved and not saved.get("tools"):  # the deadline an episode had, at its
        saved["tool_timeout"] = saved["env_timeout"]  # default too (tool_timeout did nothing then)
    for now, (first, second) in MERGED.items():
        if first in saved:
            saved[now] = [saved[first], saved[second]]
    return saved


def load_saved(path):
    """The Config a run saved with save_config (e.g. out/run/config.json), derived again."""
    with open(path) as f:
        saved = upgrade(json.load(f))
    cfg = Config()
    for f in dataclasses.fields(Config):
        # a dict under a settable name is an older version's derived value
        if f.init and f.name in saved and not isinstance(saved[f.name], dict):
            setattr(cfg, f.name, coerce(f.name, saved[f.name], f.default))
    options = run_options(cfg)
    given = saved_task_options(saved, options)
    cfg.task_options = {k: coerce(k, given.get(k, v), v) for k, v in options.items()}
    return derive(cfg)


def saved_task_options(saved, names):
    """The task options in a saved config (save_config's JSON): its task_options, or, saved by an
    older version, those of `names` beside the settings."""
    return saved.get("task_options") or {k: saved[k] for k in names if k in saved}


# ---------------------------------------------------------------- checkpoints


@dataclass
class TrainState:
    """Everything of the run besides models, optimizer and sampler that a resume needs
    (trainer_state.json)."""

    step: int = 0  # updates done
    beta: float = 0.0  # the KL weight now (F2 moves it)
    # F2: the current window's mean token KLs
    kl_history: list = dataclasses.field(default_factory=list)
    nonfinite_in_a_row: int = 0  # L6
    run_id: str = ""  # names the wandb run; a resume keeps it


def checkpoints(out_dir):
    """Complete checkpoint folders, oldest first
    (an interrupted save is a .tmp folder and never listed)."""
    return sorted(glob.glob(os.path.join(out_dir, "ckpt_*")))


def save_checkpoint(cfg, policy, ref, tokenizer, optimizer, sampler, state, extra=None):
    """Write everything to a temp folder, then rename it:
    a kill at any moment leaves the last one whole. extra: a function giving {file name: object}
    to torch.save there too (R8's batches made for the steps after it).

    Called on every rank: the full (unsharded) states are gathered to rank 0, which alone writes.
    The same files whatever the number of ranks, so any number can resume them, and from_pretrained
    reads them.
    """
    # optimizer keyed by parameter name
    model_state, optimizer_state = parallel.full_state(policy, optimizer)
    ref_state = parallel.full_state(ref)[0] if cfg.ref_refresh_steps and ref is not None else None
    files = extra() if extra is not None else {}
    if parallel.rank() > 0:
        parallel.barrier()
        return
    final = os.path.join(cfg.out_dir, f"ckpt_{state.step:06d}")
    tmp = os.path.join(cfg.out_dir, f".tmp_ckpt_{state.step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=model_state)  # with LoRA: the adapter only
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
    torch.save(rng_states(), os.path.join(tmp, "rng.pt"))
    if ref_state is not None:
        torch.save(ref_state, os.path.join(tmp, "reference.pt"))
    for name, value in files.items():
        torch.save(value, os.path.join(tmp, name))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({**dataclasses.asdict(state), "sampler": sampler.state_dict()}, f)
    save_config(cfg, os.path.join(tmp, "grpo_config.json"))  # config.json is the HF model config
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic on one file system
    for old in checkpoints(cfg.out_dir)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old)
    parallel.barrier()  # the other ranks wait until the checkpoint is whole


def load_checkpoint(folder, cfg, policy, ref, optimizer, sampler):
    """Restore what save_checkpoint wrote (the policy's weights are loaded with the model);
    the TrainState."""
    with open(os.path.join(folder, "trainer_state.json")) as f:
        saved = json.load(f)
    sampler.load_state_dict(saved.pop("sampler"))
    kept = ("step", "beta", "kl_history", "nonfinite_in_a_row")
    state = TrainState(**{k: saved[k] for k in kept}, run_id=saved.get("run_id", ""))
    parallel.load_optimizer(policy, optimizer, load_file(folder, "optimizer.pt"))
    restore_rng(load_file(folder, "rng.pt", weights_only=False))
    if ref is not None and cfg.ref_refresh_steps:
        parallel.load_model(ref, load_file(folder, "reference.pt"))
    print(f"resumed from {folder} at step {state.step}")
    return state


def load_file(folder, name, **kwargs):
    """torch.load of a checkpoint's file, or a ConfigError saying how to go on without it."""
    try:
        return torch.load(os.path.join(folder, name), **kwargs)
    except Exception as e:  # damage the cheap check (damaged) cannot see: bytes overwritten
        raise ConfigError(f"{folder}/{name} cannot be loaded ({type(e).__name__}: {e}); move "
                          f"{folder} out of out_dir to resume from the checkpoint before it") from e


def rng_states():
    """The RNG states a checkpoint keeps. CUDA's is this process's device's only: the run may resume
    on fewer GPUs than it was saved on."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": cuda}


def restore_rng(rng):
    """Restore rng_states(); the CUDA state goes to this process's device."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    cuda = rng["cuda"]
    if isinstance(cuda, list):  # an older checkpoint's: every visible device's, rank 0's own first
        cuda = cuda[0] if cuda else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def truncate_log(path, step):
    """Drop the lines of steps >= step from a JSONL log: they were written after the checkpoint we
    resume from. A torn last line (a kill or a full disk mid-write) is dropped too, and said; a
    damaged line elsewhere is an error naming it."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        lines = f.read().splitlines() if step else []  # from step 0 nothing is kept
    keep = []
    for lineno, line in enumerate(lines, 1):
        try:
            logged = json.loads(line)["step"] if line.strip() else step
        except (ValueError, KeyError, TypeError):
            if lineno < len(lines):
                raise ConfigError(f"{path}, line {lineno} is not a log record; delete that line, "
                                  "or every line from it on, and resume again") from None
            print(f"{path}: its last line was cut off mid-write (the run was killed, or the disk "
                  "filled); dropped it")
            continue
        if type(logged) is not int:
            raise ConfigError(f"{path}, line {lineno}: step {logged!r} is not a whole number; fix "
                              "or delete that line, and resume again")
        if logged < step:
            keep.append(line + b"\n")
    with open(path + ".tmp", "wb") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


OUT_DIR_LOCKS = {}  # out_dir/.lock -> its open file: the lock lasts while the file stays open


def lock_out_dir(out_dir):
    """Hold out_dir/.lock for the life of this process, or fail at once naming the one holding it.

    A POSIX lock (lockf): the kernel drops it when its process ends, however it ends, so a killed
    run's lock never blocks; and unlike flock's, the processes forked later do not hold it too.
    """
    path = os.path.join(out_dir, ".lock")
    held = OUT_DIR_LOCKS.get(os.path.realpath(path))
    if held and os.path.exists(path) and os.path.samestat(os.fstat(held.fileno()), os.stat(path)):
        return  # this process holds it (main called again)
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
            print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second run on "
                  "this out_dir")
            return
        raise ConfigError(f"out_dir {out_dir} is in use by {holder}: one run per out_dir; wait for "
                          "it or stop it, or give this run another --out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    OUT_DIR_LOCKS[os.path.realpath(path)] = f


def run_files(out_dir):
    """What a run leaves in out_dir: its logs (when not empty) and its checkpoint folders."""
    logs = [os.path.join(out_dir, name) for name in ("metrics.jsonl", "samples.jsonl")]
    logs = [os.path.basename(p) for p in logs if os.path.isfile(p) and os.path.getsize(p)]
    return logs + [os.path.basename(c) for c in checkpoints(out_dir)]


def claim_out_dir(cfg, rank):
    """Make out_dir this run's: locked while it runs, no other run's files in a fresh run; on resume
    the checkpoint's settings, the logs cut back to its step. Returns the checkpoint, or None."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out_dir={cfg.out_dir!r} cannot be created: {e.strerror}") from None
    if rank == 0:
        lock_out_dir(cfg.out_dir)
    found = run_files(cfg.out_dir)
    if not cfg.resume:
        if found and not cfg.eval_only:  # eval_only only appends to eval.jsonl
            raise ConfigError(f"{cfg.out_dir} already holds a run ({', '.join(found)}), which a "
                              "fresh run would mix with; continue it with --resume=true, or give "
                              "this run another --out_dir (or delete those)")
        return None
    resume_from = newest_intact(cfg.out_dir)
    if cfg.eval_only:  # evaluates the checkpoint; the run's logs stay as they are
        return resume_from
    if resume_from:
        step = checkpoint_step(resume_from)
        check_same_run(cfg, resume_from)
    else:  # killed before its first checkpoint
        step = 0
        cleared = ", its logs cleared" if found else ""
        print(f"resume=True, but {cfg.out_dir} holds no complete checkpoint yet: starting from "
              f"step 0{cleared}")
    for log in ("metrics.jsonl", "samples.jsonl") if rank == 0 else ():
        truncate_log(os.path.join(cfg.out_dir, log), step)
    return resume_from


def newest_intact(out_dir):
    """The newest checkpoint whose files are whole (damaged(): a newer one is passed over, saying
    why; the next save of its step replaces it), or None."""
    found = checkpoints(out_dir)
    for folder in reversed(found):
        why = damaged(folder)
        if why is None:
            return folder
        print(f"warning: {folder} is damaged ({why}); resuming from the checkpoint before it")
    if found:
        raise ConfigError(f"every checkpoint in {out_dir} is damaged; start a new run in another "
                          "--out_dir")
    return None


def damaged(folder):
    """Why a checkpoint's files cannot be loaded whole, or None: its trainer_state.json, its torch
    files (zip archives whose directory, at the end, a cut-off copy lacks) and its safetensors
    weights (a header that says how long the file is). Cheap: no tensor is read."""
    try:
        checkpoint_step(folder)
    except ConfigError:
        return "trainer_state.json cannot be read"
    for name in ("optimizer.pt", "rng.pt", "reference.pt"):
        path = os.path.join(folder, name)
        if name != "reference.pt" and not os.path.exists(path):
            return f"{name} is missing"
        if os.path.exists(path) and not zipfile.is_zipfile(path):
            return f"{name} is not whole (cut off or overwritten)"
    weights = glob.glob(os.path.join(folder, "*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    for path in weights:
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                      default=0)
            if os.path.getsize(path) != 8 + size + end:
                return f"{os.path.basename(path)} is cut off"
        except (OSError, ValueError, KeyError, TypeError, MemoryError):
            return f"{os.path.basename(path)} is not whole"
    return None


def checkpoint_step(folder):
    """The step a checkpoint was saved after (its trainer_state.json)."""
    path = os.path.join(folder, "trainer_state.json")
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} cannot be read ({e}): {folder} is not a checkpoint of grpo.py; "
                          "move it out of out_dir") from None


# What makes a run the run it is (RUN_SETTINGS): a resume with one of these changed would continue
# some other run from this one's weights, optimizer state and place in the data, so it is refused
# unless resume_changed=True. It is every setting but these, which may change on resume: the run's
# length, eval, logging, checkpoints, max_prompt_len (a bound every prompt is checked against), and
# how a step is computed (engine, device, dtype, micro-batches, memory, deadlines): speed, memory or
# rounding, not the aim. A new setting is the run's unless it is named here.
FREE_SETTINGS = (
    # where the run lives and how long it goes on (max_steps: a resume may extend a run)
    "out_dir", "max_steps", "resume", "resume_changed", "eval_only", "save_every",
    "keep_checkpoints",
    # what is measured and logged (M1, M2, W6)
    "eval_every", "eval_n", "eval_in_run_sampled", "eval_tasks", "test_size", "sample_every",
    "sample_groups", "report_to",
    # the machine and the engine: the same numbers, computed elsewhere or faster (R1, O3, O5, L6)
    "engine", "device", "dtype", "parallel", "vllm_tensor_parallel",
    "gpu_memory_utilization", "vllm_cpu_kv_cache_gb", "vllm_sleep_level",
    "micro_batch_tokens", "shared_prompt", "skip_zero_gradient", "tail_runs", "fused_logprobs",
    "chunked_logprobs", "gradient_checkpointing", "ref_offload",
    # the guards around outside code: deadlines, workers, the sandbox, the prompt's bound
    "reward_timeout", "reward_workers", "tool_timeout", "sandbox", "max_prompt_len",
)
RUN_SETTINGS = tuple(f.name for f in dataclasses.fields(Config)
                     if f.init and f.name not in FREE_SETTINGS)
# deleted settings (config.DELETED) that changed what a run learns and no setting holds now: a
# checkpoint saved with one off the default it had would go on as another run (the others are
# compared as the setting that holds them: config.upgrade)
DELETED_RUN_SETTINGS = ("drop_zero_std_groups", "kl_up", "kl_down", "length_penalty_tokens",
                        "length_penalty", "adv_std_floor", "curriculum_bands",
                        "curriculum_hard_below", "curriculum_easy_above")


def changed_settings(cfg, saved):
    """[(name, saved value, value now)] for each of RUN_SETTINGS and the task's options where
    `saved` (save_config's JSON) differs from cfg; two paths to one file or folder (./tasks/x.py,
    tasks/x.py) are the same, as are reward weights in another order. A deleted setting saved off
    its old default counts too, as the setting that holds it now or as deleted."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples become the lists the JSON holds
    saved = upgrade(saved)
    changed = [(k, saved[k], now[k]) for k in RUN_SETTINGS
               if k in saved and not same_value(k, saved[k], now[k])]
    # the task file's options, all the run's (an eval set's are free, as eval_tasks is)
    options, now_options = saved_task_options(saved, now["task_options"]), now["task_options"]
    declared = [k for spec in task_parts(cfg.task) for k in declared_options(task_path(spec))]
    changed += [(k, options[k], now_options[k]) for k in declared
                if k in options and k in now_options and options[k] != now_options[k]]
    for k in DELETED_RUN_SETTINGS:
        default, instead = DELETED[k]
        if k in saved and saved[k] != json.loads(json.dumps(default)):  # a tuple saved as a list
            changed.append((k, saved[k], f"deleted: {instead}"))
    return changed


def same_value(name, a, b):
    """A saved setting equals today's: the same value, two paths to one file, the same weights."""
    if name == "reward_weights":
        return reward_weights(a) == reward_weights(b)
    return a == b or same_file(a, b)


def same_file(a, b):
    """True if a and b are paths to one existing file or folder."""
    try:
        return isinstance(a, str) and isinstance(b, str) and os.path.samefile(a, b)
    except OSError:
        return False


def check_same_run(cfg, folder):
    """A resume goes on with the checkpoint's run: its RUN_SETTINGS (unless resume_changed)."""
    path = os.path.join(folder, "grpo_config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}): {folder} is not a checkpoint of grpo.py; "
                          "move it out of out_dir") from None
    changed = ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in changed_settings(cfg, saved))
    if changed and not cfg.resume_changed:
        raise ConfigError(f"settings changed since {folder} was saved: {changed}. Resume with the "
                          "checkpoint's settings, pass --resume_changed=true to go on with the new "
                          "ones, or start a new run in another --out_dir")
    if changed:
        print(f"resume_changed=True: going on from {folder} with changed settings: {changed}")

