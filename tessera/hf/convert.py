"""``tessera convert``: HF model directory <-> tessera checkpoint (the model-level mapping is hf/weights.py), and
DeepSpeed checkpoints -> tessera run (the DeepSpeed reading is train/ds_checkpoint.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tessera.config import ConfigError, JobConfig, resolved_objective
from tessera.data.objectives import span_count
from tessera.hf.families.qwen3_5 import EXPORT_AS
from tessera.hf.weights import load_state, read_hf, save_hf
from tessera.model import build_model
from tessera.train.checkpoint import Checkpointer, CheckpointError, read_meta
from tessera.train.ds_checkpoint import MOMENTS
from tessera.train.lock import RunLock
from tessera.train.rundir import carry_run_files, remove_run_outputs
from tessera.validate import validate


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


def output_dir(path: str | Path, what: str) -> Path:
    """``path`` as a directory to write into (created), or one clear error when it cannot be one."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} '{path}' is an existing file, not a directory; give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{what} '{path}' cannot be created ({err.strerror}); give a writable directory") from None
    return path


def hf_import(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert an HF model directory into a tessera run directory with one checkpoint (step 0).

    A non-empty ``out_dir`` is refused unless ``overwrite`` (then what an earlier run wrote there is deleted).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(
            f"'{out_dir}' is not empty (an existing run?); importing would replace its config and checkpoints. "
            "Give a new directory, or pass --overwrite to delete that run first"
        )
    cfg, state, family = read_hf(hf_dir)  # every check of the HF directory before anything is created
    out_dir = output_dir(out_dir, "output directory")
    job = _job_for(cfg, out_dir)
    model = build_model(cfg)
    load_state(model, state)
    lock = RunLock(out_dir).acquire()
    try:
        if overwrite:
            remove_run_outputs(out_dir)
        return _write_imported(out_dir, hf_dir, job, model, family)
    finally:
        lock.release()


def _write_imported(out_dir: Path, hf_dir: Path, job: JobConfig, model: torch.nn.Module, family: str) -> Path:
    if carry_run_files(hf_dir, out_dir):  # the run keeps the source model's tokenizer, and trains with it
        job.data.tokenizer = str(out_dir)
    (out_dir / "config.toml").write_text(job.to_toml(), encoding="utf-8")
    extra = {
        "config": job.to_dict(),
        "model": job.to_dict()["model"],
        "imported_from": {"path": str(hf_dir), "family": family},
    }
    return Checkpointer(out_dir, keep_last=1).save(0, model, torch.optim.AdamW(model.parameters()), extra)


def init_from_command(hf_dir: str | Path, out_dir: str | Path) -> str:
    """The command that continues pretraining from an imported HF model (printed after ``hf-import``)."""
    return f"tessera train {Path(out_dir) / 'config.toml'} train.init_from={hf_dir}"


def hf_export(checkpoint: str | Path, out_dir: str | Path, family: str | None = None) -> str:
    """Write the model of a tessera run or checkpoint directory as an HF model directory (weights, config,
    tokenizer, generation config, model card); returns the family."""
    from tessera.api import find_checkpoint, load
    from tessera.hf.export import complete_hf_dir
    from tessera.model import count_parameters

    ckpt = find_checkpoint(checkpoint)
    model = load(ckpt)
    imported = read_meta(ckpt).get("imported_from", {}).get("family")
    family = family or EXPORT_AS.get(imported)  # an imported Qwen3.5 model goes back as Qwen3.5
    family = save_hf(model, output_dir(out_dir, "export directory"), family)
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
    out = output_dir(out_dir, "output directory")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": str(ckpt)})
    config = ckpt.parent.parent / "config.toml"
    if config.is_file() and config.resolve() != (out / "config.toml").resolve():
        shutil.copyfile(config, out / "config.toml")
    return out / "model.safetensors"


def _carry_near(path: Path, out_dir: Path) -> None:
    """The tokenizer an HF Trainer saved beside its DeepSpeed checkpoint (the folder or the one above it)."""
    for folder in (path, path.parent):
        if carry_run_files(folder, out_dir):
            return


def _hf_config_near(path: Path) -> dict | None:
    """The config.json of an HF Trainer + DeepSpeed checkpoint (in the global_stepN folder or next to it)."""
    from tessera.hf.weights import read_hf_config

    for folder in (path, path.parent):
        if (folder / "config.json").is_file():
            return read_hf_config(folder)
    return None


def _ds_model_and_job(ds_path: Path, state, config: str | None, out_dir: Path):
    """(JobConfig, tessera weights, tessera moments, source) for a DeepSpeed state: tessera-named with a
    recipe, or HF-named next to its config.json."""
    from tessera.hf.weights import state_from_hf
    from tessera.validate import load_config

    if config is not None:
        return load_config(config, [f"train.run_dir={out_dir}"]), state.weights, state.moments, "tessera"
    hf_config = _hf_config_near(ds_path)
    if hf_config is None:
        raise CheckpointError(
            f"'{ds_path}' has no config.json beside it; pass --config RECIPE.toml (the tessera model it trained)"
        )
    cfg, weights, family = state_from_hf(dict(hf_config), dict(state.weights))
    moments = {}
    if state.moments:
        per_moment = {
            m: state_from_hf(dict(hf_config), {k: v[m] for k, v in state.moments.items()})[1] for m in MOMENTS
        }
        moments = {name: {m: per_moment[m][name] for m in MOMENTS} for name in per_moment[MOMENTS[0]]}
    return _job_for(cfg, out_dir), weights, moments, f"HF {family}"


def _shaped(tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size], what: str) -> dict[str, torch.Tensor]:
    """``tensors`` reshaped to the model's shapes (universal ZeRO-3 checkpoints store some flattened)."""
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"the DeepSpeed checkpoint lacks {what} '{missing[0]}' of the model")
    out = {}
    for name, shape in shapes.items():
        if tensors[name].numel() != shape.numel():
            raise CheckpointError(f"{what} '{name}' has {tensors[name].numel()} elements, the model's has {shape}")
        out[name] = tensors[name].reshape(shape)
    return out


