"""`tessera convert quantize RUN OUT --scheme S`: a trained run as a torchao-quantized HF directory."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.errors import ConfigError
from tessera.quantize.schemes import DEFAULT_GROUP_SIZE, check_scheme, torchao_config


def run_scheme(run: str | Path, scheme: str | None, group_size: int | None) -> tuple[str, int]:
    """The scheme and group size to convert ``run`` with: by default those it was trained with
    (``train.qat``, ``train.qat_group_size``); for a QAT run, a different one is refused in one line
    (its weights were trained for that grid)."""
    from tessera.api import find_checkpoint
    from tessera.hf.weights import is_hf_dir
    from tessera.train.checkpoint import read_meta

    train = {} if is_hf_dir(run) else read_meta(find_checkpoint(run))["config"].get("train", {})
    qat, qat_group = train.get("qat", "none"), int(train.get("qat_group_size", DEFAULT_GROUP_SIZE))
    if qat == "none":
        if scheme is None:
            raise ConfigError(f"'{run}' was trained without train.qat: give --scheme int8-weight|int4-weight|fp8")
        return scheme, DEFAULT_GROUP_SIZE if group_size is None else group_size
    chosen = (scheme or qat, qat_group if group_size is None else group_size)
    wanted = (qat, qat_group if qat == "int4-weight" else chosen[1])
    if chosen != wanted:
        group = f" --group-size {qat_group}" if qat == "int4-weight" else ""
        raise ConfigError(
            f"'{run}' was trained with train.qat={qat!r}: convert it with --scheme {qat}{group} (or leave both out)"
        )
    return chosen


def quantize_run(run: str | Path, out_dir: str | Path, scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> Path:
    """Export ``run`` to ``out_dir`` as an HF directory, then let transformers' torchao integration
    quantize it (``TorchAoConfig``, the head kept) and save it as safetensors in place.

    ``out_dir`` then loads with ``AutoModelForCausalLM.from_pretrained`` (torchao installed) and with
    tessera (``generate``, ``inspect``, ``tessera.load``)."""
    from tessera.api import find_checkpoint, load
    from tessera.hf.convert import hf_export

    check_scheme(load(find_checkpoint(run)), scheme, group_size)  # before anything is written
    config = torchao_config(scheme, group_size)
    try:
        from transformers import AutoModelForCausalLM, TorchAoConfig
    except ImportError:
        raise ConfigError("tessera convert quantize needs transformers: pip install 'tessera[lowp]'") from None
    hf_export(run, out_dir)

    quant = TorchAoConfig(config, modules_to_not_convert=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), quantization_config=quant, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)
