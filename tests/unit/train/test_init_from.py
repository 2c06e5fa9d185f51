"""train.init_from: continued pretraining from an HF checkpoint equals a plain transformers + AdamW loop; every
bad source is one line, exit 2, nothing written; an hf-import run directory trains."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers.runs import TINY_OVERRIDES, assert_losses_close, step_records
from helpers.hf_reference import save_llama, transformers_loop
from safetensors.torch import load_file, save_file

from tessera.cli import main
from tessera.hf.convert import hf_import
from tessera.train.trainer import Trainer
from tessera.validate import load_config

TRAIN = [o for o in TINY_OVERRIDES if not o.startswith("model.")] + ["train.steps=10", "train.eval_every=0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM (save_pretrained) and the recipe `convert hf-import` writes for it."""
    root = tmp_path_factory.mktemp("llama")
    save_llama(root / "hf")
    hf_import(root / "hf", root / "imported")
    return root


def _config(llama: Path, run: Path, cache_dir: Path, *overrides: str):
    return load_config(
        str(llama / "imported" / "config.toml"),
        [*TRAIN, f"data.cache_dir={cache_dir}", f"train.run_dir={run}", *overrides],
    )


def test_init_from_hf_trains_like_transformers(llama, tmp_path, cache_dir):
    """10 steps from the HF weights: each step's loss and grad norm equal transformers + torch AdamW (1e-5)."""
    config = _config(
        llama, tmp_path / "run", cache_dir, f"train.init_from={llama / 'hf'}", "optim.implementation=for-loop"
    )
    trainer = Trainer(config)
    batches, take = [], trainer._micro_batch

    def recording():
        parts = take()
        batches.append((parts.args[0].clone(), parts.labels.clone()))
        return parts

    trainer._micro_batch = recording
    trainer.fit()
    got = step_records(tmp_path / "run")
    want_loss, want_norm = transformers_loop(llama / "hf", batches, config.optim)
    assert len(got) == 10
    assert_losses_close([r["loss"] for r in got], want_loss, 1e-5)
    assert_losses_close([r["grad_norm"] for r in got], want_norm, 1e-5, what="grad norm")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["init_from"] == str(llama / "hf")
    assert f'init_from = "{llama / "hf"}"' in (tmp_path / "run" / "config.toml").read_text()


def _train(llama: Path, run: Path, cache_dir: Path, *overrides: str) -> int:
    recipe = str(llama / "imported" / "config.toml")
    return main(["train", recipe, *TRAIN, f"data.cache_dir={cache_dir}", f"train.run_dir={run}", *overrides])


def _copy_hf(llama: Path, out: Path, edit=None) -> Path:
    """The tiny HF directory copied, its tensors passed through ``edit(dict)``."""
    out.mkdir()
    (out / "config.json").write_text((llama / "hf" / "config.json").read_text())
    tensors = load_file(str(llama / "hf" / "model.safetensors"))
    save_file(edit(tensors) if edit else tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _reshaped(t):
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:96].contiguous()
    return t


def _dropped(t):
    del t["model.layers.0.self_attn.k_proj.weight"]
    return t


def _extra(t):
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    return t


