"""Setting up a run, before its first step: the config checked, the data, the models, the engine.

grpo.main calls start_run (prepare_run, then the models and the data as a Run) and make_engine;
everything that can fail does so here, before a model loads where it can (O6: pre-flight).
"""

import functools
import glob
import os
import random
import shutil
import sys
from dataclasses import dataclass

import torch
import transformers

from config import ConfigError, config_from_argv
from data.sampler import CurriculumSampler, MixtureSampler, PromptSampler
from episodes.task import Mixture, by_task, load_problems, load_task, tokenize_prompts
from episodes.tools import TextTools, parser_class
from episodes.turns import EpisodeEngine
from infra import parallel
from infra.checkpoint import TrainState, claim_out_dir, load_checkpoint, save_config
from infra.log import output_to
from infra.model_files import BUILT_HERE, auto_engine, check_model_source
from infra.preflight import check_run, preflight
from model import load_policy, load_reference, model_path
from perf import cpu
from perf.logprobs import fused_head_unsupported
from rollout import HFEngine, VLLMEngine
from run.audit import check_sandbox, check_task_output
from run.evals import load_eval_tasks
from scoring.execute import run_python


@dataclass
class Split:
    """A task's problems of one split and their prompts as token ids."""

    task: object  # episodes.task.Task
    problems: list  # problem dicts
    prompt_ids: list  # one list of token ids per problem
    name: str = ""  # an eval_tasks set's name (eval/<name>/...); "" for the training task's



@dataclass
class Run:
    """What main() set up and each step reads: the settings, the models and optimizer, the data,
    the state a checkpoint saves, and where rollouts come from (an engine, or R8's sampler)."""

    cfg: object  # config.Config
    device: str
    path: str  # the model folder
    resume_from: str  # the checkpoint resumed from, or None
    tokenizer: object
    policy: object
    train_model: object  # the policy, under DDP wrapped (the gradient passes go through it)
    ref: object  # the reference (beta > 0), else None
    params: list  # the trained parameters
    optimizer: object
    prompt_sampler: object  # the prompts of each step (D2, D3)
    train: Split
    eval_sets: list  # Split per eval set: the test split first, then eval_tasks' (M2)
    state: TrainState  # the step, beta, the sampler's state: what a checkpoint saves
    teacher: object = None  # on-policy distillation's teacher (L9), else None
    engine: object = None  # rollout.py's engine (without async_rollouts)
    engine_name: str = ""
    rollouts: object = None  # run.async_rollouts.AsyncRollouts (R8), else None
    final_eval: object = None  # () -> the eval metrics after the last update (M2)
    logger: object = None  # infra.log.Logger on rank 0
    save: object = None  # () -> writes a checkpoint of the run as it stands
    checkpoint_seconds: float = 0.0  # the last checkpoint's time, logged with the next step
    next_parity_warning: int = 0  # the step from which the sampler-trainer gap warns again (R2)


def start_run(argv):
    """prepare_run, then the models, the prompt sampler, the tokenized splits and, on a resume,
    the checkpoint's state: a Run without its engine yet."""
    cfg, device, path, resume_from, task, (train_problems, test_problems), eval_tasks = prepare_run(
        argv)
    # train_model: the policy, wrapped by DDP under torchrun with parallel=ddp (else the same
    # object: FSDP2 shards it in place); the gradient passes go through it, the no-grad ones not
    tokenizer, policy, train_model, ref, params, optimizer = build_models(cfg, path, device,
                                                                          resume_from)
    prompt_sampler = make_sampler(cfg, task, train_problems)  # the prompts of each step (D2-D4)
    train = Split(task, train_problems,
                  tokenize_prompts(tokenizer, task, train_problems, cfg.max_prompt_len))
    test = Split(task, test_problems,
                 tokenize_prompts(tokenizer, task, test_problems, cfg.max_prompt_len))
    eval_sets = [test, *(eval_split(tokenizer, *found, cfg) for found in eval_tasks)]  # M2
    state = TrainState(beta=cfg.beta, run_id=f"{random.Random().getrandbits(64):016x}")
    if resume_from:
        state = load_checkpoint(resume_from, cfg, policy, ref, optimizer, prompt_sampler)
    teacher = load_teacher(cfg, device, tokenizer) if cfg.teacher else None  # L9
    return Run(cfg, device, path, resume_from, tokenizer, policy, train_model, ref, params,
               optimizer, prompt_sampler, train, eval_sets, state, teacher)


