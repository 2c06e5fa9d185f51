"""Issue 33: the newer features fail in one line (exit 2), lose nothing and never hang.

Each test stands for a class of hostile or unlucky inputs (not one example): config values, derived runs,
status files, tokenizer files, HF directories, speculative decoding, data sources, DeepSpeed configs and
imports. A generative test (Hypothesis, derandomized, bounded) sends hostile values to every config key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from helpers.runs import REPO, TINY_OVERRIDES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cli import main
from tessera.config.docs import sections
from tessera.config.job import toml_string
from tessera.train.trainer import train
from tessera.validate import load_config


def fails_with(argv: list[str], capsys, *fragments: str) -> str:
    """The CLI in-process: exit 2, exactly one stderr line starting 'tessera: error:', holding every fragment."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def tiny_run(run: Path, cache_dir: Path, *overrides: str) -> Path:
    """A finished 2-step tiny run at ``run`` (in-process)."""
    extra = [f"train.run_dir={run}", f"data.cache_dir={cache_dir}", "train.steps=2", "checkpoint.every=2"]
    train(load_config(None, [*TINY_OVERRIDES, "train.eval_every=0", *extra, *overrides]))
    return run


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, cache_dir) -> Path:
    """A run with an HF (byte-level BPE) tokenizer: tokenizer.json + tokenizer_config.json, no tokenizer.model."""
    return tiny_run(tmp_path_factory.mktemp("bpe") / "run", cache_dir, "data.tokenizer=bpe")


# ---------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.steps=１２", "train.steps must be an integer in ASCII digits"),  # fullwidth: int() would read 12
        ("train.steps=١٢", "train.steps must be an integer in ASCII digits"),  # Arabic-Indic
        ("train.steps=¹", "train.steps must be an integer in ASCII digits"),  # superscript
        ("optim.lr=١.٥", "optim.lr must be a number in ASCII digits"),
        ("train.sample_prompt=\udcff", "train.sample_prompt is not UTF-8 text"),  # a non-UTF-8 argv byte
        ("model.head_dim=" + "9" * 400, "model.head_dim = 9999"),  # found by the generative test (OverflowError)
        ("parallel.layers_per_stage=two,three", "parallel.layers_per_stage='two,three' splits a pipeline"),
        ("parallel.layers_per_stage=1,1", "parallel.pp=1 has none"),
    ],
)
def test_lookalike_digits_and_undecodable_values_name_the_key(override, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fails_with(["train", "configs/smoke.toml", override, "--print-config"], capsys, message)


def test_superscript_stage_counts_are_not_counts(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = ["train", "configs/smoke.toml", "parallel.pp=2", "parallel.layers_per_stage=¹,¹", "--print-config"]
    fails_with(argv, capsys, "parallel.layers_per_stage='¹,¹' must be comma-separated positive block counts")


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text())
def test_any_string_round_trips_through_the_toml_writer(text):
    assert tomllib.loads(f"a = {toml_string(text)}")["a"] == text


def test_a_run_config_with_emoji_and_controls_reloads(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    prompt = 'hi 😀 \x7f\x00 \u2028 "q" \\'
    config = load_config("configs/smoke.toml", [f"train.sample_prompt={prompt}", f"train.run_dir={tmp_path}"])
    assert load_config(_write(tmp_path / "c.toml", config.to_toml())).train.sample_prompt == prompt
    assert main(["train", "configs/smoke.toml", f"train.sample_prompt={prompt}", "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["train"]["sample_prompt"] == prompt


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# Hostile values for any key: wrong types, empty, huge, negative, non-UTF-8, Unicode digits and lookalikes.
HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "x",
        "-1",
        "-1e309",
        "1e309",
        "nan",
        "9" * 400,
        "1_0",
        "１",
        "٣",
        "²",
        "0x10",
        "true",
        "[1]",
        "{}",
        "\udcff\udcfe",
        "\x00",
        "ⅰ",
        "１.５",
        "1,2",
        "None",
        "0",
        "-0",
        "2**31",
    ]
)
KEY_TYPES = {key.key: key.type for section in sections() for key in section.keys}
ALL_KEYS = sorted(KEY_TYPES)


@settings(
    max_examples=250, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=st.sampled_from(ALL_KEYS), value=HOSTILE)
def test_every_config_key_takes_hostile_values_in_one_line(key, value, capsys, monkeypatch, tmp_path):
    """Validation only (--print-config): exit 0, or exit 2 with one line that names the key; nothing written."""
    monkeypatch.chdir(REPO)
    before = set(tmp_path.iterdir())
    code = main(["train", "configs/smoke.toml", f"{key}={value}", f"train.run_dir={tmp_path}/run", "--print-config"])
    out, err = capsys.readouterr()
    assert code in (0, 2), (key, value, code, err)
    assert set(tmp_path.iterdir()) == before
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tessera: error: "), (key, value, err)
    else:  # accepted: only what the value means, as written (no lookalike digits, only UTF-8 text)
        assert not (KEY_TYPES[key] in ("int", "float") and not value.isascii()), (key, value)
        assert tomllib.loads(out.encode("utf-8").decode("utf-8"))  # what --print-config printed reloads


# ---------------------------------------------------------------- derived runs carry everything


def test_pruned_and_pooled_runs_keep_the_hf_tokenizer(bpe_run, tmp_path, capsys, cache_dir):
    """convert gqa and prune heads --out write runs that generate, status, hf-export and train (resume) use."""
    gqa, pruned = tmp_path / "gqa", tmp_path / "pruned"
    assert main(["convert", "gqa", str(bpe_run), "--kv-heads", "1", "--out", str(gqa), "--batches", "1"]) == 0
    assert main(["prune", "heads", str(bpe_run), "--fraction", "0.5", "--out", str(pruned), "--batches", "1"]) == 0
    for run in (gqa, pruned):
        assert (run / "tokenizer.json").is_file() and (run / "tokenizer_config.json").is_file(), run
        assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "3"]) == 0
        assert main(["status", str(run)]) == 0
        assert main(["convert", "hf-export", str(run), str(tmp_path / f"{run.name}-hf")]) == 0
        assert (tmp_path / f"{run.name}-hf" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["train", str(gqa / "config.toml"), f"data.cache_dir={cache_dir}"]) == 0
    assert (gqa / "summary.json").is_file()