class _Bomb:
    """Unpickling it would create a marker file: proof that tessera never unpickles a .bin."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "shape",
            "tensor 'model.layers.1.mlp.up_proj.weight' (tessera 'layers.1.feed_forward.up_proj.weight') has shape (96, 64) there but (128, 64)",
        ),
        ("missing", "lacks the llama tensor(s) 'model.layers.0.self_attn.k_proj.weight'"),
        ("unexpected", "has tensor(s) 'model.layers.0.self_attn.q_norm.weight' that a llama model"),
        ("pickle", "holds only pickle weights (pytorch_model.bin); tessera reads safetensors only and never unpickles"),
        ("truncated", "model.safetensors' is truncated"),
        ("config", "model.n_heads is 8 in the recipe but 4 in the source (HF llama)"),
    ],
)
def test_bad_source_is_one_line_and_writes_nothing(llama, tmp_path, cache_dir, capsys, case, expected):
    """Each bad source: one line naming what is wrong, exit 2, no run directory."""
    source, overrides = tmp_path / "src", []
    if case == "shape":
        _copy_hf(llama, source, _reshaped)
    elif case == "missing":
        _copy_hf(llama, source, _dropped)
    elif case == "unexpected":
        _copy_hf(llama, source, _extra)
    elif case == "pickle":
        source.mkdir()
        (source / "config.json").write_text((llama / "hf" / "config.json").read_text())
        (source / "pytorch_model.bin").write_bytes(pickle.dumps(_Bomb(str(tmp_path / "unpickled"))))
    elif case == "truncated":
        _copy_hf(llama, source)
        data = (source / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(data[:-100])
    else:
        source, overrides = llama / "hf", ["model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=16"]
    run = tmp_path / "run"
    assert _train(llama, run, cache_dir, f"train.init_from={source}", *overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not run.exists() and not (tmp_path / "unpickled").exists()


def test_tokenizer_larger_than_the_source_vocab_is_refused(tmp_path, cache_dir, small_tokenizer, capsys):
    """A 300-token tokenizer with a source that embeds 256 ids: refused before anything is written."""
    save_llama(tmp_path / "hf", vocab_size=256)
    hf_import(tmp_path / "hf", tmp_path / "imported")
    run = tmp_path / "run"
    code = _train(tmp_path, run, cache_dir, f"train.init_from={tmp_path / 'hf'}", f"data.tokenizer={small_tokenizer}")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "has 300 tokens but train.init_from=" in err and "embeds only 256" in err, err
    assert not run.exists()


def test_init_from_over_existing_checkpoints_with_resume_none(llama, tmp_path, cache_dir, capsys):
    """init_from + resume=none into a run that has checkpoints: refused, the run untouched; resume=auto resumes."""
    run, hf = tmp_path / "run", f"train.init_from={llama / 'hf'}"
    assert _train(llama, run, cache_dir, hf, "train.steps=4", "optim.warmup_steps=1") == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    capsys.readouterr()
    assert _train(llama, run, cache_dir, hf, "train.resume=none", "train.steps=6", "optim.warmup_steps=1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.resume=none, but train.run_dir" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert _train(llama, run, cache_dir, hf, "train.steps=6", "optim.warmup_steps=1", "log.progress=lines") == 0
    out = capsys.readouterr().out
    assert "ignored: the run resumes from its own checkpoint" in out and "step_00000004" in out


def test_hf_import_run_dir_trains_and_prints_the_init_from_command(tmp_path, cache_dir, llama, capsys):
    """The issue's opening bug: training an hf-import run directory starts from its weights (no 'scheduler'
    error), with the same losses as init_from the HF directory itself."""
    out = tmp_path / "imported"
    assert main(["convert", "hf-import", str(llama / "hf"), str(out)]) == 0
    assert f"tessera train {out / 'config.toml'} train.init_from={llama / 'hf'}" in capsys.readouterr().out
    short = ["train.steps=3", "optim.warmup_steps=1"]
    assert (
        main(["train", str(out / "config.toml"), *TRAIN, f"data.cache_dir={cache_dir}", *short, "log.progress=lines"])
        == 0
    )
    assert "weights from" in capsys.readouterr().out
    direct = tmp_path / "direct"
    assert _train(llama, direct, cache_dir, f"train.init_from={llama / 'hf'}", *short) == 0
    assert [r["loss"] for r in step_records(out)] == [r["loss"] for r in step_records(direct)]


def test_init_from_deepspeed_universal_checkpoint(llama, tmp_path, cache_dir):
    """An HF-named DeepSpeed universal checkpoint (config.json beside it) starts the run like the HF directory."""
    folder = tmp_path / "ds" / "global_step7"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((llama / "hf" / "config.json").read_text())
    for name, tensor in load_file(str(llama / "hf" / "model.safetensors")).items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save({"param": tensor}, folder / "zero" / name / "fp32.pt")
    (tmp_path / "ds" / "latest").write_text("global_step7")
    short = ["train.steps=2", "optim.warmup_steps=1"]
    assert _train(llama, tmp_path / "from_ds", cache_dir, f"train.init_from={tmp_path / 'ds'}", *short) == 0
    assert _train(llama, tmp_path / "from_hf", cache_dir, f"train.init_from={llama / 'hf'}", *short) == 0
    got, want = step_records(tmp_path / "from_ds"), step_records(tmp_path / "from_hf")
    assert [r["loss"] for r in got] == [r["loss"] for r in want] and [r["grad_norm"] for r in got] == [
        r["grad_norm"] for r in want
    ]


def test_upcycling_a_dense_source_into_moe(llama, tmp_path, cache_dir):
    """Sparse upcycling: every expert starts as the dense FFN, so (top-k weights summing to 1) the MoE's step-0
    validation loss is the dense model's; with a shared expert too, the run trains."""
    moe = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=128"]
    evals = ["train.steps=2", "optim.warmup_steps=1", "train.eval_every=2"]
    hf = f"train.init_from={llama / 'hf'}"
    assert _train(llama, tmp_path / "dense", cache_dir, hf, *evals) == 0
    assert _train(llama, tmp_path / "moe", cache_dir, hf, *evals, *moe) == 0
    val = {r: json.loads((tmp_path / r / "summary.json").read_text())["val_losses"]["0"] for r in ("dense", "moe")}
    assert abs(val["moe"] - val["dense"]) <= 1e-6 * val["dense"], val
    assert _train(llama, tmp_path / "shared", cache_dir, hf, *evals, *moe, "model.moe.shared_experts=1") == 0


