"""``tessera convert``: HF model directory <-> tessera checkpoint (the model-level mapping is model/hf.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tessera.config import JobConfig, resolved_objective, span_count, validate
from tessera.data.tokenizer import copy_tokenizer_files
from tessera.model import build_model
from tessera.model.hf import load_state, read_hf, save_hf
from tessera.train.checkpoint import Checkpointer


def _job_for(cfg, run_dir: Path) -> JobConfig:
    """A valid JobConfig around an imported model (train defaults, reserved ids for its objective)."""
    job = JobConfig(model=cfg)
    job.train.run_dir = str(run_dir)
    job.train.seq_len = min(job.train.seq_len, cfg.max_seq_len)
    objective = resolved_objective(cfg)
    if objective == "masked_lm":
        cfg.sentinel_tokens = max(cfg.sentinel_tokens, 1)
    elif objective == "span_corruption":
        cfg.sentinel_tokens = max(
            cfg.sentinel_tokens, span_count(job.train.seq_len + 1, cfg.mask_prob, cfg.mean_span_length)
        )
    validate(job)
    return job


def hf_import(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert an HF model directory into a tessera run directory with one checkpoint (step 0)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg, state, family = read_hf(hf_dir)
    job = _job_for(cfg, out_dir)
    model = build_model(cfg)
    load_state(model, state)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.toml").write_text(job.to_toml())
    copy_tokenizer_files(hf_dir, out_dir)  # the run keeps the source model's tokenizer
    extra = {
        "config": job.to_dict(),
        "model": job.to_dict()["model"],
        "imported_from": {"path": str(hf_dir), "family": family},
    }
    return Checkpointer(out_dir, keep_last=1).save(0, model, torch.optim.AdamW(model.parameters()), extra)


def hf_export(checkpoint: str | Path, out_dir: str | Path, family: str | None = None) -> str:
    """Write the model of a tessera run or checkpoint directory as an HF model directory (weights, config,
    tokenizer, generation config, model card); returns the family."""
    from tessera.api import find_checkpoint, load
    from tessera.hf_dir import complete_hf_dir
    from tessera.model import count_parameters

    ckpt = find_checkpoint(checkpoint)
    model = load(ckpt)
    family = save_hf(model, out_dir, family)
    complete_hf_dir(Path(out_dir), ckpt, family, count_parameters(model))
    return family


def consolidate(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Gather a (possibly sharded) checkpoint's weights into one ``model.safetensors`` plus its config.

    DCP reassembles the shards whatever layout saved them; the file holds full, unsharded
    tensors named as in a single-process tessera model (tied weights stored once).
    """
    from safetensors.torch import save_file

    from tessera.api import find_checkpoint, load

    ckpt = find_checkpoint(checkpoint)
    model = load(ckpt)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # a tied weight appears under two names, stored once
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": str(ckpt)})
    if (ckpt.parent.parent / "config.toml").is_file():
        shutil.copyfile(ckpt.parent.parent / "config.toml", out / "config.toml")
    return out / "model.safetensors"
