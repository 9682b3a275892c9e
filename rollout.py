"""Sampling: G completions per prompt from a colocated vLLM engine or a plain decoding loop (HF).

Both engines take prompts as token ids and return, per prompt, a list of G `Completion`s with the
sampler's own logprob of every sampled token, from logits / temperature (R5), so they compare
directly with the trainer's recomputed logprobs. Each row (one completion) has its own seed, a hash
of its place in the run (derive_seed), so a resumed run, or N ranks, sample what one process would
(docs/engine.md). Both sample with exactly the settings the trainer assumes, nothing from the
model's generation_config (a repetition penalty there would make the samples off-policy), and both
stop on the same tokens (stop_tokens). A step's scored completions travel as one Rollouts: whole
groups, a row per completion.
"""

import hashlib
import os
from dataclasses import dataclass, fields, replace

import torch
from tqdm import tqdm
from transformers import DynamicCache, GenerationConfig

from infra import log, parallel
from model import self_attending_mask
from perf import cpu


@dataclass
class Completion:
    prompt_ids: list  # prompt token ids
    completion_ids: list  # sampled token ids, the EOS token included when the completion stopped
    text: str  # decoded completion, special tokens dropped
    logprobs: list  # sampler's log p of each sampled token under logits / temperature
    truncated: bool  # hit max_tokens before EOS (R6)
    stop_string: str = None  # the stop string it ended on (generate's stop), else None
    # rollouts in turns (episodes/): 1 for each token the model sampled, 0 for each of a tool's
    # output
    # (logprob 0.0 there, which the mask leaves out); None: every token is the model's
    mask: list = None
    tool_calls: int = 0  # tool calls run
    tool_errors: int = 0  # of those, the ones that raised, timed out or were killed
    tool_seconds: float = 0.0  # wall time of its tool calls
    # an environment's episode (episodes/turns.py): its rewards {name: value}, or why it failed
    # ("error", "timeout", "wrong type"); None without an environment
    env_rewards: object = None


@dataclass
class Rollouts:
    """Scored completions of whole groups, the G rows of a prompt contiguous. Fields are (N,):
    N = this rank's prompts x G."""

    problem: list  # index of each row's problem
    # rollout.Completion per row; empty in a gathered() copy (they stay on their rank)
    completions: list
    rewards: torch.Tensor  # shaped reward per row (W2, W3)
    components: dict  # the reward's parts (correct, format, ...) -> (N,); shaped into rewards
    lengths: torch.Tensor  # completion tokens per row
    truncated: torch.Tensor  # 1.0 where the completion hit max_completion_len (R6)
    tool_calls: torch.Tensor  # tool calls per row (all 0 without tools)
    tool_errors: torch.Tensor  # of those, the calls that failed
    tool_tokens: torch.Tensor  # tokens of the tools' output: context, not trained on
    score_seconds: float = 0.0
    tool_seconds: float = 0.0
    policy_version: int = None  # R8: updates the weights that made it had seen (async only)

    def __len__(self):
        return len(self.rewards)

    def component(self, name):
        """(N,) values of a reward component; 0 on rows that did not report it (as score_batch)."""
        return self.components.get(name, torch.zeros(len(self)))

    def rows(self, rows, names=None):
        """These rows, in this order; components `names` (default: this batch's)."""
        names = list(self.components) if names is None else names
        return replace(
            self, problem=[self.problem[r] for r in rows],
            completions=[self.completions[r] for r in rows] if self.completions else [],
            components={k: self.component(k)[rows] for k in names},
            **{f: getattr(self, f)[rows] for f in ROW_TENSORS})

    def groups(self, which, G):
        """The rows of the given group indices, in order."""
        return self.rows([g * G + j for g in which for j in range(G)])

    def __add__(self, other):
        """Both batches' rows, self's first (R7's refills). Components: both batches' names (a task
        may report a component for some problems only; a batch whose rewards all failed has errors
        alone)."""
        names = sorted({*self.components, *other.components})
        return replace(
            self, problem=self.problem + other.problem,
            completions=self.completions + other.completions,
            components={k: torch.cat([self.component(k), other.component(k)]) for k in names},
            score_seconds=self.score_seconds + other.score_seconds,
            tool_seconds=self.tool_seconds + other.tool_seconds,
            **{f: torch.cat([getattr(self, f), getattr(other, f)]) for f in ROW_TENSORS})

    def gathered(self):
        """Every rank's rows in rank order (= one process's order), without the completions."""

        def gather(t):
            return torch.tensor(parallel.all_gather_list(t.tolist()))

        # every rank gathers the union of the ranks' component names, in one order
        names = sorted(set(parallel.all_gather_list(sorted(self.components))))
        return replace(
            self, problem=parallel.all_gather_list(self.problem), completions=[],
            components={k: gather(self.component(k)) for k in names},
            **{f: gather(getattr(self, f)) for f in ROW_TENSORS})


