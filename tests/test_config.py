"""Config loading, overrides and pre-flight checks (O6).   pytest tests/test_config.py"""

import ast
import dataclasses
import glob
import inspect
import json
import math
import os
import re

import pytest

import config
from config import Config, ConfigError, load_config
from episodes.task import load_task
from infra import checkpoint
from infra.checkpoint import load_saved, save_config
from infra.preflight import check_run, preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_FILES = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))


def write(tmp_path, text):
    path = tmp_path / "run.py"
    path.write_text(text)
    return str(path)


def test_every_setting_has_a_comment():
    source = inspect.getsource(Config).splitlines()
    body = ast.parse(inspect.getsource(Config)).body[0].body
    fields = [n for n in body if isinstance(n, ast.AnnAssign)]
    assert len(fields) == len(dataclasses.fields(Config))
    for node in fields:
        line = source[node.lineno - 1]
        comment = line.split("  # ", 1)[1] if "  # " in line else ""
        assert len(comment) > 10, f"no comment on: {line.strip()}"


def test_every_technique_setting_names_its_spec_id():
    # the techniques that live in config, advantage and loss
    for tech in ["D1", "D2", "W2", "W3", "R1", "R3", "R4", "A1", "A2", "A3", "A5", "A6", "L1",
                 "L2", "L4", "L5", "L7", "L8", "L9", "F2", "O1", "O2", "O3", "O5"]:
        assert f"{tech}:" in inspect.getsource(Config), tech


def clip_grad(cfg):
    """d loss / d logprob of one token with ratio 1.25 and advantage 1, under cfg's settings."""
    import torch

    from loss import grpo_loss

    lp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    loss, _ = grpo_loss(lp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), cfg)
    return torch.autograd.grad(loss, lp)[0].item()


def test_the_loss_and_advantage_settings_are_configs_by_name_and_default():
    """grpo_loss and group_advantages take the run's Config as their settings: every field of
    LossSettings and AdvantageSettings is a setting of the same name, with the same default
    (max_completion_len excepted: the loss's None is the micro-batch's width)."""
    from advantage import AdvantageSettings
    from loss import LossSettings

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for f in dataclasses.fields(LossSettings) + dataclasses.fields(AdvantageSettings):
        assert f.name in defaults, f.name
        if f.name != "max_completion_len":
            assert f.default == defaults[f.name], f.name


def test_defaults_load_and_derive():
    cfg = load_config()
    assert cfg.prompts_per_step == cfg.batch_size // cfg.group_size == 32  # 32 prompts x 4
    assert cfg.clip_eps_high == 0
    # the loss takes them by name; clip_eps_high = 0 is clip_eps: a ratio of 1.25 with A > 0 is
    # clipped at the default 0.2 (no gradient), not at 0.28
    assert clip_grad(cfg) == 0.0
    high = load_config(overrides=["--clip_eps_high=0.28"])
    assert high.clip_eps_high == 0.28 and clip_grad(high) == pytest.approx(-1.25)
    cfg = load_config(overrides=["--wrong_penalty=-0.1", "--reward_weights=brief:0.5, style:0",
                                 "--data_columns=question:prompt"])
    assert cfg.shaping["wrong_penalty"] == -0.1 and set(cfg.shaping) == set(config.REWARD_KEYS)
    assert (cfg.component_weights == {"brief": 0.5, "style": 0.0}
            and cfg.data_column_map == {"question": "prompt"})


