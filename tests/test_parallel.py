"""torchrun with 2 CPU processes (gloo) against one process on the same global batch.

    pytest tests/test_parallel.py

FSDP2 and DDP must give the single-process run's samples, losses and weights (float32, within
1e-5), write their files once, and hand checkpoints back and forth between 1 and 2 ranks.
The HF engine seeds every prompt from its place in the global batch, so 2 ranks sample exactly
what one process does; each run is ~10-20 s of start-up on this CPU.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from grpo import forward_logprobs, pad_batch
from infra import parallel
from infra.model_files import vllm_available
from loss import LossSettings, grpo_loss
from rollout import Completion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
requires_vllm = pytest.mark.skipif(not vllm_available() and not os.environ.get("CI"),
                                   reason="vllm not installed")
# float32, a KL term (so the sharded reference runs too), several micro-batches per rank,
# a save every step
ARGS = ["--config", os.path.join(ROOT, "config", "tiny.py"), "--engine=hf", "--dtype=float32",
        "--max_steps=3",
        "--lr=1e-3", "--beta=0.01", "--eval_every=0", "--save_every=1", "--keep_checkpoints=5",
        "--sample_every=1", "--sample_groups=2", "--micro_batch_tokens=128"]


def run(out_dir, ranks, *extra):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}"]
    cmd = (launcher if ranks > 1 else [sys.executable]) + [os.path.join(ROOT, "grpo.py"), *ARGS,
                                                            f"--out_dir={out_dir}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def weights(ckpt):
    from transformers import AutoModelForCausalLM

    # what a user would load
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()


def max_weight_diff(a, b):
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps on one process, on 2 ranks with FSDP2, and on 2 ranks with DDP."""
    base = tmp_path_factory.mktemp("parallel")
    out = {"single": base / "single", "fsdp": base / "fsdp", "ddp": base / "ddp"}
    run(out["single"], 1)
    run(out["fsdp"], 2, "--parallel=fsdp")
    run(out["ddp"], 2, "--parallel=ddp")
    return out


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_ranks_match_one_process(runs, mode):
    one, two = (read_jsonl(runs["single"] / "metrics.jsonl"),
                read_jsonl(runs[mode] / "metrics.jsonl"))
    assert [m["step"] for m in two] == [0, 1, 2]
    for a, b in zip(one, two):
        # the same samples
        assert a["reward"] == b["reward"] and a["response_length"] == b["response_length"]
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "kl", "grad_norm", "entropy", "clip_frac_low",
                    "sampler_logprob_diff_mean"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    # a real update, not a no-op that trivially agrees
    assert one[-1]["kl"] > 0 and one[-1]["loss"] != 0

    # rank 0 dumps its own groups, which are the first groups of the global batch
    def dumped(run):
        return [(s["step"], s["completion"]) for s in read_jsonl(run / "samples.jsonl")]

    assert dumped(runs[mode]) == dumped(runs["single"])
    assert max_weight_diff(runs["single"] / "ckpt_000003", runs[mode] / "ckpt_000003") < 1e-5
    opt_one = torch.load(runs["single"] / "ckpt_000003" / "optimizer.pt")
    opt_two = torch.load(runs[mode] / "ckpt_000003" / "optimizer.pt")
    # keyed by parameter name, whatever the sharding
    assert opt_one["state"].keys() == opt_two["state"].keys()
    for name, state in opt_one["state"].items():
        assert torch.allclose(state["exp_avg"], opt_two["state"][name]["exp_avg"], atol=1e-6)


