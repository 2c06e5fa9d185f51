"""The parallel hybrid (Falcon-H1's 'H' layers, non-default multipliers) under context parallelism (cp2, with and
without document masks: the Mamba half's split scan and convolution halo beside the attention's split), FSDP and
pipeline stages (the muP logit factor on the last stage only) matches the single-process run on losses, grad norms and final parameter
norms (fp32, 1e-5 relative, 4 steps). Tensor parallelism is refused for 'H' layers
(tessera/model/parallel_hybrid.py)."""

from __future__ import annotations

import json

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

FALCON_H1 = [
    "train.steps=4",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.n_layers=2",
    "model.n_kv_heads=2",
    "model.layer_pattern=H",
    "model.mamba.version=2",
    "model.mamba.state=8",
    "model.mamba.head_dim=16",
    "model.mamba.groups=2",
    "model.mamba.chunk=8",
    "model.hybrid.mamba_inner=96",
    "model.hybrid.gated_norm=true",
    "model.hybrid.norm_before_gate=false",
    "model.hybrid.key=0.5",
    "model.hybrid.ssm_out=0.5",
    "model.hybrid.ssm_x=0.7",
    "model.mup.embedding=2.0",
    "model.mup.head=0.5",
]
LAYOUTS = {
    "cp2": ["parallel.cp=2", "parallel.dp_shard=1"],
    "cp2_docs": ["parallel.cp=2", "parallel.dp_shard=1", "data.document_mask=true"],
    "fsdp": ["parallel.dp_shard=2"],
    "pp": ["parallel.pp=2", "parallel.dp_shard=1"],
}


@pytest.mark.slow
def test_falcon_h1_layouts_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "falcon_h1.toml", cache_dir, *FALCON_H1)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    documents = train(load_config(recipe, [f"train.run_dir={tmp_path}/single_docs", "data.document_mask=true"]))
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:
        single = documents.run_dir if name.endswith("_docs") else reference
        assert assert_runs_match(tmp_path / name, single) == 4, name  # losses, grad norms, final parameters