def test_run_file_then_overrides_apply_last(tmp_path, capsys):
    path = write(tmp_path, "import math\ngroup_size = 16\nbatch_size = 128\nlr = 1\n_scratch = 3\n")
    cfg = load_config(path, ["--group_size=4", "--adam_betas=0.9,0.95", "--adaptive_kl=false",
                             "--beta=0.01"])
    assert cfg.group_size == 4  # override beats the run file
    assert cfg.batch_size == 128 and cfg.prompts_per_step == 32
    assert cfg.lr == 1.0 and type(cfg.lr) is float  # an int may stand for a float
    assert cfg.adam_betas == (0.9, 0.95)
    assert load_config(overrides=["--math_kinds=add,sub"]).task_options["math_kinds"] == ("add",
                                                                                         "sub")
    assert load_config(overrides=["--task=countdown", "--countdown_numbers=4"]
                       ).task_options["countdown_numbers"] == (4,)
    out = capsys.readouterr().out
    assert "override: group_size = 4" in out and "override: adam_betas = (0.9, 0.95)" in out


MY_TASK = """
OPTIONS = {
    "my_levels": (1, 2),  # a tuple of ints
    "my_hint": True,
}


def configure(cfg):
    if not cfg.task_options["my_hint"]:
        raise ValueError(f"configured with {cfg.task_options}")


def problems(split, n, seed):
    return [{"q": str(i)} for i in range(n)]


def prompt(problem):
    return problem["q"]


def reward(completion, problem):
    return 0.0
"""


def test_a_task_files_options_are_settings_by_name(tmp_path, capsys):
    task = tmp_path / "mine.py"
    task.write_text(MY_TASK)
    cfg = load_config(write(tmp_path, f"task = {str(task)!r}\nmy_levels = [3]\n"),
                      ["--my_hint=false"])
    assert cfg.task_options == {"my_levels": (3,), "my_hint": False}  # typed as the defaults
    assert "override: my_hint = False" in capsys.readouterr().out
    assert load_config(overrides=[f"--task={task}"]).task_options == {"my_levels": (1, 2),
                                                                       "my_hint": True}
    # the task is known only at the end: an option may come before the task that declares it
    late = load_config(overrides=["--my_levels=4", f"--task={task}"])
    assert late.task_options["my_levels"] == (4,)
    with pytest.raises(ConfigError, match="my_levels must hold int items"):
        load_config(overrides=[f"--task={task}", "--my_levels=a,b"])
    with pytest.raises(ConfigError, match="unknown setting 'my_level'. Did you mean 'my_levels'"):
        load_config(overrides=[f"--task={task}", "--my_level=4"])
    with pytest.raises(ConfigError, match="unknown setting 'countdown_numbers'. It is an option "
                                          "of task countdown and countdown_base .tasks/.: set"):
        load_config(overrides=["--task=math", "--countdown_numbers=4"])
    # an eval set's options too (M2), at the run's task's default where both declare one
    evals = load_config(overrides=["--eval_tasks=countdown,dataset", "--countdown_numbers=5"])
    assert evals.task_options["countdown_numbers"] == (5,)
    assert evals.task_options["math_last_number"] is True
    assert evals.task_options["math_kinds"] == ("add",)  # the run's own task's options stay
    (tmp_path / "other.py").write_text("OPTIONS = {'my_hint': False}\n")  # another default
    assert load_config(overrides=[f"--task={task}", f"--eval_tasks={tmp_path / 'other.py'}"]
                       ).task_options["my_hint"] is True
    with pytest.raises(ConfigError, match=r"unknown setting 'my_n': the task file .*gone.py that "
                                          r"may declare it cannot be read \(FileNotFoundError"):
        load_config(overrides=[f"--task={tmp_path / 'gone.py'}", "--my_n=1"])
    (tmp_path / "broken.py").write_text("OPTIONS = {'my_n': 1\n")
    with pytest.raises(ConfigError, match="cannot be read .SyntaxError"):
        load_config(overrides=[f"--task={tmp_path / 'broken.py'}", "--my_n=1"])
    with pytest.raises(ValueError, match=r"configured with \{'my_levels': \(3,\), 'my_hint': Fa"):
        load_task(cfg)  # the task file's configure reads them