def test_lora_under_fsdp_matches_one_process(tmp_path):
    """LoRA: the peft wrapper around a sharded model trains, samples
    (HF generate) and saves its adapter alike."""
    from safetensors.torch import load_file

    run(tmp_path / "one", 1, "--lora_rank=4", "--max_steps=2")
    run(tmp_path / "two", 2, "--lora_rank=4", "--max_steps=2")
    for a, b in zip(read_jsonl(tmp_path / "one" / "metrics.jsonl"),
                    read_jsonl(tmp_path / "two" / "metrics.jsonl")):
        assert a["reward"] == b["reward"]
        for key in ("loss", "kl", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    one, two = (load_file(tmp_path / d / "ckpt_000002" / "adapter_model.safetensors")
                for d in ("one", "two"))
    assert one.keys() == two.keys() and any("lora_B" in k for k in one)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    # B starts at 0: it trained
    assert max(v.abs().max().item() for k, v in two.items() if "lora_B" in k) > 0


def test_only_rank_zero_writes(runs):
    out = runs["fsdp"]
    files = [".lock", "ckpt_000001", "ckpt_000002", "ckpt_000003", "config.json", "metrics.jsonl",
             "samples.jsonl", "tiny_model"]
    assert sorted(os.listdir(out)) == files
    assert len(read_jsonl(out / "metrics.jsonl")) == 3  # one line per step, not one per rank
    assert len(read_jsonl(out / "samples.jsonl")) == 3 * 2 * 4  # 3 steps x 2 groups x G=4, once
    single = runs["single"] / "ckpt_000003"
    assert sorted(os.listdir(out / "ckpt_000003")) == sorted(os.listdir(single))


def resume_from(source, out_dir, step):
    """A fresh out_dir holding only `source`'s checkpoint of `step` and its log up to then."""
    os.makedirs(out_dir)
    shutil.copytree(source / f"ckpt_{step:06d}", out_dir / f"ckpt_{step:06d}")
    shutil.copytree(source / "tiny_model", out_dir / "tiny_model")
    # resume cuts the lines after `step`
    shutil.copy(source / "metrics.jsonl", out_dir / "metrics.jsonl")


@pytest.mark.parametrize("source, ranks", [("fsdp", 1), ("single", 2)])
def test_checkpoint_resumes_on_another_number_of_ranks(runs, tmp_path, source, ranks):
    out = tmp_path / f"{source}_on_{ranks}"
    resume_from(runs[source], out, step=2)
    run(out, ranks, "--resume=true")
    log = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in log] == [0, 1, 2]
    assert abs(log[2]["loss"] - read_jsonl(runs["single"] / "metrics.jsonl")[2]["loss"]) < 1e-5
    assert max_weight_diff(runs["single"] / "ckpt_000003", out / "ckpt_000003") < 1e-5


@requires_vllm
def test_vllm_engine_per_rank_gets_the_sharded_weights(tmp_path):
    """One vLLM engine per rank (external_launcher);
    each is pushed the FSDP2-sharded policy every step."""
    out = tmp_path / "vllm"
    run(out, 2, "--engine=vllm", "--save_every=0", "--sample_every=0")
    log = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in log] == [0, 1, 2]
    # fp32 on both sides: after each update the engines sample from exactly the trainer's weights
    for m in log:
        assert m["sampler_logprob_diff_max"] < 1e-4, m["sampler_logprob_diff_max"]
    assert log[-1]["kl"] > 0


@requires_vllm
def test_vllm_tensor_parallel_engine_shared_by_two_ranks(runs, tmp_path):
    """vllm_tensor_parallel=2: both ranks drive one engine split over them; each keeps its own
    prompts' samples (grpo.rollout checks that every completion came back for the prompt it asked
    for)."""
    out = tmp_path / "tp"
    run(out, 2, "--engine=vllm", "--vllm_tensor_parallel=2", "--save_every=0")
    log = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in log] == [0, 1, 2] and log[-1]["kl"] > 0
    for m in log:  # the sharded engine holds exactly the trainer's weights after every push
        assert m["sampler_logprob_diff_max"] < 1e-4, m["sampler_logprob_diff_max"]

    def prompts(run):
        return [(s["step"], s["problem"]["id"]) for s in read_jsonl(run / "samples.jsonl")]

    assert prompts(out) == prompts(runs["single"])


