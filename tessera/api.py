"""The small Python API: load a trained model (and its tokenizer) from a run or checkpoint."""

from __future__ import annotations

from pathlib import Path

from tessera.config import config_from_dict
from tessera.data.sources import DataError
from tessera.data.tokenizer import Tokenizer
from tessera.model import Decoder, build_model
from tessera.train.checkpoint import CHECKPOINT_DIR, Checkpointer, CheckpointError, latest_checkpoint, read_meta


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (its newest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"'{path}' does not exist; give a run directory or a checkpoint directory")
    if (path / CHECKPOINT_DIR).is_dir() or (path / "config.toml").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"run directory '{path}' has no complete checkpoint yet")
        return found
    read_meta(path)
    return path


def load(path: str | Path) -> Decoder:
    """The model of a tessera run directory or checkpoint, on CPU, in eval mode."""
    return load_with_tokenizer(path)[0]


def load_with_tokenizer(path: str | Path) -> tuple[Decoder, Tokenizer]:
    """Model (eval mode, CPU) and the tokenizer the run trained with."""
    ckpt = find_checkpoint(path)
    meta = read_meta(ckpt)
    config = config_from_dict(meta["config"], where=str(ckpt / "meta.json"))
    model = build_model(config.model)
    Checkpointer(ckpt.parent.parent, keep_last=1).load(ckpt, model, restore_rng=False)
    tokenizer_path = ckpt.parent.parent / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise DataError(f"'{tokenizer_path}' is missing; copy the run's tokenizer there")
    return model.eval(), Tokenizer(tokenizer_path)