@pytest.mark.parametrize("options, match", [
    ("OPTIONS = {'my_n': len('ab')}", "OPTIONS must be a dict of setting names and literal"),
    ("OPTIONS = ['my_n']", "OPTIONS must be a dict"),
    ("OPTIONS = {'my_n': None}", "OPTIONS must be a dict"),
    ("OPTIONS = {'my_n': ()}", "OPTIONS must be a dict"),
    ("OPTIONS = {'my_n': ((1, 2),)}", "OPTIONS must be a dict"),  # no command line writes it
    ("OPTIONS: dict = {'my_n': None}", "OPTIONS must be a dict"),  # annotated, read the same
    ("OPTIONS = {'lr': 0.1}", r"OPTIONS \['lr'\] are \(or were\) the names of settings"),
    ("OPTIONS = {'kl_up': 1.2}", r"OPTIONS \['kl_up'\] are \(or were\)"),  # deleted: refused
])
def test_a_task_files_options_must_be_literals_with_their_own_names(tmp_path, options, match):
    task = tmp_path / "mine.py"
    task.write_text(options + "\n")
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[f"--task={task}"])


def test_the_task_options_are_saved_and_loaded_again(tmp_path):
    cfg = load_config(overrides=["--task=countdown", "--countdown_numbers=4,5"])
    save_config(cfg, tmp_path / "config.json")
    assert load_saved(tmp_path / "config.json").task_options == cfg.task_options
    # as an older version saved them: beside the settings
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.update(saved.pop("task_options"))
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_saved(tmp_path / "config.json").task_options == cfg.task_options


def test_an_older_config_is_read_in_todays_settings(tmp_path):
    """A deleted setting that another holds now (config.MERGED, the reward weights, the sequence
    cap) is read into it: an older run's audit and resume see the run it was."""
    saved = json.loads(json.dumps(dataclasses.asdict(load_config(overrides=[
        "--reward_weights=numbers_valid:0.5", "--is_correction=sequence_truncate"]))))
    for name in ("kl_band", "is_cap", "tool_tags"):
        saved.pop(name)
    saved.update(kl_low=0.02, kl_high=0.1,
                 format_weight=0.3, correct_weight=1.0, is_seq_cap=4.0, tool_open="```python\n",
                 tool_close="\n```\n", is_correction="sequence", is_mode="mask")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = load_saved(tmp_path / "config.json")
    assert cfg.kl_band == (0.02, 0.1) and cfg.is_cap == 4.0
    assert cfg.tool_tags == ("```python\n", "\n```\n") and cfg.is_correction == "sequence_mask"
    assert checkpoint.upgrade({"is_correction": "token"})["is_correction"] == "token_truncate"
    assert checkpoint.upgrade({"is_correction": "off", "is_mode": "mask"})["is_correction"] == "off"
    # the format weight moved; correct's, at its old default, stays out (the default is the same)
    assert cfg.component_weights == {"numbers_valid": 0.5, "format": 0.3}
    assert checkpoint.upgrade({"kl_up": 1.2}) == {"kl_up": 1.2}
    # reward_weights could not weigh correct, format or parsed then: those entries had no effect
    older = checkpoint.upgrade({"format_weight": 0.1,
                                "reward_weights": "format:0.5,parsed:1,brief:2"})
    assert older["reward_weights"] == "brief:2"
    # an episode's deadline is tool_timeout's now; a tools=True run's env_timeout did nothing
    assert checkpoint.upgrade({"tool_timeout": 5.0, "env_timeout": 9.0})["tool_timeout"] == 9.0
    assert checkpoint.upgrade({"tool_timeout": 2.0, "env_timeout": 5.0})["tool_timeout"] == 5.0
    assert checkpoint.upgrade({"tools": True, "tool_timeout": 7.0, "env_timeout": 9.0})[
        "tool_timeout"] == 7.0