def test_upcycling_noise_gives_each_expert_its_own_perturbation_whatever_the_layout_reads(llama):
    """train.upcycle_noise=0.1: each routed expert is the dense FFN times (1 + 0.1 N(0, 1)), its own draws (the
    experts differ), the same block whichever shard a rank reads; 0 keeps exact copies."""
    from tessera.train.init_from import check_source, open_source

    recipe = load_config(
        str(llama / "imported" / "config.toml"),
        ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=128"],
    ).model
    name, dense_name = "layers.1.moe.experts.up_proj", "layers.1.feed_forward.up_proj.weight"
    stacks = {}
    for noise in (0.0, 0.1):
        source = open_source(str(llama / "hf"), recipe)
        check_source(source, recipe, noise, seed=7)
        full = source.tensors.read(name, (0, 0, 0), tuple(source.tensors.shape(name)))
        assert torch.equal(source.tensors.read(name, (2, 16, 32), (2, 16, 32)), full[2:4, 16:32, 32:64])
        stacks[noise] = full
    dense = source.tensors.dense.read(dense_name, (0, 0), tuple(source.tensors.dense.shape(dense_name))).T
    assert all(torch.equal(expert, dense) for expert in stacks[0.0])
    ratios = stacks[0.1] / dense - 1
    assert 0.09 < ratios.std().item() < 0.11 and abs(ratios.mean().item()) < 0.01
    assert not torch.allclose(stacks[0.1][0], stacks[0.1][1])


def test_upcycling_from_a_tessera_run(llama, tmp_path, cache_dir, capsys):
    """A tessera run (its DCP checkpoint) as the dense source: the upcycled MoE's step-0 validation loss is the
    dense run's final one; upcycle_noise without upcycling is refused."""
    evals = ["train.steps=2", "optim.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2"]
    assert _train(llama, tmp_path / "dense", cache_dir, f"train.init_from={llama / 'hf'}", *evals) == 0
    moe = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=128"]
    assert _train(llama, tmp_path / "moe", cache_dir, f"train.init_from={tmp_path / 'dense'}", *evals, *moe) == 0
    dense = json.loads((tmp_path / "dense" / "summary.json").read_text())["val_losses"]["2"]
    upcycled = json.loads((tmp_path / "moe" / "summary.json").read_text())["val_losses"]["0"]
    assert abs(upcycled - dense) <= 1e-6 * dense, (upcycled, dense)
    hf = f"train.init_from={llama / 'hf'}"
    capsys.readouterr()
    assert _train(llama, tmp_path / "noisy_dense", cache_dir, hf, "train.upcycle_noise=0.01") == 2
    assert "is not a dense source for an MoE recipe" in capsys.readouterr().err
