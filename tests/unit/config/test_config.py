"""Config loading, overrides and validation; malformed input ends in one line and exit code 2."""

from __future__ import annotations

import pytest

from tessera.cli import main
from tessera.config import ConfigError, JobConfig, config_from_data, parse_overrides, read_config
from tessera.validate import config_from_dict, load_config

from helpers.runs import REPO, run_cli


def test_defaults_validate_and_round_trip_through_toml(tmp_path):
    config = load_config(None, ["model.dim=96", "--model.n_heads", "3", "train.dtype=bf16", "log.tensorboard=false"])
    assert (config.model.dim, config.model.n_heads, config.train.dtype, config.log.tensorboard) == (
        96,
        3,
        "bf16",
        False,
    )
    path = tmp_path / "resolved.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config
    assert config_from_dict(config.to_dict()) == config


def test_smoke_recipe_loads():
    config = load_config(REPO / "configs" / "smoke.toml")
    assert config.model.arch == "decoder" and config.train.steps > 0


def test_override_forms():
    assert parse_overrides(["--a.b", "1", "c.d=2", "--e.f=x"]) == [("a.b", "1"), ("c.d", "2"), ("e.f", "x")]


BAD_OVERRIDES = [
    (["model.dimm=64"], "unknown config key 'model.dimm' (did you mean 'dim'?)"),
    (["modle.dim=64"], "unknown config section 'modle'"),
    (["model.dim=abc"], "model.dim must be an integer"),
    (["model.dim=100", "model.n_heads=3"], "model.dim=100 is not divisible by model.n_heads=3"),
    (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0, got -1"),
    (["train.dtype=bf32"], "train.dtype = 'bf32' is not one of"),
    (["train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_seq_len"),
    (["log.tensorboard=maybe"], "log.tensorboard must be true or false"),
    (["optim.lr=-1"], "optim.lr must be positive"),
    (["train.steps=0"], "train.steps must be positive"),
    (["model.dropout=1.5"], "model.dropout must be in [0, 1)"),
    (["model.dim"], "cannot read override 'model.dim'"),
    (["--train.steps"], "override '--train.steps' has no value"),
    (["steps=3"], "must name section.key"),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES)
def test_bad_overrides_raise_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


BAD_FILES = [
    ("[model]\ndim = 64\n[trian]\nsteps = 2\n", "unknown section [trian] (did you mean 'train'?)"),
    ("[model]\ndim = \n", "is not valid TOML"),
    ("model = 3\n", "top-level key 'model' must be a [section] table"),
    ("[model]\ndim = 64.5\n", "model.dim must be an integer"),
    ("[train]\nrun_dir = 3\n", "train.run_dir must be a string"),
    ("[model.sub]\nx = 1\n", "unknown config table 'model.sub'"),
]


@pytest.mark.parametrize("text,message", BAD_FILES)
def test_bad_files_raise_one_clear_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "no/such/recipe.toml"], "config file 'no/such/recipe.toml' does not exist"),
        (["train", "configs/smoke.toml", "--model.n_layers", "two"], "model.n_layers must be an integer"),
        (["train", "configs/smoke.toml", "--train.device", "tpu"], "train.device='tpu' must be auto, cpu or cuda"),
        (["train", "configs/smoke.toml", "--parallel.dp_shard", "0"], "parallel.dp_shard must be >= 1 or -1"),
        (["generate", "no/such/run", "--prompt", "x"], "'no/such/run' does not exist"),
        (["generate", "configs", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (
            ["train", "configs/smoke.toml", "--train.resume", "configs"],
            "'configs' is not a complete tessera checkpoint",
        ),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera: error: ") and message in err and "\n" not in err


def test_console_script_prints_no_traceback():
    result = run_cli("train", "configs/smoke.toml", "--optim.warmup_steps", "-1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["tessera: error: optim.warmup_steps must be >= 0, got -1"]


def test_print_config_shows_resolved_values(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/smoke.toml", "--print-config", "model.n_layers=3"]) == 0
    out = capsys.readouterr().out
    assert "[model]" in out and "n_layers = 3" in out and isinstance(JobConfig(), JobConfig)


def test_model_sub_tables_and_the_keys_of_earlier_releases():
    nested = load_config(
        None, ["model.moe.experts=4", "--model.attention.kernel", "eager", "model.position.rope_theta=5e5"]
    )
    flat = load_config(None, ["model.moe_experts=4", "model.attention=eager", "model.rope_theta=500000"])
    assert nested == flat
    assert (nested.model.moe.experts, nested.model.attention.kernel, nested.model.position.rope_theta) == (
        4,
        "eager",
        5e5,
    )
    toml = nested.to_toml()
    assert "[model.moe]\nexperts = 4" in toml and '[model.attention]\nkernel = "eager"' in toml
    with pytest.raises(ConfigError, match=r"^model.moe is a table; set one of its keys, e.g. model.moe.experts"):
        load_config(None, ["model.moe=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.moe.expert' \(did you mean 'experts'\?\)"):
        load_config(None, ["model.moe.expert=4"])


def test_loading_a_config_imports_no_model_or_parallel_code():
    import subprocess
    import sys

    code = (
        "import sys; from tessera.config import read_config; read_config('configs/smoke.toml', []); "
        "bad = [m for m in sys.modules if m.startswith(('tessera.parallel', 'tessera.model', "
        "'torch.distributed.pipelining'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_non_bmp_strings_round_trip_through_the_resolved_toml(tmp_path):
    config = load_config(None, ["train.sample_prompt=def 🦄(x):"])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    assert load_config(path).train.sample_prompt == "def 🦄(x):"


def test_the_muon_distill_and_deepspeed_sections_take_their_old_flat_keys():
    old = read_config(None, ["optim.muon_lr=0.02", "train.distill_alpha=0.25", "parallel.zero_stage=3"])
    new = read_config(None, ["optim.muon.lr=0.02", "train.distill.alpha=0.25", "parallel.deepspeed.zero_stage=3"])
    assert old == new
    assert (new.optim.muon.lr, new.train.distill.alpha, new.parallel.deepspeed.zero_stage) == (0.02, 0.25, 3)
    assert "[optim.muon]\nlr = 0.02" in new.to_toml() and "[parallel.deepspeed]\nzero_stage = 3" in new.to_toml()
    data = {"train": {"distill_from": "runs/teacher"}, "parallel": {"deepspeed_config": "ds.json"}}
    assert config_from_data(data).train.distill.teacher == "runs/teacher"
    assert config_from_data(data).parallel.deepspeed.config == "ds.json"


def test_every_user_error_kind_shares_the_base_the_cli_catches():
    from tessera.errors import CheckpointError, DataError, LaunchError, UserError

    assert all(issubclass(kind, UserError) for kind in (ConfigError, DataError, CheckpointError, LaunchError))