@pytest.mark.parametrize("override, match", [
    ("--kl_band=0.08,0.01", "kl_band=.* the first below the second"),
    ("--kl_band=0.01,0.01", "kl_band=.* the first below the second"),
    ("--kl_band=0.01", "kl_band=.* must be two KLs"),
])
def test_a_band_is_two_ordered_numbers(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])
    assert load_config(overrides=["--kl_band=0.02,0.1"]).kl_band == (0.02, 0.1)


@pytest.mark.parametrize(
    "text, value",
    [("true", True), ("False", False), ("1", True), ("no", False)],
)
def test_bool_overrides(text, value):
    cfg = load_config(overrides=[f"--gradient_checkpointing={text}"])
    assert cfg.gradient_checkpointing is value


def test_unknown_keys_name_the_closest_valid_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting 'grou_size'. Did you mean 'group_size'"):
        load_config(overrides=["--grou_size=4"])
    with pytest.raises(ConfigError, match="run.py: unknown setting 'learning_rate'"):
        load_config(write(tmp_path, "learning_rate = 1e-6\n"))
    with pytest.raises(ConfigError, match="derived"):
        load_config(overrides=["--prompts_per_step=4"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("--group_size=eight", "cannot parse as int"),
        ("--lr=fast", "cannot parse as float"),
        ("--gradient_checkpointing=maybe", "cannot parse as bool"),
        ("--adam_betas=0.9", "must be two numbers"),
        ("--adam_betas=0.9,fast", "must hold float items"),
        ("--reward_weights=brief", "must look like key:value"),
        ("--reward_weights=brief:much", "brief:much is not a number"),
        ("--reward_weights=parsed:1", "parsed has no weight; it picks wrong_penalty"),
        ("--data_columns=question", "must look like key:value"),
        ("group_size=4", "must look like --key=value"),
    ],
)
def test_bad_override_values_fail_helpfully(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_bad_run_file_types_fail_helpfully(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be int"):
        load_config(write(tmp_path, 'group_size = "8"\n'))
    with pytest.raises(ConfigError, match="gradient_checkpointing must be bool"):
        load_config(write(tmp_path, "gradient_checkpointing = 1\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.py"))


def test_config_from_argv():
    cfg = config.config_from_argv(["--config", os.path.join(ROOT, "config", "tiny.py"),
                                   "--max_steps=3"])
    assert cfg.model == "tiny" and cfg.max_steps == 3
    cfg = config.config_from_argv([f"--config={os.path.join(ROOT, 'config', 'tiny.py')}"])
    assert cfg.group_size == 4


# ---------------------------------------------------------------- pre-flight (O6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--batch_size=30", "--group_size=8"],
         "batch_size=30 is not divisible by group_size=8; use batch_size=24 or 32"),
        (["--group_size=1", "--batch_size=8"], "needs >= 2 completions"),
        (["--clip_eps=0"], "clip_eps=0.0 must be in"),
        (["--clip_eps=1.5"], "clip_eps=1.5 must be in"),
        (["--clip_eps_high=0.1"], "must be >= clip_eps"),
        (["--beta=-0.1"], "beta=-0.1 must be in"),
        (["--beta=2"], "beta=2.0 must be in"),
        (["--adaptive_kl=true", "--beta=0"], "beta=0"),
        (["--micro_batch_tokens=300"],
         r"cannot hold one prompt plus its longest completion \(256 \+ 64 = 320\)"),
        (["--loss_agg=sum"], "choose one of"),
        (["--gpu_memory_utilization=0.95", "--gpu_memory_utilization=1.5"],
         "gpu_memory_utilization"),
        (["--max_steps=0"], "max_steps=0 must be >= 1"),
        (["--adv_pass_k=4"], r"adv_pass_k=4 must be in 0..group_size - 1 = 3"),
        (["--adv_pass_k=-1"], r"adv_pass_k=-1 must be in"),
        (["--adv_pass_k=2", "--adv_baseline=leave-one-out"], "adv_pass_k sets the advantage"),
        (["--adv_pass_k=2", "--adv_per_component=true"], "adv_pass_k sets the advantage"),
        (["--adv_per_component=true", "--adv_scale=none"], "adv_scale='none' must be 'group'"),
        (["--length_reward=-1"], "length_reward=-1.0 must be >= 0"),
        (["--teacher=out/x", "--distill_coef=0"], "its logprobs would weigh nothing"),
    ],
)
def test_preflight_rejects_impossible_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_small_group_warns():
    with pytest.warns(UserWarning, match="group_size=3 < 4"):
        load_config(overrides=["--group_size=3", "--batch_size=24"])