def test_padding_micro_batches_add_nothing(monkeypatch, tmp_path):
    """A rank with fewer micro-batches gets extra ones whose loss and gradient are exactly 0."""
    from transformers import AutoModelForCausalLM

    from config import load_config
    from model import build_tiny

    cfg = load_config(os.path.join(ROOT, "config", "tiny.py"), ["--dtype=float32"])
    folder = build_tiny(str(tmp_path / "tiny"))
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = [Completion([5, 6, 7], [8, 9, 10, 11], "", [-1.0] * 4, False),
            Completion([5, 6], [12, 13], "", [-1.0] * 2, False)]
    ids, attention, mask, sampler_lp = pad_batch(rows, pad_id=0)
    advantages = torch.tensor([1.0, -1.0])
    # another rank has 3 micro-batches; this one has 1
    monkeypatch.setattr(parallel, "all_max", lambda x: 3)
    tensors = dict(ids=ids, attention=attention, mask=mask, sampler_lp=sampler_lp,
                   advantages=advantages)
    t, batches = parallel.even_micro_batches(tensors, [[0, 1]])
    assert batches == [[0, 1], [2], [2]] and list(t) == list(tensors)
    assert all(len(v) == 3 and torch.equal(v[:2], tensors[k]) for k, v in t.items())
    assert t["mask"][2].sum() == 0 and t["attention"][2].sum() > 0 and t["advantages"][2] == 0
    ids, attention, mask, advantages = t["ids"], t["attention"], t["mask"], t["advantages"]
    lp, _ = forward_logprobs(policy, ids[[2]], attention[[2]], cfg, 1.0)
    loss, _ = grpo_loss(lp, lp.detach(), advantages[[2]], mask[[2]],
                        LossSettings(max_completion_len=4), num_tokens=6, num_seqs=2)
    loss.backward()
    assert loss.item() == 0 and torch.isfinite(lp).all()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in policy.parameters())


def test_a_rank_left_with_no_rows_still_makes_its_passes(monkeypatch):
    """R7 on several ranks can leave one rank without groups: it runs dummy micro-batches only."""
    ids, attention, mask, sampler_lp = pad_batch([], pad_id=0)
    assert ids.shape == (0, 2)
    monkeypatch.setattr(parallel, "all_max", lambda x: 2)
    tensors = dict(ids=ids, attention=attention, mask=mask, sampler_lp=sampler_lp,
                   advantages=torch.zeros(0))
    t, batches = parallel.even_micro_batches(tensors, [])
    assert batches == [[0], [0]] and t["ids"].shape == (1, 2)
    assert t["attention"].tolist() == [[1, 1]]
    assert t["mask"].sum() == 0 and t["advantages"].tolist() == [0.0]


def test_two_ranks_match_one_process_with_mini_batches_and_batch_wide_statistics(tmp_path):
    """mini_batches splits by global group, the batch std and the entropy quantile are the global
    batch's: 2 FSDP ranks still take exactly one process's steps."""
    extra = ["--mini_batches=2", "--num_iterations=2", "--adv_scale=batch",
             "--entropy_top_quantile=0.5", "--max_steps=2"]
    run(tmp_path / "single", 1, *extra)
    run(tmp_path / "fsdp", 2, "--parallel=fsdp", *extra)
    one, two = (read_jsonl(tmp_path / "single" / "metrics.jsonl"),
                read_jsonl(tmp_path / "fsdp" / "metrics.jsonl"))
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["optimizer_steps"] == b["optimizer_steps"] == 4
        for key in ("loss", "kl", "grad_norm", "approx_kl_old", "pg_token_frac"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    assert one[-1]["approx_kl_old"] > 0  # the later steps saw a moved policy
    assert (max_weight_diff(tmp_path / "single" / "ckpt_000002", tmp_path / "fsdp" / "ckpt_000002")
            < 1e-5)


def decode_on_two_ranks(out_dir):
    """Run under torchrun (2 CPU ranks): the HF engine on an FSDP2 policy (synced_gpus) with budgets
    that differ between the ranks, as the second tool turn gives them, and a tool rollout in which
    rank 1 has no prompt (its engine decodes a one-token dummy row). Each rank writes its
    completions and the unsharded engine's."""
    import copy

    from config import load_config
    from episodes.tools import TextTools
    from episodes.turns import EpisodeEngine
    from model import build_tiny, load_policy
    from rollout import HFEngine

    rank, _, _ = parallel.setup("cpu")
    with parallel.local_rank0_first():
        folder = build_tiny(os.path.join(out_dir, "tiny"))
    tokenizer, policy = load_policy(load_config(overrides=["--dtype=float32"]), folder, "cpu")
    alone = HFEngine(copy.deepcopy(policy), tokenizer)
    synced = HFEngine(parallel.wrap(policy, "fsdp", "float32"), tokenizer, synced_gpus=True)
    texts = ("Write only digits, like 4 2 7:", "<think> 1 + 2")
    prompts = [tokenizer(text).input_ids for text in texts]
    sampling = dict(temperature=1.0, top_p=1.0, top_k=-1)
    calls = [(prompts, [3, 5]) if rank == 0 else (prompts[:1], [9]),  # rank 1 goes 4 steps further
             ([], []) if rank == 0 else (prompts, [4, 2])]  # rank 0 has nothing: a dummy row
    got, want = [], []
    for rank_prompts, budgets in calls:
        seeds = list(range(2 * len(rank_prompts)))  # one a row
        for engine, into in ((synced, got), (alone, want)):
            groups = engine.generate(rank_prompts, 2, seeds=seeds, max_tokens=budgets, **sampling)
            into.append([[c.completion_ids, c.logprobs] for g in groups for c in g])
    tool_prompts = prompts if rank == 0 else []  # rank 1: no live row from the first turn on
    for engine, into in ((synced, got), (alone, want)):
        scripted = TextTools(lambda code: ("7 7 7", True), 2, ("", "e"))
        tools = EpisodeEngine(engine, tokenizer, text_tools=scripted)
        seeds = list(range(2 * len(tool_prompts)))
        groups = tools.generate(tool_prompts, 2, seeds=seeds, max_tokens=24, **sampling)
        into.append([[c.completion_ids, c.mask, c.tool_calls] for g in groups for c in g])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"got": got, "want": want}, f)