def prepare_run(argv):
    """Config, pre-flight, the model folder, the data: what can fail fails before a model loads
    (O6)."""
    cfg = config_from_argv(argv)
    check_run(cfg)  # what this machine lacks for it (a GPU, a package); settings that mislead
    transformers.utils.logging.disable_progress_bar()  # loading 135M weights needs no progress bar
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, _, device = parallel.setup(device)  # under torchrun: join the process group
    if device == "cpu" and not cpu.keep_freed_memory():  # exact; an update ~1.3x faster
        print("this C library has no mallopt (not glibc): freed memory goes back to the system")
    if device == "cpu" and cfg.dtype == "bfloat16":
        cpu.cap_kernel_cache()
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # one console: rank 0's (errors still reach stderr)
    if cfg.model not in BUILT_HERE:  # a hub name that cannot be had fails now, not after retries
        check_model_source(cfg.model)
    preflight(cfg)
    task = load_task(cfg)  # a task file that lacks a function fails here
    if cfg.tool_parser:  # a parser vLLM lacks fails here too
        parser_class(cfg.tool_parser)
    try:
        problems = load_problems(cfg, task, "train"), load_problems(cfg, task, "test")
    except ValueError as e:  # a malformed dataset row (DataError), or too few distinct problems
        raise ConfigError(str(e)) from e
    every = problems[0] + problems[1]
    for own, at in by_task(task, every):  # a task mixture (D4): each task on its own problems
        check_sandbox(cfg, own, [every[i] for i in at])  # the model's code runs only sandboxed
        # prompt() and reward() give what a run needs
        check_task_output(own, [every[i] for i in at if i < len(problems[0])], cfg)
    eval_tasks = load_eval_tasks(cfg)  # each checked as the training task is
    resume_from = claim_out_dir(cfg, rank)  # a second run, another run's files, changed settings
    with parallel.local_rank0_first():  # one rank per machine builds or converts the model folder
        path = model_path(cfg)
        for partial in glob.glob(os.path.join(cfg.out_dir, ".tmp_ckpt_*")):  # a killed save's
            shutil.rmtree(partial, ignore_errors=True)  # (out_dir may be shared by machines)
    check_model_source(path)
    for other in (cfg.init_from, cfg.teacher):
        if other and other not in BUILT_HERE:
            check_model_source(other)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.out_dir, "config.json"))
    return cfg, device, path, resume_from, task, problems, eval_tasks


def eval_split(tokenizer, name, task, problems, cfg):
    """An eval_tasks set as a Split, its prompts tokenised once."""
    try:
        prompt_ids = tokenize_prompts(tokenizer, task, problems, cfg.max_prompt_len)
        return Split(task, problems, prompt_ids, name)
    except ConfigError as e:  # a prompt too long for max_prompt_len: say which set
        raise ConfigError(f"eval_tasks: {name}: {e}") from None


