"""train.init_from under every layout: each rank reads its own blocks of the HF tensors, and the run is the
single-process run (and, over 10 steps, the transformers + AdamW loop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.runs import (
    TINY_OVERRIDES,
    assert_losses_close,
    assert_runs_match,
    step_records,
    torchrun,
)
from helpers.hf_reference import save_llama, save_mixtral, transformers_loop

from tessera.hf.convert import hf_import
from tessera.train.trainer import Trainer, train
from tessera.validate import load_config

TRAIN = [o for o in TINY_OVERRIDES if not o.startswith("model.")] + [
    "train.eval_every=0",
    "optim.implementation=for-loop",
]


def _source(root: Path, name: str, save) -> tuple[Path, Path]:
    """(HF dir, its hf-import recipe)."""
    save(root / name)
    hf_import(root / name, root / f"{name}_imported")
    return root / name, root / f"{name}_imported" / "config.toml"


def _reference(recipe: Path, hf: Path, run: Path, cache_dir: Path, steps: int):
    """The single-process run from ``hf`` and the batches it trained on."""
    config = load_config(
        str(recipe),
        [
            *TRAIN,
            f"train.steps={steps}",
            f"data.cache_dir={cache_dir}",
            f"train.run_dir={run}",
            f"train.init_from={hf}",
        ],
    )
    trainer, batches = Trainer(config), []
    take = trainer._micro_batch

    def recording():
        parts = take()
        batches.append((parts.args[0].clone(), parts.labels.clone()))
        return parts

    trainer._micro_batch = recording
    trainer.fit()
    return config, batches


@pytest.mark.slow
def test_fsdp_and_tp_from_hf_equal_transformers(tmp_path, cache_dir):
    """10 steps under FSDP dp=2 and TP=2 from an HF Llama: losses and grad norms equal the transformers loop
    (1e-5) and the single-process run (also the final parameter checksums)."""
    hf, recipe = _source(tmp_path, "llama", save_llama)
    config, batches = _reference(recipe, hf, tmp_path / "single", cache_dir, 10)
    want_loss, want_norm = transformers_loop(hf, batches, config.optim)
    common = [str(recipe), *TRAIN, "train.steps=10", f"data.cache_dir={cache_dir}", f"train.init_from={hf}"]
    jobs = {"fsdp2": [*common, "parallel.dp_shard=2"], "tp2": [*common, "parallel.dp_shard=1", "parallel.tp=2"]}
    torchrun(2, "tests/helpers/dist_init_from.py", str(tmp_path), json.dumps(jobs))
    for name in jobs:
        got = step_records(tmp_path / name)
        assert_losses_close([r["loss"] for r in got], want_loss, 1e-5)
        assert_losses_close([r["grad_norm"] for r in got], want_norm, 1e-5, what="grad norm")
        assert assert_runs_match(tmp_path / name, tmp_path / "single") == 10, name


@pytest.mark.slow
def test_init_under_dp_tp_pp_ep_equals_single_process(tmp_path, cache_dir):
    """Step-1 losses from HF weights under dp_shard=2 x tp=2, pp=2 and ep=2 equal single-process init (1e-6); the
    HF directory checkpoint.hf_every writes under dp_shard=2 x tp=2 loads in transformers with equal logits."""
    llama, llama_recipe = _source(tmp_path, "llama", save_llama)
    mixtral, mixtral_recipe = _source(tmp_path, "mixtral", save_mixtral)
    one = [*TRAIN, "train.steps=1", "optim.warmup_steps=1", f"data.cache_dir={cache_dir}"]
    no_aux = ["model.moe.aux_loss_coef=0"]  # its per-rank batch statistics differ by layout; the weights do not
    for hf, recipe in ((llama, llama_recipe), (mixtral, mixtral_recipe)):
        run = f"train.run_dir={tmp_path}/ref_{hf.name}"
        train(load_config(str(recipe), [*one, *no_aux[: hf is mixtral], f"train.init_from={hf}", run]))
    dense = [str(llama_recipe), *one, f"train.init_from={llama}"]
    moe = [str(mixtral_recipe), *one, *no_aux, f"train.init_from={mixtral}"]
    jobs = {
        "dp2_tp2_llama": [*dense, "parallel.dp_shard=2", "parallel.tp=2"],
        "dp2_tp2_meta_llama": [*dense, "parallel.dp_shard=2", "parallel.tp=2", "parallel.meta_init=true"],
        "pp2_llama": [*dense, "parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"],
        "ep2_mixtral": [*moe, "parallel.dp_shard=4", "parallel.ep=2"],
        "hf_every_dp2_tp2_llama": [*dense, "parallel.dp_shard=2", "parallel.tp=2", "checkpoint.hf_every=1"],
    }
    torchrun(4, "tests/helpers/dist_init_from.py", str(tmp_path), json.dumps(jobs))
    for name in jobs:
        ref = tmp_path / f"ref_{name.rsplit('_', 1)[1]}"
        got, want = step_records(tmp_path / name), step_records(ref)
        assert_losses_close([r["loss"] for r in got], [r["loss"] for r in want], 1e-6, what=f"{name} loss")
        assert_runs_match(tmp_path / name, ref)  # the grad norm and every tensor's checksum, too
    _check_hf_export(tmp_path / "hf_every_dp2_tp2_llama")


def _check_hf_export(run: Path) -> None:
    """checkpoint.hf_every's directory (written from dp2 x tp2 shards) loads in transformers with the run's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from tessera.api import load

    hf = AutoModelForCausalLM.from_pretrained(str(run / "hf" / "step_00000001"), dtype=torch.float32).eval()
    ours = load(run / "checkpoints" / "step_00000001")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
    card = (run / "hf" / "step_00000001" / "README.md").read_text()
    assert "Initialized from" in card and (run / "hf" / "step_00000001" / "tokenizer.json").is_file()
