"""R8: the sampler in a process of its own, generating up to max_staleness batches ahead (optional).

    python grpo.py --async_rollouts=true --is_correction=token_truncate
                                    # a CPU: the sampler is a process on half the cores
    torchrun --nproc_per_node=N grpo.py --config ... --async_rollouts=true \
        --is_correction=token_truncate          # N + 1 GPUs: GPU N is the sampler's

The plain loop wakes its engine, generates batch t with the policy after t updates, sleeps it and
updates. Here a second process owns the engine (vLLM, or its own copy of the policy for the HF
engine), the prompt sampler and the reward, and runs the collect phase of grpo.py (collect_rollouts,
the curriculum's update) on its own, while the trainer updates on the batch before: batch t is made
with the weights after max(0, t - max_staleness) updates, exactly those (the lag is `staleness` in
metrics.jsonl, each row's `policy_version` in samples.jsonl), so a run is the same whatever the
two processes' speeds. The trainer pushes its weights after every update into shared memory, a ring
of max_staleness + 1 copies, so the version a batch needs is never overwritten before the sampler
has read it; there is no disk round trip and the trainer does not wait for the sampler to read.
At an eval step the sampler waits for the step's own weights (the eval, and that step's batch, are
on-policy).

A checkpoint holds the batches already made for the steps after it (rollouts.pt; made with weights
the checkpoint no longer has), and the prompt sampler's state as of the last batch the trainer took:
a resume goes on with them, so a killed and resumed run is the straight one. The sampler dies with
the trainer; a sampler that fails stops the trainer with its traceback.

How far off-policy a batch is, and what corrects it, is the loss's business (old_logprobs,
is_correction with is_floor and is_cap: TIS, IcePop's band, sequence masking; loss.py): uncorrected,
the default run one update behind barely learned (docs/performance.md).
"""

import atexit
import contextlib
import dataclasses
import multiprocessing as mp
import os
import time
import traceback
from collections import deque

import torch

from infra import parallel
from infra.log import timed
from model import push_weights_iter
from rollout import Rollouts


@dataclasses.dataclass
class Made:
    """One step's rollouts as the sampler made them (what the plain loop's collect phase gives)."""

    step: int
    version: int  # updates the weights it was made with had seen
    batch: object  # rollout.Rollouts, the whole step's (every rank's rows)
    drawn: object  # rollout.Rollouts, every row drawn (R7: before its filter)
    rounds: int  # R7's refill rounds
    times: dict  # the sampler's phase times: time/generate, time/score, time/push, time/sleep
    evals: dict  # M2 at this step (evaluate_in_run), or {}
    sampler_state: dict  # the prompt sampler's state after this step's draws and update


@dataclasses.dataclass
class Phases:
    """grpo.py's functions the sampler runs (passed in, by reference: grpo imports this module)."""

    collect: object  # collect_rollouts
    temperature_at: object
    eval_is_due: object


