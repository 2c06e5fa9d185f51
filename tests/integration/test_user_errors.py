"""Every mistake one line: config values, files and paths, CLI flags, checkpoints and HF directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.runs import REPO, TINY_OVERRIDES, run_cli
from helpers.data import write_megatron_dataset
from tessera.cli import main
from tessera.train.checkpoint import latest_checkpoint
from tessera.train.trainer import train


def fails_with(argv: list[str], capsys, *fragments: str, code: int = 2) -> str:
    """Run the CLI in-process: exit ``code``, exactly one stderr line, holding every fragment."""
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, cache_dir) -> Path:
    """A finished 4-step tiny run (checkpoint, tokenizer, config) shared by the read-only cases below."""
    from tessera.validate import load_config

    run = tmp_path_factory.mktemp("trained") / "run"
    train(load_config(None, [*TINY_OVERRIDES, "train.steps=4", f"train.run_dir={run}", f"data.cache_dir={cache_dir}"]))
    return run


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lr=inf", "optim.lr must be a finite number, got inf"),
        ("optim.lr=nan", "optim.lr must be a finite number, got nan"),
        ("model.norm_eps=-1e-5", "model.norm_eps must be positive"),
        ("model.rope_theta=0", "model.position.rope_theta must be positive"),
        ("optim.eps=-1e-8", "optim.eps must be positive"),
        ("optim.eps=0", "optim.eps must be positive"),
        ("train.seed=-1", "train.seed must be in [0, 2**32)"),
        ("train.seed=4294967296", "train.seed must be in [0, 2**32)"),
        ("model.moe.capacity_factor=inf", "model.moe.capacity_factor must be a finite number"),
        ("train.hang_timeout_s=-1", "train.hang_timeout_s must be >= 0"),
        ("train.max_nonfinite_skips=0", "train.max_nonfinite_skips must be >= 1"),
    ],
)
def test_out_of_range_values_name_the_key(override, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fails_with(["train", "configs/smoke.toml", override, "--print-config"], capsys, message)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.dsa.topk=64", "train.seq_len=64"], "model.dsa.topk=64 is not smaller than train.seq_len=64"),
        (["model.dsa.topk=8", "model.mla.q_rank=0"], "model.dsa (sparse attention) runs on latent attention"),
        (["model.dsa.index_head_dim=4"], "model.dsa.index_head_dim=4 must be >= model.mla.rope_head_dim=8"),
        (
            ["parallel.tp=2", "parallel.dp_shard=1", "model.n_heads=3", "model.dim=96"],
            "model.n_heads=3 is not divisible by parallel.tp=2",
        ),
    ],
)
def test_sparse_and_latent_attention_mistakes_are_one_line(overrides, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fails_with(["train", "configs/tiny/deepseek_v32.toml", *overrides, "--print-config"], capsys, message)


def test_config_files_that_are_not_toml_text(tmp_path, capsys):
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(bytes(range(128, 256)) * 3)
    fails_with(["train", str(garbage)], capsys, f"config file '{garbage}' is not UTF-8 text")
    fails_with(["train", str(tmp_path)], capsys, f"config path '{tmp_path}' is a directory")


def test_a_mistyped_flag_is_called_unknown_with_a_guess(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fails_with(
        ["train", "configs/smoke.toml", "--print-confg"], capsys, "unknown option '--print-confg'", "'--print-config'"
    )


def test_run_and_cache_paths_that_are_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["train", "configs/smoke.toml", *TINY_OVERRIDES]
    fails_with([*base, f"train.run_dir={a_file}"], capsys, f"train.run_dir '{a_file}' is a file")
    run = f"train.run_dir={tmp_path / 'run'}"
    fails_with([*base, run, f"data.cache_dir={a_file}"], capsys, f"data.cache_dir '{a_file}' is a file")


def test_a_read_only_run_dir(tmp_path, capsys, monkeypatch):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        (readonly / "probe").touch()  # root ignores permission bits: fall back to a read-only filesystem
        (readonly / "probe").unlink()
        readonly = Path("/sys/kernel")
        if not readonly.is_dir() or _writable(readonly):
            pytest.skip("no read-only directory available to this user")
    except PermissionError:
        pass
    monkeypatch.chdir(REPO)
    fails_with(
        ["train", "configs/smoke.toml", *TINY_OVERRIDES, f"train.run_dir={readonly}"],
        capsys,
        f"train.run_dir '{readonly}' is not writable",
    )


def _writable(path: Path) -> bool:
    try:
        (path / "tessera-probe").touch()
    except OSError:
        return False
    (path / "tessera-probe").unlink()
    return True


def test_generate_flags_and_prompts_beyond_the_context(trained_run, capsys):
    fails_with(["generate", str(trained_run), "--temperature", "nan"], capsys, "--temperature must be a finite")
    fails_with(["generate", str(trained_run), "--top-k", "-1"], capsys, "--top-k >= 0")
    fails_with(["generate", str(trained_run), "--seed", str(2**70)], capsys, "--seed must be in [0, 2**63)")
    long_prompt = "def f(x): return x " * 60
    fails_with(["generate", str(trained_run), "--prompt", long_prompt], capsys, "model.max_seq_len) is 64")


@pytest.mark.parametrize(
    "content,message",
    [
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"step": 4}', "is incomplete (no 'config')"),
        (b'{"step": 4, \xff\xfe}', "is corrupt"),
        (b'{"step": "four", "config": {}}', "malformed 'step' or 'config'"),
    ],
)
def test_a_damaged_meta_json_is_named(content, message, trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    meta = latest_checkpoint(run) / "meta.json"
    meta.write_bytes(content)
    fails_with(["generate", str(run)], capsys, f"'{meta}'", message)


def test_a_damaged_shard_names_the_cause(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shard = next(latest_checkpoint(run).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:5000])
    fails_with(["generate", str(run)], capsys, "is damaged: RuntimeError: PytorchStreamReader failed")


def test_outputs_that_are_existing_files(trained_run, tmp_path, capsys):
    target = tmp_path / "exists.txt"
    target.write_text("keep me")
    fails_with(["convert", "hf-export", str(trained_run), str(target)], capsys, f"'{target}' is an existing file")
    fails_with(["convert", "consolidate", str(trained_run), str(target)], capsys, f"'{target}' is an existing file")
    assert target.read_text() == "keep me"


def test_damaged_hf_directories(trained_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "hf-export", str(trained_run), str(hf)]) == 0
    capsys.readouterr()
    weights = hf / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])
    fails_with(["convert", "hf-import", str(hf), str(tmp_path / "a")], capsys, f"'{weights}' is not a readable")
    weights.write_bytes(intact)
    config = json.loads((hf / "config.json").read_text())
    del config["hidden_size"]
    (hf / "config.json").write_text(json.dumps(config))
    fails_with(["convert", "hf-import", str(hf), str(tmp_path / "b")], capsys, "lacks the key 'hidden_size'")


def test_resume_with_another_seq_len_names_it(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    argv = ["train", str(run / "config.toml"), f"train.run_dir={run}", "train.steps=8", "train.seq_len=16"]
    fails_with(argv, capsys, "train.seq_len=32, not 16")


def test_token_ids_beyond_the_tokenizer_vocabulary(tmp_path, cache_dir, small_tokenizer, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    wide = tmp_path / "wide"
    write_megatron_dataset(wide, 300, 10, 400)  # ids up to 399; the tokenizer has 300
    argv = ["train", "configs/smoke.toml", *TINY_OVERRIDES, f"train.run_dir={tmp_path / 'run'}"]
    argv.append(f"data.cache_dir={cache_dir}")
    fails_with(
        [*argv, f"data.blend={wide}", f"data.tokenizer={small_tokenizer}"], capsys, f"'{wide}.bin' holds token id"
    )


def test_a_jsonl_with_a_bad_line_prints_one_line_only(tmp_path, small_tokenizer):
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"def f{i}(x):\n    return {i}\n"}) for i in range(20)]
    source.write_text("\n".join(lines[:10] + ['{"text": "torn'] + lines[10:]) + "\n")
    out = str(tmp_path / "out")
    result = run_cli("prepare", str(source), "--output", out, "--tokenizer", str(small_tokenizer), "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and str(source) in result.stderr, result.stderr