# ---------------------------------------------------------------- the run files


def test_config_dir_has_no_init():
    # it would shadow config.py
    assert not os.path.exists(os.path.join(ROOT, "config", "__init__.py"))


@pytest.mark.parametrize("path", RUN_FILES, ids=os.path.basename)
def test_every_run_file_loads_and_passes_preflight(path):
    with open(path) as f:
        first = f.readline()
    assert first.startswith("# "), "a run file starts with a comment saying what it trains"
    # planned against an 80 GB GPU, whatever this machine has
    cfg = load_config(path)
    preflight(cfg, device_gb=80)
    save_config(cfg, os.devnull)


def test_save_config_round_trip(tmp_path):
    import json

    cfg = load_config(os.path.join(ROOT, "config", "tiny.py"))
    save_config(cfg, tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["model"] == "tiny" and saved["prompts_per_step"] == 4
            and saved["adam_betas"] == [0.9, 0.99])


def test_ranks_must_split_the_prompts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it
    split = "8 prompts per step .* cannot be split over 3 ranks; use batch_size=48"
    with pytest.raises(ConfigError, match=split):
        load_config(overrides=["--batch_size=64", "--group_size=8"])
    assert load_config(overrides=["--batch_size=48", "--group_size=8"]).prompts_per_step == 6
    with pytest.raises(ConfigError, match="ref_offload"):
        load_config(overrides=["--batch_size=48", "--ref_offload=true"])
    ddp = ["--batch_size=48", "--ref_offload=true", "--parallel=ddp"]
    assert load_config(overrides=ddp).ref_offload


def test_vllm_tensor_parallel_needs_torchrun_and_a_multiple_of_ranks(monkeypatch):
    with pytest.raises(ConfigError,
                       match="vllm_tensor_parallel=2 needs the vLLM engine under torchrun"):
        load_config(overrides=["--vllm_tensor_parallel=2"])  # one process
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config(overrides=["--vllm_tensor_parallel=2"]).vllm_tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"multiple of it as the number of ranks \(now 4\)"):
        load_config(overrides=["--vllm_tensor_parallel=3", "--batch_size=32"])
    with pytest.raises(ConfigError, match="vllm_tensor_parallel"):
        load_config(overrides=["--vllm_tensor_parallel=2", "--engine=hf"])


# ---------------------------------------------------------------- settings that mislead


def test_ref_refresh_needs_a_reference():
    with pytest.raises(ConfigError,
                       match="ref_refresh_steps=5 refreshes the reference, but beta=0"):
        load_config(overrides=["--ref_refresh_steps=5", "--beta=0"])
    assert load_config(overrides=["--ref_refresh_steps=5", "--beta=0.01"]).ref_refresh_steps == 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--ratio_level=sequence", "--num_iterations=2", "--clip_eps=3e-4",
          "--clip_eps_high=4e-4"],
         "weighs each completion by its length"),
        (["--ratio_level=sequence", "--num_iterations=2", "--loss_agg=seq-mean"],
         "nothing is clipped"),
        (["--ratio_level=sequence", "--loss_agg=seq-mean", "--clip_eps=3e-4"],
         "equals the token-level one"),
        (["--top_p=0.9"], "renormalised over the kept tokens"),
        (["--top_k=20"], "renormalised over the kept tokens"),
        (["--lr=1e10"], r"lr=1e\+10 is far outside the usual range"),
        (["--async_rollouts=true"], "nothing corrects for it"),
        (["--old_logprobs=sampler", "--is_correction=token_truncate"], "counts the gap twice"),
        (["--lr=1e-12"], "far outside the usual range"),
    ],
)
def test_settings_that_mislead_warn(overrides, message):
    with pytest.warns(UserWarning, match=message):
        check_run(load_config(overrides=overrides))