def build_models(cfg, path, device, resume_from):
    """The policy (fp32 master weights), its update wrapper, the reference (F1), the optimizer."""
    torch.manual_seed(cfg.seed)
    weights = resume_from if resume_from and not cfg.lora_rank else (cfg.init_from or path)
    adapter = resume_from if cfg.lora_rank else None
    tokenizer, policy = load_policy(cfg, weights, device, adapter=adapter)
    policy.train()
    why = fused_head_unsupported(policy) if cfg.fused_logprobs else None
    if why:  # the plain logits path is always exact
        print(f"fused_logprobs off: {why}; logprobs come from the full logits")
        cfg.fused_logprobs = False
    # under torchrun: FSDP2 shards `policy` in place (train_model is policy); DDP wraps it
    train_model = parallel.wrap(policy, cfg.parallel, cfg.dtype)
    ref = None
    if cfg.beta > 0 and not cfg.lora_rank:  # with LoRA the reference is the base, adapters off
        # the weights the run starts from (init_from, as TRL and verl take the reference), as with
        # LoRA, whose base is init_from: at step 0 the KL is 0 either way
        ref = load_reference(cfg.init_from or path, device, cfg.ref_offload)
        ref = parallel.wrap(ref, cfg.parallel, cfg.dtype, trainable=False)
    params = [p for p in policy.parameters() if p.requires_grad]  # after wrapping: FSDP2's shards
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas,
                                  weight_decay=cfg.weight_decay)
    return tokenizer, policy, train_model, ref, params, optimizer


def load_teacher(cfg, device, tokenizer):
    """L9's teacher, frozen and kept as the reference is (fp32; on the CPU between its passes with
    ref_offload). It scores the student's token ids, so it must read them as the student does:
    its tokenizer's vocabulary is the student's, or the run stops here."""
    path = model_path(cfg, cfg.teacher)
    try:
        vocab = transformers.AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError) as e:
        raise ConfigError(f"teacher={cfg.teacher!r}: its tokenizer cannot be read ({e}); a "
                          "teacher folder needs one, the student's") from None
    if vocab != tokenizer.get_vocab():
        raise ConfigError(f"teacher={cfg.teacher!r} has another tokenizer ({len(vocab)} tokens, "
                          f"the student {len(tokenizer.get_vocab())}): on-policy distillation "
                          "scores the student's token ids, so both must share one vocabulary")
    teacher = load_reference(path, device, cfg.ref_offload)
    return parallel.wrap(teacher, cfg.parallel, cfg.dtype, trainable=False)


def make_sampler(cfg, task, problems, seed=None):
    """D2's curriculum, or D3's shuffled epochs; a task mixture's (D4) one of them per task, each
    task's share of a batch by its weight."""
    if isinstance(task, Mixture):
        sizes = [len(at) for _, at in by_task(task, problems)]
        return MixtureSampler([make_sampler(cfg, None, range(size), f"{cfg.seed}:{part.name}")
                               for part, size in zip(task.parts, sizes)],
                              sizes, [part.weight for part in task.parts])
    seed = cfg.seed if seed is None else seed
    if cfg.curriculum:
        return CurriculumSampler(len(problems), seed, ramp_steps=cfg.curriculum_ramp_steps)
    return PromptSampler(len(problems), seed)


def make_engine(cfg, path, device, policy, tokenizer, task=None):
    """The sampling engine (R1): vLLM colocated, or the policy itself; wrapped for tool calls, or
    for the task's episodes."""
    # vLLM's start-up output (warnings about Triton, NUMA, thread binding) goes to a file, not the
    # console; it is printed if the start fails
    name = auto_engine() if cfg.engine == "auto" else cfg.engine  # auto: vLLM if it imports
    if name == "vllm":
        with output_to(os.path.join(cfg.out_dir, "engine.log")):
            engine = VLLMEngine(path, cfg, device)
    else:  # the policy itself samples, in the trainer's compute dtype
        # FSDP2: every rank steps until the slowest is done
        synced = parallel.world() > 1 and cfg.parallel == "fsdp"
        engine = HFEngine(policy, tokenizer, synced_gpus=synced, dtype=cfg.dtype)
    text_tools = None
    if cfg.tools:  # the model may run Python mid-completion, in the sandbox
        run = functools.partial(run_python, timeout=cfg.tool_timeout,
                                max_output=cfg.tool_output_chars)
        text_tools = TextTools(run, cfg.max_tool_calls, cfg.tool_tags)
    if text_tools or (task is not None and task.episodic):  # rollouts in turns (episodes/turns.py)
        engine = EpisodeEngine(engine, tokenizer, cfg.max_turns, cfg.tool_timeout, cfg.env_reward,
                               text_tools, cfg.tool_output_chars, cfg.tool_parser)
    return engine, name