# Rollouts' (N,) tensors: rows(), + and gathered() take each alike (replace() copies the rest)
ROW_TENSORS = tuple(f.name for f in fields(Rollouts) if f.type is torch.Tensor)


def derive_seed(*key):
    """A seed below 2**63 (vLLM keeps seeds as int64) from a tuple of ints and strings, e.g.
    (seed, "train", step, slot, j): blake2b of its repr, so keys that differ in any place give
    unrelated seeds. (A sum like seed + step + slot * K + j repeats: row j of step t + 1 is row
    j + 1 of step t.)"""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_seeds(key, first, count, n):
    """One seed per row: n rows for each of `count` prompts at global slots first, first + 1, ...

    Row j of slot i gets derive_seed(*key, i, j): a hash of the run's seed, the stream (a training
    step, or eval), the prompt's place in the step's global batch and the row's place in its group.
    Never the rank or the run's history: a resumed run, or N ranks, sample what one straight run
    does, and no two rows of a run, nor two turns of an episode
    (episodes.turns.turn_seed), share a seed.
    """
    return [derive_seed(*key, slot, j) for slot in range(first, first + count) for j in range(n)]


def check_seeds(prompts, n, seeds):
    """Both engines take one seed per row (prompt-major): a clear error for any other count, before
    an engine indexes past the list or vLLM refuses unequal prompts and sampling settings."""
    if len(seeds) != len(prompts) * n:
        raise ValueError(f"seeds: one per row, {len(prompts)} prompts x n={n} = "
                         f"{len(prompts) * n}; got {len(seeds)} (row_seeds makes them)")


def stop_tokens(tokenizer, generation_config):
    """Token ids that end a completion: the tokenizer's EOS and every EOS the model's
    generation_config lists (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>). Both engines stop on
    exactly these."""
    eos = getattr(generation_config, "eos_token_id", None)
    listed = [eos] if isinstance(eos, int) else list(eos or [])
    return sorted({tokenizer.eos_token_id, *listed} - {None})