def test_gspo_as_the_paper_runs_it_does_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_run(load_config(overrides=["--ratio_level=sequence", "--loss_agg=seq-mean",
                                         "--clip_eps=3e-4", "--clip_eps_high=4e-4",
                                         "--num_iterations=2"]))
        check_run(load_config())  # nor do the defaults


def test_is_correction_settings():
    cfg = load_config(overrides=["--is_correction=sequence_mask", "--is_cap=5"])
    assert (cfg.is_correction, cfg.is_cap) == ("sequence_mask", 5.0)
    with pytest.raises(ConfigError, match="is_correction='token'; choose one of"):
        load_config(overrides=["--is_correction=token"])
    with pytest.raises(ConfigError, match="is_cap=1.0 must be > 1"):
        load_config(overrides=["--is_cap=1"])


@pytest.mark.parametrize("name", sorted(config.DELETED))
def test_a_deleted_setting_says_what_to_write_instead(tmp_path, name):
    """A setting deleted from Config is not a typo: the command line and a run file both get what
    replaces it, and no deleted name is a setting still."""
    default, instead = config.DELETED[name]
    assert name not in Config.__dataclass_fields__
    with pytest.raises(ConfigError, match=re.escape(f"command line: '{name}' is no longer a "
                                                    f"setting: {instead}")):
        load_config(overrides=[f"--{name}={default}"])
    run = tmp_path / "run.py"
    run.write_text(f"{name} = {default!r}\n")
    with pytest.raises(ConfigError, match=re.escape(f"run.py: '{name}' is no longer a setting: "
                                                    f"{instead}")):
        load_config(str(run))


# ---------------------------------------------------------------- settings that used to fail late


@pytest.mark.parametrize(
    "override, message",
    [
        ("--batch_size=0", "batch_size=0 must be >= 1"),  # a "successful" run with NaN rewards
        ("--batch_size=-8", "batch_size=-8 must be >= 1"),
        ("--lr=nan", r"lr=nan must be a finite number \(default 3e-05\)"),
        ("--lr=inf", "lr=inf must be a finite number"),  # crashed the HF engine's sampling
        ("--weight_decay=nan", "weight_decay=nan must be a finite number"),
        ("--beta=nan", "beta=nan must be a finite number"),
        ("--grad_clip=nan", "grad_clip=nan must be a finite number"),
        # a hanging reward hung the run for good
        ("--reward_timeout=nan", "reward_timeout=nan must be a finite number"),
        ("--tool_timeout=nan", "tool_timeout=nan must be a finite number"),
        ("--tool_timeout=inf", "tool_timeout=inf must be a finite number"),
        ("--adam_betas=1.5,0.99", r"adam_betas=\(1.5, 0.99\): each must be in \[0, 1\)"),
        ("--temperature=1e-30", "temperature=1e-30 is below 0.01"),
        ("--temperature_end=0.001", "temperature_end=0.001 is below 0.01"),
        ("--temperature=2.5", "vLLM refuses a temperature above 2.0"),  # at its first generate
        ("--temperature_end=3.0", "temperature_end=3.0: vLLM refuses"),
        ("--out_dir=", "out_dir is empty"),
        ("--seed=18446744073709551617", r"seed=18446744073709551617 must be in 0..2\*\*63-1"),
        ("--seed=-1", "seed=-1 must be in"), ("--data_seed=-3", "data_seed=-3 must be in"),
        ("--max_staleness=0", "max_staleness=0 must be >= 1"), ("--is_floor=1.5", "is_floor=1.5"),
        ("--old_logprobs=behaviour", "old_logprobs='behaviour'; choose one of"),
    ],
)
def test_settings_that_would_fail_late_fail_in_validation(override, message):
    with pytest.raises(ConfigError, match=message):  # out_dir: pre-flight's check_run
        check_run(load_config(overrides=[override]))