def deepspeed_import(ds_path: str | Path, out_dir: str | Path, config: str | None = None) -> Path:
    """Convert a DeepSpeed ZeRO or universal checkpoint into a tessera run directory (weights and Adam state).

    Parameter names are tessera's (give the recipe ``config``) or an HF family's (a config.json
    beside the checkpoint, as the HF Trainer writes). Returns the checkpoint written.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tessera.train.ds_checkpoint import find_deepspeed_checkpoint, read_deepspeed
    from tessera.train.optim import build_optimizer, build_scheduler

    ds_path = Path(ds_path)
    state = read_deepspeed(ds_path)
    out_dir = output_dir(out_dir, "output directory")
    if any(out_dir.iterdir()):
        raise ConfigError(f"'{out_dir}' is not empty (an existing run?); give a new directory to import into")
    job, weights, moments, source = _ds_model_and_job(find_deepspeed_checkpoint(ds_path), state, config, out_dir)
    model = build_model(job.model)
    params = dict(model.named_parameters())
    shapes = {k: v.shape for k, v in model.state_dict().items() if k in weights or k in params}
    load_state(model, _shaped(weights, shapes, "weight"))  # a tied output weight comes from the embedding
    optimizer = build_optimizer(model, job.optim)
    _, optim_sd = get_state_dict(model, optimizer)
    if moments:
        for name, entry in optim_sd["state"].items():
            shaped = _shaped({m: moments[name][m] for m in MOMENTS}, {m: params[name].shape for m in MOMENTS}, name)
            entry.update(step=torch.tensor(float(state.step)), **shaped)
    set_state_dict(model, optimizer, model_state_dict=model.state_dict(), optim_state_dict=optim_sd)
    (out_dir / "config.toml").write_text(job.to_toml(), encoding="utf-8")
    _carry_near(find_deepspeed_checkpoint(ds_path), out_dir)
    scheduler = build_scheduler(optimizer, job.optim, job.train.steps)
    scheduler.last_epoch = state.global_steps  # training continues the schedule (tessera train OUT_DIR)
    extra = {
        "config": job.to_dict(),
        "model": job.to_dict()["model"],
        "scheduler": scheduler.state_dict(),
        "imported_from": {"path": str(ds_path), "family": f"DeepSpeed {state.kind} ({source} names)"},
    }
    return Checkpointer(out_dir, keep_last=1).save(state.global_steps, model, optimizer, extra)