def test_hf_engine_under_fsdp_decodes_until_every_rank_is_done(tmp_path):
    """synced_gpus: every forward is a collective, so a rank whose rows end sooner (a smaller
    budget, or no row at all) keeps stepping until the last rank is done; each row still ends at
    its own budget, as on one process. Stepping by its own budget only, a rank would leave the loop
    while the other still gathers weights: they hang."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = launcher + [os.path.join(ROOT, "tests", "test_parallel.py"), str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        log = proc.communicate(timeout=150)[0]
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops both ranks on SIGTERM
        pytest.fail("the two ranks hung: " + proc.communicate(timeout=60)[0][-3000:])
    assert proc.returncode == 0, log[-5000:]
    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
        # the sharded, synced engine samples what one process does
        assert ranks[-1]["got"] == ranks[-1]["want"]
    assert max(len(row[0]) for row in ranks[1]["got"][0]) > 5  # past rank 0's longest budget
    assert sum(row[2] for row in ranks[0]["got"][-1]) >= 1  # rank 0's tool rollout took a 2nd turn


if __name__ == "__main__":  # torchrun tests/test_parallel.py OUT_DIR: the worker of the test above
    decode_on_two_ranks(sys.argv[1])


def test_two_ranks_with_an_async_sampler_match_one_process(tmp_path):
    """R8 under torchrun: rank 0's sampler makes the global batch, every rank trains on its share
    of the groups, rank 0 pushes the gathered weights: the same run as one process with the
    sampler (samples, losses, the weights it ends with)."""
    extra = ["--async_rollouts=true", "--is_correction=token_truncate"]
    run(tmp_path / "one", 1, *extra)
    run(tmp_path / "two", 2, "--parallel=fsdp", *extra)
    one, two = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in ("one", "two"))
    assert [m["staleness"] for m in two] == [0, 1, 1]
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
        for key in ("loss", "kl", "grad_norm", "is_weight_mean"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    last = [tmp_path / r / "ckpt_000003" for r in ("one", "two")]
    assert max_weight_diff(*last) < 1e-5


def test_two_ranks_play_an_environment_as_one_process(tmp_path):
    """Episodes under torchrun: each rank plays its rows' turns, the ranks turn in lockstep (FSDP's
    HF engine), and the run is one process's: the same rewards, turns and losses."""
    game = tmp_path / "game.py"  # the guess game, a model turn ending at a space (short turns)
    game.write_text("from tasks.guess import environment, problems, prompt\nSTOP = [' ']\n")
    extra = [f"--task={game}", "--max_turns=3", "--max_prompt_len=128",
             "--max_completion_len=64", "--micro_batch_tokens=256"]
    run(tmp_path / "one", 1, *extra)
    run(tmp_path / "two", 2, "--parallel=fsdp", *extra)
    one, two = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in ("one", "two"))
    assert all(m["tools/calls_per_completion"] > 0 for m in one)  # the environment answered
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
        assert a["tools/calls_per_completion"] == b["tools/calls_per_completion"]
        for key in ("loss", "kl", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