def test_a_non_finite_item_of_a_tuple_setting_fails(tmp_path):
    with pytest.raises(ConfigError, match=r"adam_betas=\(0.9, nan\) must be a finite number"):
        load_config(write(tmp_path, "adam_betas = (0.9, float('nan'))\n"))
    cfg = load_config(overrides=["--adam_betas=0,0.999", "--temperature_end=0.9"])
    assert cfg.adam_betas == (0, 0.999)
    assert load_config(overrides=["--engine=hf", "--temperature=2.5"]).temperature == 2.5


def test_an_out_dir_that_is_a_file_or_cannot_be_made_fails(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"out_dir='.*file' is a file, not a folder"):
        check_run(load_config(overrides=[f"--out_dir={tmp_path}/file"]))
    with pytest.raises(ConfigError, match=r"out_dir='.*file/run' cannot be created: .*file is a"):
        check_run(load_config(overrides=[f"--out_dir={tmp_path}/file/run"]))
    made = check_run(load_config(overrides=[f"--out_dir={tmp_path}/new/run"]))
    assert made.out_dir.endswith("new/run")
    assert not os.path.exists(tmp_path / "new")  # the checks create nothing


def test_a_gpu_or_a_logger_this_machine_lacks_fails(monkeypatch):
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device='cuda', but torch sees no CUDA GPU here"):
        check_run(load_config(overrides=["--device=cuda"]))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec gives None
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="report_to='wandb' needs the wandb package"):
        check_run(load_config(overrides=["--report_to=wandb"]))
    # "all": those installed, none here
    assert check_run(load_config(overrides=["--report_to=all"])).report_to == "all"
    with pytest.raises(ConfigError, match="report_to='tensorboard' needs the tensorboard package"):
        check_run(load_config(overrides=["--report_to=tensorboard"]))
    assert check_run(load_config(overrides=["--report_to=none"])).report_to == "none"


def test_report_to_reads_as_trl_reads_it(monkeypatch):
    import importlib.util

    assert config.reporters("none") == config.reporters("") == ()
    installed = {"tensorboard"}  # "all": the loggers installed, as transformers reads it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: name in installed or None)
    assert config.reporters("all") == ("tensorboard",)
    installed.add("wandb")
    assert config.reporters("all") == ("wandb", "tensorboard")
    assert config.reporters("tensorboard") == ("tensorboard",)
    assert config.reporters(" tensorboard, wandb,tensorboard") == ("tensorboard", "wandb")
    for text in ("wand", "none,wandb", "all,wandb"):
        with pytest.raises(ConfigError, match=f"report_to='{text}': name loggers from wandb, "
                                              "tensorboard"):
            config.reporters(text)


def test_dtype_auto_is_bf16_on_a_gpu_or_a_cpu_with_bf16_arithmetic(monkeypatch):
    """O5: "auto" resolves once: bf16 where the hardware computes it (a GPU; a CPU with AMX or
    AVX-512 BF16), fp32 on a CPU that would emulate it; a dtype set by hand stays."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(config, "cpu_bf16", lambda cfg: True)
    assert load_config().dtype == "bfloat16"
    assert load_config(overrides=["--dtype=float32"]).dtype == "float32"
    monkeypatch.setattr(config, "cpu_bf16", lambda cfg: False)
    assert load_config().dtype == "float32"
    assert load_config(overrides=["--device=cpu"]).dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_config().dtype == "bfloat16"