class AsyncRollouts:
    """The trainer's end: next(step) gives a step's rollouts, push(policy, version) the weights."""

    def __init__(self, cfg, path, device, policy, sampler, start, phases, pending=()):
        self.cfg, self.sampler, self.slots = cfg, sampler, cfg.max_staleness + 1
        self.pending = deque(pending)  # from a checkpoint: made before it, for the steps after it
        self.taken = start - 1  # the last step whose rollouts the trainer took
        names, tensors = zip(*((n, t.detach()) for n, t in push_weights_iter(policy)))
        self.layout = [(n, tuple(t.shape)) for n, t in zip(names, tensors)]
        size = sum(t.numel() for t in tensors)
        # a ring of weight versions in shared memory, each tagged with its version
        self.ring = torch.zeros(self.slots, size, dtype=torch.float32).share_memory_()
        self.tags = torch.full((self.slots,), -1, dtype=torch.long).share_memory_()
        self.push_tensors(tensors, start)
        ctx = mp.get_context("spawn")  # a fresh interpreter: vLLM and torch's threads start clean
        self.conn, child = ctx.Pipe(duplex=False)
        first = start + len(self.pending)  # the first step the sampler makes
        state = self.pending[-1].sampler_state if self.pending else sampler.state_dict()
        where = sampler_device(cfg, device)
        env = split_cores() if where == "cpu" else {}
        # not a daemon: its reward workers are its children; ended at exit (close), or with us
        self.process = ctx.Process(target=sampler_main, name="grpo-sampler", args=(
            cfg_items(cfg), path, where, self.ring, self.tags, self.layout, child, first, state,
            phases, os.getpid()))
        with environment(env):  # the sampler's threads, set before its torch and vLLM start
            self.process.start()
        child.close()
        atexit.register(self.close)  # before multiprocessing's own exit hook joins it

    def push_tensors(self, tensors, version):
        """Write one version into its slot of the ring, then tag it (the sampler reads by tag)."""
        slot = self.ring[version % self.slots]
        offset = 0
        for t in tensors:
            n = t.numel()
            slot[offset : offset + n].copy_(t.reshape(-1))
            offset += n
        self.tags[version % self.slots] = version

    def push(self, policy, version):
        """R2 in this mode: the weights after `version` updates, from every rank (FSDP gathers
        them) into rank 0's shared ring."""
        tensors = [t.detach() for _, t in push_weights_iter(policy)]
        if parallel.rank() == 0:
            self.push_tensors([t.float().cpu() for t in tensors], version)

    def receive(self):
        """The sampler's next message; its error, or its death, raised here with the cause."""
        try:
            while not self.conn.poll(0.5):
                if not self.process.is_alive():
                    raise RuntimeError(f"the sampler process died (exit code "
                                       f"{self.process.exitcode}) without a word: killed, or out "
                                       "of memory?")
            kind, payload = self.conn.recv()
        except (EOFError, OSError):  # its end of the pipe closed, or reset, mid-message
            self.process.join(5)
            raise RuntimeError(f"the sampler process died (exit code {self.process.exitcode})") \
                from None
        if kind == "error":
            raise RuntimeError(f"the sampler process failed:\n{payload}")
        return kind, payload

    def next(self, step, times):
        """Step `step`'s (batch, drawn, rounds, evals), as collect_rollouts and evaluate_in_run give
        them in the plain loop; evals also holds `staleness`, the updates the weights lagged by.
        Rank 0 waits for them (time/wait), every rank gets the step and trains on its share of the
        groups. The prompt sampler takes the state it had after them (so a checkpoint holds it)."""
        made = None
        if parallel.rank() == 0:
            start = time.perf_counter()
            made = self.pending.popleft() if self.pending else self.receive()[1]
            times["time/wait"] = time.perf_counter() - start
            if made.step != step:
                raise RuntimeError(f"the sampler sent step {made.step} for step {step}")
        made = parallel.broadcast_object(made)
        self.taken = step
        self.sampler.load_state_dict(made.sampler_state)
        times.update(made.times)
        groups = len(made.batch) // self.cfg.group_size
        share = -(-groups // parallel.world())  # contiguous groups per rank, the last has fewer
        first = min(groups, parallel.rank() * share)
        batch = made.batch.groups(range(first, min(groups, first + share)), self.cfg.group_size)
        batch.policy_version = made.version
        return batch, made.drawn, made.rounds, {**made.evals, "staleness": step - made.version}

    def checkpoint_files(self):
        """What a checkpoint needs besides the trainer's state: the batches made for the steps
        after it (received now if on their way: each is needed next anyway)."""
        ahead = min(self.cfg.max_staleness, self.cfg.max_steps - 1 - self.taken)  # short of the end
        while parallel.rank() == 0 and len(self.pending) < ahead:
            self.pending.append(self.receive()[1])
        return {"rollouts.pt": [stored(made) for made in self.pending]}

    def final_eval(self):
        """M2 after the last update, made by the sampler on those weights (rank 0's, to all)."""
        evals = None
        if parallel.rank() == 0:
            kind, evals = self.receive()
            if kind != "final":
                raise RuntimeError(f"the sampler sent {kind} where the final eval was due")
        return parallel.broadcast_object(evals)

    def close(self):
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


def stored(made):
    """A Made as rollouts.pt keeps it: its two Rollouts as dicts of their fields. A pickled class
    loads only from the module it was pickled in, and a checkpoint outlives a move of the code."""
    def fields(rollouts):
        return {f.name: getattr(rollouts, f.name) for f in dataclasses.fields(rollouts)}

    return dataclasses.replace(made, batch=fields(made.batch), drawn=fields(made.drawn))


def load_pending(folder):
    """The batches a checkpoint holds for the steps after it (rollouts.pt), or none."""
    path = os.path.join(folder, "rollouts.pt") if folder else ""
    if not os.path.exists(path):
        return []
    return [dataclasses.replace(made, batch=Rollouts(**made.batch), drawn=Rollouts(**made.drawn))
            for made in torch.load(path, weights_only=False)]


def cfg_items(cfg):
    """The settings as plain values, for the sampler process to rebuild its Config."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def split_cores():
    """On a CPU: this process keeps the first half of the cores, the sampler gets the rest, each
    side's threads pinned to its own and waiting passively (a spinning idle thread of one side
    would take the other's core). Returns the sampler's environment."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    mine, theirs = cores[: (len(cores) + 1) // 2], cores[(len(cores) + 1) // 2 :]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return {"OMP_NUM_THREADS": str(len(theirs)), "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, theirs)),
            "GRPO_SAMPLER_CORES": ",".join(map(str, theirs))}


