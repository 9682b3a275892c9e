"""Several GPUs with torchrun: set-up, FSDP2 or DDP, global sums, full-state checkpoints.

    torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py  # FSDP2 (default)
    torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py --parallel=ddp
    # two machines
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --nproc_per_node=8 grpo.py ...

Data parallel over ranks. Every rank draws the same global list of prompts (same seed) and keeps
its own contiguous slice, with all G completions of each of its prompts, so group advantages need
no communication. Each rank samples with its own colocated engine, then computes its share of the
loss with the global denominators (response tokens, sequences, all-reduced here). DDP and FSDP2
average gradients over ranks, so each rank's loss is scaled by the world size: the gradient is
then exactly the single-process gradient of the whole batch (tests/test_parallel.py checks it).

Without torchrun (no RANK in the environment) nothing here communicates: every function gives
the one-process answer (world 1, rank 0, sums of one number, the model unwrapped).
"""

import atexit
import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from config import ConfigError

# True once setup() has joined torchrun's process group. Not dist.is_initialized(): a single-process
# vLLM engine initialises torch.distributed (world size 1) on its own.
launched = False


def setup(device):
    """(rank, world, device): join torchrun's process group when launched by it, else
    (0, 1, device)."""
    global launched
    if "RANK" not in os.environ:
        return 0, 1, device
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    # gloo for CPU tensors even on GPUs: object gathers and the CPU-side counts go through it
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    # Leave the group before the interpreter exits: a process that exits with gloo's threads still
    # running can abort ("terminate called without an active exception", SIGABRT) after its work
    # is done, and torchrun then reports the whole run as failed.
    atexit.register(leave_group)
    launched = True
    return dist.get_rank(), dist.get_world_size(), device


def leave_group():
    """Destroy the process group, if still there (a process may have left it already)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def world():
    """Number of ranks (1 without torchrun)."""
    return dist.get_world_size() if launched else 1


def rank():
    """This process's rank (0 without torchrun)."""
    return dist.get_rank() if launched else 0


def barrier():
    """Wait for every rank."""
    if launched:
        dist.barrier()


@contextlib.contextmanager
def local_rank0_first():
    """The first rank of each machine runs the block first (it builds or converts a cached folder,
    on that machine's disk); the other ranks run it after, and find the folder there."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        barrier()
    yield
    if first:
        barrier()


def my_slice(items):
    """This rank's contiguous share of a list that every rank holds whole
    (len divisible by the world size)."""
    k = len(items) // world()
    return items[rank() * k : (rank() + 1) * k]


def broadcast_object(obj):
    """Rank 0's object (any picklable value) on every rank."""
    if not launched:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(x):
    """Sum of a number over ranks, as a float."""
    if not launched:
        return float(x)
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def all_max(x):
    """Largest value of a number over ranks."""
    if not launched:
        return x
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_min(x):
    """Smallest value of a number over ranks."""
    return -all_max(-x)


def all_gather_list(items, group=None):
    """Every rank's list (of `group`, default all) concatenated in rank order: with contiguous
    slices, the single-process order."""
    if not launched:
        return list(items)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(items), group=group)
    return [x for part in out for x in part]


def gather_group(group, prompts, *lists):
    """`prompts` and the lists that go with them gathered over `group` (consecutive ranks that
    share one engine: consecutive_group's) in rank order, after the slice of them that is this
    rank's own."""
    counts = all_gather_list([len(prompts)], group=group)
    start = sum(counts[: rank() % len(counts)])  # groups are consecutive ranks
    mine = slice(start, start + len(prompts))
    return (mine, *(all_gather_list(x, group=group) for x in (prompts, *lists)))


def consecutive_group(size):
    """The process group of this rank and its neighbours, `size` consecutive ranks (vLLM's
    tensor-parallel groups under torchrun are laid out the same way); None for size 1. Called on
    every rank."""
    if size == 1:
        return None
    # gloo: Python objects are gathered over it
    group, _ = dist.new_subgroups(group_size=size, backend="gloo")
    return group


def wrap(model, mode, dtype, trainable=True):
    """FSDP2 (shard each decoder layer, then the whole model) or DDP;
    `model` as it is on one process.

    FSDP2 shards in place: `model` stays the HF object (save_pretrained, generate, state_dict keep
    working) and its parameters become DTensors. With bf16, FSDP2 gathers parameters in bf16 and
    reduces gradients in fp32; the fp32 shards stay the master weights (O5). DDP returns a wrapper;
    the caller keeps the plain model for everything but the training forward.
    """
    if not launched:
        return model
    if mode == "ddp":
        if not trainable:  # a frozen reference: nothing to synchronise, a full copy per rank
            return model
        device = next(model.parameters()).device
        return DistributedDataParallel(model,
                                       device_ids=[device.index] if device.type == "cuda" else None)
    # bf16 gathers in bf16 and reduces in fp32; float32 gathers and reduces as stored
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if dtype == "bfloat16" else MixedPrecisionPolicy())
    # HF names its decoder layer class here
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(f"FSDP: no decoder layers ({layer_classes}) found in "
                          f"{type(model).__name__}; use --parallel=ddp")
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    # the root group (embeddings, final norm, head) on the HF model itself: with LoRA, peft's
    # generate calls the inner HF model directly, past any hooks on the peft wrapper
    fully_shard(model.get_base_model() if hasattr(model, "get_base_model") else model, mp_policy=mp)
    return model


def no_grad_sync(train_model, last):
    """DDP: all-reduce gradients once, on the last micro-batch. FSDP2 reduce-scatters every
    micro-batch, which keeps gradients sharded (skipping it would hold a whole unsharded gradient
    per rank)."""
    if last or not hasattr(train_model, "no_sync"):
        return contextlib.nullcontext()
    return train_model.no_sync()


def even_micro_batches(tensors, batches):
    """Give this rank as many micro-batches as the rank with the most,
    for FSDP and DDP's collectives.

    The extra micro-batches hold one added row: token 0 everywhere, attended (no fully masked
    softmax), with a zero loss mask, so its loss and gradient are exactly 0. tensors: name -> tensor
    with rows first, among them "attention".
    """
    missing = int(all_max(len(batches))) - len(batches)
    if missing == 0:
        return tensors, batches
    row = len(tensors["attention"])
    tensors = {k: torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for k, t in tensors.items()}
    tensors["attention"][row] = 1
    return tensors, batches + [[row]] * missing


def grad_norm_value(norm):
    """clip_grad_norm_ returns a DTensor under FSDP2 (already the global norm);
    a plain tensor otherwise."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state(model, optimizer=None):
    """(model state, optimizer state), whole and on the CPU of rank 0 (empty elsewhere);
    called on every rank.

    Parameter names (not ids) key the optimizer state, so a checkpoint from N ranks loads on M.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = (get_optimizer_state_dict(model, optimizer, options=options)
                   if optimizer is not None else None)
    return model_state, optim_state


def load_model(model, state):
    """Load a full state dict (from full_state) into a model, sharded or not."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer(model, optimizer, state):
    """Load a full, name-keyed optimizer state (from full_state) into this rank's,
    sharded as the model is."""
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