class VLLMEngine:
    """A colocated vLLM engine in-process, given the policy's weights before each generation (R1,
    R2)."""

    def __init__(self, path, cfg, device):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: a push is a tensor copy
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm_cpu_kv_cache_gb))  # GiB, CPU
        # one line per step is ours; set it to INFO to debug
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        log.quiet_harmless_vllm_warning()
        # R1: sleep mode hands the GPU memory to the trainer between generations. Level 1 copies the
        # weights to CPU RAM and back; level 2 drops them, which is free here because every wake is
        # followed by a full push (vLLM saves and restores its buffers, e.g. rotary caches, itself).
        on_gpu = torch.device(device).type == "cuda"  # "cuda", or "cuda:<local rank>" (torchrun)
        self.sleep_level = cfg.vllm_sleep_level if on_gpu else 0
        self.llm = LLM(
            model=path, dtype=cfg.dtype, seed=cfg.seed, enforce_eager=not on_gpu,
            max_model_len=cfg.max_prompt_len + cfg.max_completion_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            # on a CPU, KV blocks short enough that a group's G completions share their prompt's
            block_size=None if on_gpu else cpu.VLLM_CPU_BLOCK_SIZE,
            logprobs_mode="processed_logprobs",  # after temperature (R5); "raw" would ignore it
            use_tqdm_on_load=False,  # no progress bar for one small file
            # under torchrun: one engine per rank (or per group of vllm_tensor_parallel consecutive
            # ranks), joined to torchrun's process group
            distributed_executor_backend="external_launcher" if parallel.launched else None,
            tensor_parallel_size=cfg.vllm_tensor_parallel, enable_sleep_mode=self.sleep_level > 0)
        self.group = parallel.consecutive_group(cfg.vllm_tensor_parallel)  # the ranks sharing it
        self.tokenizer = self.llm.get_tokenizer()
        try:
            self.stop = stop_tokens(self.tokenizer, GenerationConfig.from_pretrained(path))
        except OSError:  # the folder has no generation_config.json
            self.stop = stop_tokens(self.tokenizer, None)
        # per-request seeds tie each row's sampling to its seed on a GPU; on a CPU they crash
        self.per_request_seed = on_gpu
        self.dtype = getattr(torch, cfg.dtype)  # the engine's weights (the trainer's: fp32 masters)
        self.asleep = False

    def generate(self, prompts, n, *, seeds, temperature, top_p, top_k, max_tokens, stop=None,
                 progress=False, task=None, problems=None):
        """n completions per prompt; seeds: one per row (prompt-major); max_tokens: one budget, or
        one per prompt; stop: strings that end a completion (kept in it), plus the stop tokens.
        task, problems: what the prompts were made from (episodes.turns.EpisodeEngine's)."""
        from vllm import SamplingParams
        check_seeds(prompts, n, seeds)
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        mine = slice(None)  # the rows of the engine's output that are this rank's own
        if self.group is not None:  # tensor parallel: the group's ranks give the engine one batch
            mine, prompts, seeds, budgets = parallel.gather_group(self.group, prompts, seeds,
                                                                  budgets)
        if not prompts:  # a rank with nothing left to generate (tool turns under torchrun)
            return []
        # explicit SamplingParams take nothing from generation_config but its EOS list (vLLM's
        # defaults would take its repetition penalty too); stop_token_ids: the HF engine's stop set
        params = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                      logprobs=0 if temperature > 0 else None, stop_token_ids=self.stop,
                      stop=stop or None, include_stop_str_in_output=True)
        if self.per_request_seed:
            # one request per row, each with the row's own seed: with n > 1 vLLM would seed a
            # request's samples seed, seed + 1, ... (its parallel sampling runs them as n child
            # requests, so this costs the same, and the prefix cache still computes the prompt once)
            requests = [p for p in prompts for _ in range(n)]
            params = [SamplingParams(**params, n=1, max_tokens=m, seed=seed)
                      for seed, m in zip(seeds, (m for m in budgets for _ in range(n)))]
        else:
            cpu.seed_vllm(seeds[0])
            requests = prompts
            params = [SamplingParams(**params, n=n, max_tokens=m) for m in budgets]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in requests], params,
                                    use_tqdm=progress)
        # prompt-major rows, n per prompt, whichever way they were requested
        rows = [self._completion(out.prompt_token_ids, c) for out in outputs for c in out.outputs]
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))][mine]

    def _completion(self, prompt_ids, c):
        """A Completion from a vLLM output, decoded here: vLLM's incremental detokenizer can drop a
        trailing partial UTF-8 byte; both engines must score the same text for the same tokens."""
        logprobs = [next(iter(d.values())).logprob for d in c.logprobs] if c.logprobs else []
        stop_string = c.stop_reason if isinstance(c.stop_reason, str) else None
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return Completion(list(prompt_ids), list(c.token_ids), text, logprobs,
                          c.finish_reason == "length", stop_string)

    def wake(self, named_tensors):
        """R1 + R2, before generating: wake the weights, push the policy's, then wake the KV cache.
        Nothing reloads weights from disk, so vLLM then holds exactly the trainer's weights; pushing
        before the KV cache is back keeps the peak at weights only."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.push_weights(named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # stale, it would serve KV computed with the previous policy

    def sleep(self):
        """R1, after generating: free the GPU memory for the update (a no-op without sleep mode)."""
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def push_weights(self, named_tensors):
        """Load (name, tensor) pairs in place, consumed lazily: one tensor (or bucket) at a time."""
        # as vLLM would round them, one at a time
        cast = ((name, t.to(self.dtype)) for name, t in named_tensors)
        # the worker's reload_weights (not its model runner's) sets vLLM's current config, which MoE
        # and quantised weight loaders read
        self.llm.collective_rpc(lambda worker, w: worker.reload_weights(weights_iterator=w),
                                args=(cast,))


class HFEngine:
    """The policy itself as the sampler, in a plain batched decoding loop: no second copy of the
    weights, so nothing to push, and nothing from the model's generation_config but its EOS list."""

    def __init__(self, policy, tokenizer, synced_gpus=False, dtype="float32"):
        # FSDP2 gathers weights in every forward: all ranks keep stepping until the slowest is done
        self.policy, self.tokenizer, self.synced_gpus = policy, tokenizer, synced_gpus
        self.autocast = dtype == "bfloat16"  # the trainer's compute dtype (R2: the same numerics)
        hf_model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self.stop = stop_tokens(tokenizer, hf_model.generation_config)

    @torch.no_grad()
    def generate(self, prompts, n, *, seeds, temperature, top_p, top_k, max_tokens, stop=None,
                 progress=False, task=None, problems=None):
        """As VLLMEngine.generate."""
        check_seeds(prompts, n, seeds)
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        # every prompt's n rows in one batch, each row drawn from a generator of its own seed
        rows = [(list(p), seeds[i * n + j], m)
                for i, (p, m) in enumerate(zip(prompts, budgets)) for j in range(n)]
        was_training = self.policy.training
        self.policy.eval()
        try:
            tokens, logprobs, ends = self._decode(rows, temperature, top_p, top_k, stop, progress)
        finally:
            self.policy.train(was_training)
        groups = []
        for i, prompt in enumerate(prompts):
            group = []
            for r in range(i * n, (i + 1) * n):
                end, why = ends[r]  # the stop token or string included, the padding after it not
                sampled = tokens[r][:end]
                text = self.tokenizer.decode(sampled, skip_special_tokens=True)
                group.append(Completion(list(prompt), sampled, text,
                                        logprobs[r][:end] if temperature > 0 else [],
                                        why == "length",
                                        why if why not in ("length", "eos") else None))
            groups.append(group)
        return groups

    def _decode(self, rows, temperature, top_p, top_k, stop, progress):
        """(tokens, logprobs, ends) per row, from a KV cache: tokens and logprobs as far as the
        longest row went, and where the row ends with why: (length, "eos" | "length" | the stop
        string). Prompts are left-padded so every row's next token goes in the same column; each
        row's positions count from its own first token (0, 1, ...), as the trainer's right-padded
        rows do."""
        device = next(self.policy.parameters()).device
        pad = self.tokenizer.pad_token_id
        if not rows and not self.synced_gpus:
            return [], [], []
        rows = rows or [([pad], 0, 1)]  # FSDP2: a rank with no prompts still joins every forward
        ends = [None] * len(rows)
        R, P = len(rows), max(len(p) for p, _, _ in rows)
        ids = torch.full((R, P), pad, dtype=torch.long, device=device)
        mask = torch.zeros(R, P, dtype=torch.long, device=device)
        for r, (prompt, _, _) in enumerate(rows):
            ids[r, P - len(prompt) :] = torch.tensor(prompt, device=device)
            mask[r, P - len(prompt) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        generators = [torch.Generator(device).manual_seed(seed) for _, seed, _ in rows]
        budgets = [m for _, _, m in rows]  # each row ends at its own budget (_ended)
        # under synced_gpus every forward is a collective: a rank loops as long as the longest
        # budget of any rank (its own rows done, it feeds padding), or the ranks would call
        # different collectives and hang
        steps = int(parallel.all_max(max(budgets))) if self.synced_gpus else max(budgets)
        cache, done, logprobs = DynamicCache(), torch.zeros(R, dtype=torch.bool, device=device), []
        tokens = [[] for _ in rows]  # each row's sampled tokens, up to its end
        # one autocast region around the whole loop: each fp32 master weight is cast to bf16 once a
        # call (autocast caches casts of leaf weights until its outermost region ends), not a token
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for k in tqdm(range(steps), desc="generate", disable=not progress, leave=False):
                # the prefill's padding queries attend to themselves (no fully masked row); the
                # steps after it add one real query per row, which attends to itself anyway
                attend = self_attending_mask(self.policy, mask) if k == 0 else mask
                out = self.policy(input_ids=ids, attention_mask=attend, position_ids=positions,
                                  past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits = out.logits[:, -1].float()  # (R, V)
                token, logp = sample_next(logits, temperature, top_p, top_k, generators)
                token = torch.where(done, pad, token)  # a stopped row is fed padding, and keeps it
                logprobs.append(logp)
                step = token.tolist()
                # the rows that took a token now: do they end here?
                for r in (~done).nonzero().flatten().tolist():
                    tokens[r].append(step[r])
                    why = self._ended(tokens[r], budgets[r], stop)
                    if why:
                        ends[r], done[r] = (k + 1, why), True
                # under synced_gpus, done on every rank (each forward is a collective there)
                all_done = bool(done.all())
                if parallel.all_min(int(all_done)) if self.synced_gpus else all_done:
                    break
                ids, positions = token[:, None], positions[:, -1:] + 1
                mask = torch.cat([mask, mask.new_ones(R, 1)], 1)
        logprobs = torch.stack(logprobs, 1).tolist() if temperature > 0 else [[] for _ in rows]
        return tokens, logprobs, ends

    def _ended(self, row, budget, stop):
        """Why a row ends at its last token ("eos", a stop string, "length"), or None: it goes on.
        A stop string ends the row at the first token whose text completes it, as vLLM's check
        does."""
        if row[-1] in self.stop:
            return "eos"
        # the row's last tokens hold any stop string completed now (a token is at least a byte)
        for s in stop or ():
            if s in self.tokenizer.decode(row[-len(s) - 4 :], skip_special_tokens=True):
                return s
        return "length" if len(row) >= budget else None

    def wake(self, named_tensors):
        """The engine samples from the policy object itself: always current, nothing to push."""

    def sleep(self):
        """Nothing to free: there is no second copy of the weights."""


def sample_next(logits, temperature, top_p, top_k, generators):
    """(R,) next tokens and (R,) their logprobs under the processed distribution: logits /
    temperature, then top-k, then top-p (transformers' order; the kept tokens renormalised, as
    vLLM's processed logprobs are). Each row draws from its own generator, so a row's sample depends
    on its seed only, not on the batch it is in (N ranks sample what one process does).
    temperature 0: greedy, logprobs None."""
    # a NaN or +inf logit, or a row of -inf: weights an update blew up, no token to draw (a masked
    # token's -inf is fine; amax carries a NaN)
    if not torch.isfinite(logits.amax(-1)).all():
        raise FloatingPointError("the policy's logits are not finite")
    if temperature == 0:
        return logits.argmax(-1), None
    z = logits / temperature  # (R, V)
    if top_k > 0:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:  # drop the least likely tokens whose total probability is at most 1 - top_p
        sorted_z, order = z.sort(dim=-1)
        tail = sorted_z.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[:, -1] = False  # the most likely token always stays
        z = z.masked_fill(tail.scatter(1, order, tail), float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    # inverse-CDF sampling: one uniform per row from the row's own generator, and the first token
    # whose cumulative probability passes it (a masked token, p = 0, never does). torch.multinomial
    # would draw a random number per vocabulary entry, row by row: slow on a CPU at V = 49k
    cdf = logp.double().exp().cumsum(-1)  # (R, V); fp64, so 150k summed probabilities do not drift
    u = torch.cat([torch.rand(1, generator=g, device=z.device, dtype=torch.float64)
                   for g in generators])
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)  # (R,)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