@contextlib.contextmanager
def environment(values):
    """os.environ with these values inside the block (a spawned process starts with them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sampler_device(cfg, device):
    """The sampler's device: on a GPU the one after the trainer's ranks (pre-flight checks that it
    exists); on a CPU the CPU."""
    if torch.device(device).type == "cuda":
        return f"cuda:{parallel.world()}"
    return "cpu"


def load_version(engine, model, ring, tags, layout, version, slots):
    """The weights after `version` updates, from the ring, into the sampler's engine: pushed into
    vLLM, or copied into the HF engine's own policy (model)."""
    slot = ring[version % slots]
    if int(tags[version % slots]) != version:
        raise RuntimeError(f"weights version {version} is not in the ring (it holds "
                           f"{tags.tolist()}): the trainer ran past the sampler")
    offset, pairs = 0, []
    for name, shape in layout:
        n = 1
        for d in shape:
            n *= d
        pairs.append((name, slot[offset : offset + n].view(shape)))
        offset += n
    if model is not None:  # the HF engine samples from this copy: its wake pushes nothing
        model.load_state_dict(dict(pairs))
    else:
        engine.wake(iter(pairs))


def sampler_main(items, path, device, ring, tags, layout, conn, first, sampler_state, phases,
                 parent):
    """The sampler process: for each step from `first`, wait for the weights it needs, make the
    step's rollouts as the plain loop's collect phase does, send them; then the final eval."""
    from scoring import sandbox

    sandbox.die_with_parent(parent)  # kill -9 of the trainer ends the sampler too
    try:
        run_sampler(items, path, device, ring, tags, layout, conn, first, sampler_state, phases)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


def run_sampler(items, path, device, ring, tags, layout, conn, first, sampler_state, phases):
    from config import Config, derive
    from episodes.task import load_problems, load_task, tokenize_prompts
    from infra.model_files import auto_engine
    from model import load_policy, load_tokenizer
    from run.evals import evaluate_all, evaluate_in_run, load_eval_tasks
    from run.prepare import Split, eval_split, make_engine, make_sampler
    from scoring import sandbox

    # its device is its own: no sleep mode (nothing else needs the memory between batches)
    cfg = derive(Config(**{**items, "vllm_sleep_level": 0}))
    sandbox.ALLOWED = cfg.sandbox
    if os.environ.get("GRPO_SAMPLER_CORES"):  # on a CPU, the cores split_cores gave it
        cores = [int(c) for c in os.environ["GRPO_SAMPLER_CORES"].split(",")]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    tokenizer, model = load_tokenizer(cfg, path), None  # as load_policy loads it
    if (auto_engine() if cfg.engine == "auto" else cfg.engine) == "hf":  # its own policy copy
        plain = Config(**{**items, "lora_rank": 0, "gradient_checkpointing": False})
        tokenizer, model = load_policy(derive(plain), path, device)  # LoRA comes pushed merged
        model.eval().requires_grad_(False)
    task = load_task(cfg)
    engine, _ = make_engine(cfg, path, device, model, tokenizer, task)
    problems = {split: load_problems(cfg, task, split) for split in ("train", "test")}
    train, test = (Split(task, problems[s], tokenize_prompts(tokenizer, task, problems[s],
                                                              cfg.max_prompt_len))
                   for s in ("train", "test"))
    eval_sets = [test, *(eval_split(tokenizer, *found, cfg) for found in load_eval_tasks(cfg))]
    sampler = make_sampler(cfg, task, train.problems)
    sampler.load_state_dict(sampler_state)
    slots, loaded = cfg.max_staleness + 1, -1

    def weights(version, times):  # wait for them (the sampler's idle time), push them once
        nonlocal loaded
        start = time.perf_counter()
        while int(tags.max()) < version:
            time.sleep(0.002)
        times["time/sampler_idle"] = time.perf_counter() - start
        if loaded != version:
            with timed(times, "time/push"):
                load_version(engine, model, ring, tags, layout, version, slots)
            loaded = version

    for step in range(first, cfg.max_steps):
        times = {}
        # an eval step's eval (and batch) on its own weights; the other batches max_staleness old
        due = phases.eval_is_due(cfg, step)
        version = step if due else max(0, step - cfg.max_staleness)
        weights(version, times)
        evals = evaluate_in_run(engine, eval_sets, cfg, step) if due else {}
        batch, drawn, rounds = phases.collect(engine, sampler, train, cfg, step,
                                              phases.temperature_at(step, cfg), times)
        conn.send(("made", Made(step, version, batch, drawn, rounds, times, evals,
                                sampler.state_dict())))
    times = {}
    weights(cfg.max_steps, times)  # the final eval, on the last update's weights
    conn.send(("final", evaluate_all(engine, eval_sets, cfg)[0]))
