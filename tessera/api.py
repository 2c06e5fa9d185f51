"""The small Python API: load a model (and its tokenizer) from a run, a checkpoint or an HF directory."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from tessera.config import ConfigError, config_from_dict
from tessera.data.sources import DataError
from tessera.data.tokenizer import Tokenizer
from tessera.model import build_model
from tessera.model.hf import is_hf_dir, load_hf
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


def load(path: str | Path) -> nn.Module:
    """The model of a tessera run directory, checkpoint or HF model directory, on CPU, in eval mode.

    Decoders take ``forward(input_ids)``, encoders ``forward(input_ids)`` (masked-LM logits) and
    encoder-decoders ``forward(input_ids, decoder_input_ids)``; all return logits.
    """
    if is_hf_dir(path):
        return load_hf(path)
    return _load_checkpoint(find_checkpoint(path))


def _load_checkpoint(ckpt: Path) -> nn.Module:
    meta = read_meta(ckpt)
    config = config_from_dict(meta["config"], where=str(ckpt / "meta.json"))
    model = build_model(config.model)
    Checkpointer(ckpt.parent.parent, keep_last=1).load(ckpt, model, restore_rng=False)
    return model.eval()


def load_with_tokenizer(path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """Model (eval mode, CPU) of a tessera run or checkpoint and the tokenizer the run trained with."""
    ckpt = find_checkpoint(path)
    model = _load_checkpoint(ckpt)
    tokenizer_path = ckpt.parent.parent / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise DataError(f"'{tokenizer_path}' is missing; copy the run's tokenizer there")
    return model, Tokenizer(tokenizer_path)


def generate_text(
    path: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> tuple[str, str]:
    """``prompt`` and its continuation sampled from a run or checkpoint (``tessera generate``), and
    a line on the decoding cache's size (bytes per token of context)."""
    import torch

    from tessera.model import generate
    from tessera.model.generate import cache_footprint

    model, tokenizer = load_with_tokenizer(path)
    ids = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)])
    if ids.shape[1] >= model.cfg.max_seq_len:
        raise ConfigError(
            f"--prompt is {ids.shape[1]} tokens but the model's context (model.max_seq_len) is "
            f"{model.cfg.max_seq_len}; shorten the prompt"
        )
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, ids, max_new_tokens, temperature, top_k, top_p, tokenizer.eos_id, gen)
    per_token, fixed = cache_footprint(model)
    cache = f"decoding cache: {per_token:,} bytes per token of context, {fixed:,} bytes fixed"
    return prompt + tokenizer.decode(out[0].tolist()), cache