def test_hf_import_then_everything(bpe_run, tmp_path, capsys):
    hf, run = tmp_path / "hf", tmp_path / "imported"
    assert main(["convert", "hf-export", str(bpe_run), str(hf)]) == 0
    assert main(["convert", "hf-import", str(hf), str(run)]) == 0
    assert (run / "tokenizer.json").is_file()
    assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "3"]) == 0
    assert main(["status", str(run)]) == 0
    assert main(["convert", "hf-export", str(run), str(tmp_path / "again")]) == 0


# ---------------------------------------------------------------- files a command reads


def test_hf_import_checks_config_sizes_against_the_weights_before_allocating(bpe_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "hf-export", str(bpe_run), str(hf)]) == 0
    config = json.loads((hf / "config.json").read_text())
    for vocab in (600, 10**12):  # disagrees with the weights; absurd (256 TB if allocated)
        (hf / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        out = tmp_path / f"out{vocab}"
        fails_with(["convert", "hf-import", str(hf), str(out)], capsys, "config.json' does not match its weights")
        assert not out.exists()
    (hf / "config.json").write_bytes(b"\xff\xfe{}")
    fails_with(["convert", "hf-import", str(hf), str(tmp_path / "x")], capsys, "config.json")


def test_status_reads_torn_and_foreign_metrics(bpe_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(bpe_run, run, ignore=shutil.ignore_patterns("run.lock"))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe garbage\n[1, 2]\n"text"\n{"step": "x"}\n{"step": 9, "loss": "nan?"}\n{"step"')
    assert main(["status", str(run)]) == 0
    assert "step         2 / 2" in capsys.readouterr().out
    (run / "config.toml").write_bytes(b"\xff[train]")
    fails_with(["status", str(run)], capsys, "config.toml' is not UTF-8 text")


def test_tokenizer_files_that_are_not_json_objects(bpe_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(bpe_run, run, ignore=shutil.ignore_patterns("run.lock"))
    for content in (b"[1, 2]", b'"a string"', b"\xff\xfe"):
        (run / "tokenizer_config.json").write_bytes(content)
        fails_with(["generate", str(run), "--prompt", "x"], capsys, "tokenizer_config.json")


# ---------------------------------------------------------------- generate and speculative decoding


def test_generate_refuses_what_it_cannot_decode(bpe_run, tmp_path_factory, cache_dir, capsys):
    made = tmp_path_factory.mktemp("drafts")
    short = tiny_run(made / "short", cache_dir, "data.tokenizer=bpe", "model.max_seq_len=40")
    mamba = tiny_run(made / "mamba", cache_dir, "data.tokenizer=bpe", "model.layer_pattern=AM")
    mtp = tiny_run(made / "mtp", cache_dir, "data.tokenizer=bpe", "model.mtp_depth=1")
    enc = tiny_run(made / "enc", cache_dir, "model.arch=encoder", "model.sentinel_tokens=1")
    gen = ["generate", "--prompt", "def", "--max-new-tokens"]
    fails_with([*gen, "50", str(bpe_run), "--draft", str(short)], capsys, "has a context of 40 tokens")
    fails_with([*gen, "5", str(bpe_run), "--draft", str(mamba)], capsys, "has Mamba layers")
    fails_with([*gen, "5", str(mamba), "--draft", str(bpe_run)], capsys, "has Mamba layers")
    fails_with([*gen, "5", str(mtp), "--draft", "mtp", "--draft-tokens", "3"], capsys, "model.mtp_depth=1")
    fails_with([*gen, "5", str(enc)], capsys, "is an encoder")
    assert main([*gen, "5", str(mtp), "--draft", "mtp", "--draft-tokens", "1"]) == 0


# ---------------------------------------------------------------- data sources


def test_binary_and_empty_sources(tmp_path, capsys, small_tokenizer):
    binary = tmp_path / "random.bin"
    binary.write_bytes(bytes(range(128, 256)) * 1600)  # no NUL byte: only the undecodable share tells
    empty, mixed = tmp_path / "empty", tmp_path / "mixed"
    empty.mkdir()
    mixed.mkdir()
    (mixed / "x.bin").write_bytes(binary.read_bytes())
    (mixed / "a.txt").write_text("def f(x):\n    return x\n" * 50)
    for tokenizer in ("default", str(small_tokenizer)):
        out = tmp_path / f"out-{len(tokenizer)}"
        argv = ["prepare", "--output", str(out), "--tokenizer", tokenizer, "--no-progress"]
        fails_with([*argv, str(binary)], capsys, f"data source '{binary}' is a binary file")
        fails_with([*argv, str(empty)], capsys, f"data source '{empty}' has no non-empty text documents")
        assert not list(tmp_path.glob(f"{out.name}*")), "a refused prepare wrote files"
    argv = ["prepare", "--output", str(tmp_path / "m"), "--tokenizer", str(small_tokenizer), "--no-progress"]
    assert main([*argv, str(mixed)]) == 0
    assert "prepared 1 documents" in capsys.readouterr().out.replace(",", "")


# ---------------------------------------------------------------- DeepSpeed config and imports


def test_ds_json_problems_are_one_line(tmp_path, tiny_config):
    from tessera.config import ConfigError
    from tessera.parallel.deepspeed import deepspeed_config

    cases = {
        b"\xff\xfe{}": "is not UTF-8 text",
        b'{"bf16": true}': "DeepSpeed expects a block there",
        b'{"zero_optimization": 3}': "DeepSpeed expects a block there",
        b'{"bf16": {"enabled": true}}': "but train.dtype gives",
    }
    for i, (content, message) in enumerate(cases.items()):
        path = tmp_path / f"ds{i}.json"
        path.write_bytes(content)
        config = tiny_config("parallel.engine=deepspeed") if i else None
        if config is None:
            with pytest.raises(ConfigError, match=message):
                tiny_config("parallel.engine=deepspeed", f"parallel.deepspeed.config={path}")
            continue
        config.parallel.deepspeed.config = str(path)
        with pytest.raises(ConfigError, match=message):
            deepspeed_config(config, 1)


def test_deepspeed_import_of_torn_latest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("")
    argv = [
        "convert",
        "deepspeed-import",
        str(tmp_path / "ds"),
        str(tmp_path / "out"),
        "--config",
        "configs/smoke.toml",
    ]
    fails_with(argv, capsys, "latest' does not name a checkpoint folder")
    (tmp_path / "ds" / "latest").write_text(".")
    fails_with(argv, capsys, "latest' does not name a checkpoint folder")


@pytest.mark.slow
def test_deepspeed_import_of_pickles_without_deepspeed_keys(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.chdir(REPO)
    step = tmp_path / "ds" / "global_step1"
    step.mkdir(parents=True)
    torch.save({"a": 1}, step / "mp_rank_00_model_states.pt")
    torch.save({"x": torch.zeros(2)}, step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "ds" / "latest").write_text("global_step1")
    argv = [
        "convert",
        "deepspeed-import",
        str(tmp_path / "ds"),
        str(tmp_path / "out"),
        "--config",
        "configs/smoke.toml",
    ]
    fails_with(argv, capsys, "does not hold DeepSpeed's checkpoint layout", "optimizer_state_dict")


# ---------------------------------------------------------------- argparse's own errors


def _parser_paths(parser, path=()):
    """(command path, parser) for the root parser and every command and action under it."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parser_paths(sub, (*path, name))


def _argparse_mistakes(parser, path):
    """Each mistake argparse itself catches for this parser: a missing value, a missing argument, a bad choice."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield [*path, "no-such-action"]
        elif action.option_strings and action.nargs is None and isinstance(action, argparse._StoreAction):
            yield [*path, action.option_strings[0]]  # the flag without its value
    if any(a.required and not a.option_strings and a.nargs != argparse.REMAINDER for a in parser._actions):
        yield list(path)  # a required positional left out


def test_argparse_errors_of_every_command_are_one_line(capsys):
    from tessera.cli import build_parser

    cases = [m for path, p in _parser_paths(build_parser()) for m in _argparse_mistakes(p, path)]
    commands = {case[0] for case in cases if case}
    assert fails_with(["lm-eval"], capsys, "needs lm_eval's arguments")
    assert len(cases) > 60 and {"train", "generate", "plan", "convert", "launch", "slurm"} <= commands
    for argv in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("tessera: error: "), (argv, err)
        assert "usage:" not in err and "--help" in err, (argv, err)


# ---------------------------------------------------------------- the planner's search is bounded


def test_a_million_gpu_plan_stops_at_its_cap_says_what_it_cut_and_shows_progress(capsys, monkeypatch):
    from tessera.plan import planner

    estimated = []
    original = planner.estimate
    monkeypatch.setattr(planner, "estimate", lambda *a, **k: estimated.append(1) or original(*a, **k))
    monkeypatch.setattr(planner, "PROGRESS_EVERY_S", 0.0)  # a line per layout instead of one per 5 s
    argv = ["plan", str(REPO / "configs/llama3-8b.toml"), "--gpus", "1048576", "--gpu", "h100-80gb"]
    assert main([*argv, "train.batch_size=4194304", "--max-layouts", "300"]) == 0
    out, err = capsys.readouterr()
    assert len(estimated) <= 300 + 1  # the cap, plus the recipe's own layout
    assert "note: the search stopped at its cap of 300 layouts (more exist for 1,048,576 GPUs)" in out
    assert "300 layouts pass tessera's checks" in out and "plan: 300 layouts estimated in " in err
    fails_with([*argv, "--max-layouts", "0"], capsys, "--max-layouts must be positive")


# ---------------------------------------------------------------- a DeepSpeed import carries everything


def _universal_checkpoint(hf: Path, ds: Path, step: int) -> None:
    """What an HF Trainer + DeepSpeed run leaves: config.json and tokenizer beside global_stepN/zero/NAME/*.pt."""
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = ds / f"global_step{step}"
    for name, tensor in load_file(str(hf / "model.safetensors")).items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save({"param": tensor}, folder / "zero" / name / "fp32.pt")
        torch.save(tensor * 0.01, folder / "zero" / name / "exp_avg.pt")
        torch.save(tensor.square() * 0.01, folder / "zero" / name / "exp_avg_sq.pt")
        torch.save(torch.tensor(float(step)), folder / "zero" / name / "step.pt")
    for item in hf.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, ds / item.name)
    (ds / "latest").write_text(folder.name)


def test_deepspeed_import_then_everything(bpe_run, tmp_path, capsys, cache_dir):
    hf, ds, run = tmp_path / "hf", tmp_path / "ds", tmp_path / "imported"
    assert main(["convert", "hf-export", str(bpe_run), str(hf)]) == 0
    _universal_checkpoint(hf, ds, 2)
    assert main(["convert", "deepspeed-import", str(ds), str(run)]) == 0
    assert (run / "tokenizer.json").is_file() and (run / "tokenizer_config.json").is_file()
    assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "3"]) == 0
    assert main(["status", str(run)]) == 0
    assert main(["convert", "hf-export", str(run), str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "tokenizer.json").is_file()
    capsys.readouterr()
    resumed = ["train", str(run / "config.toml"), f"data.cache_dir={cache_dir}", "train.steps=4", "train.eval_every=0"]
    assert main([*resumed, "data.max_chars=400000", "log.progress=none", "log.every=1", "train.sample_tokens=0"]) == 0
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [3, 4] and (run / "checkpoints" / "step_00000004").is_dir()  # resumed at the imported step 2


# ---------------------------------------------------------------- issue 37: commands that take a run take an HF dir


def test_commands_that_take_a_run_read_an_hf_directory_or_say_how_in_one_line(bpe_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "hf-export", str(bpe_run), str(hf)]) == 0
    capsys.readouterr()
    assert main(["generate", str(hf), "--prompt", "def", "--max-new-tokens", "3", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("def")
    assert main(["inspect", "attention", str(hf), "--text", "def f(x):"]) == 0
    capsys.readouterr()
    for argv in (
        ["convert", "hf-export", str(hf), str(tmp_path / "again")],
        ["convert", "gqa", str(hf), "--kv-heads", "1", "--out", str(tmp_path / "gqa")],
        ["prune", "heads", str(hf), "--fraction", "0.5", "--out", str(tmp_path / "pruned")],
    ):
        fails_with(argv, capsys, "is an HF", f"tessera convert hf-import {hf} RUN_DIR")
    assert not (tmp_path / "again").exists() and not (tmp_path / "gqa").exists()
