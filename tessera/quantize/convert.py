"""`tessera convert quantize RUN OUT --scheme S`: a trained run as a torchao-quantized HF directory."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.errors import ConfigError
from tessera.quantize.schemes import DEFAULT_GROUP_SIZE, check_scheme, torchao_config


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
