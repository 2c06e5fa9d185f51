"""The ``tessera`` model of lm-eval-harness: ``tessera lm-eval --model tessera --model_args path=RUN --tasks ...``.

Importing this module registers the model with lm-eval (``register_model``). lm-eval 0.4 finds models only in
its own registry (no entry-point group), so the ``lm_eval`` script alone does not see it: ``tessera lm-eval``
registers it and then runs lm-eval's own command line with the same arguments, plus the built-in stdlib
tasks' directory on ``--include_path``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model

from tessera.config import ConfigError
from tessera.evaluate.harness import TesseraLM
from tessera.evaluate.scoring import Scorer


@register_model("tessera")
class TesseraRunLM(TesseraLM):
    """A tessera run, checkpoint or HF model directory (``--model_args path=RUN[,device=cuda]``) for lm-eval."""

    def __init__(self, path: str = "", device: str | None = None, **_: Any) -> None:
        from tessera.api import load_with_tokenizer

        if not path:
            raise ConfigError("--model tessera needs --model_args path=RUN (a run or checkpoint directory)")
        model, tokenizer = load_with_tokenizer(path)
        # lm-eval passes --device (default "cuda") to every model; without CUDA that default means the CPU.
        if not device or (device.startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"
        target = torch.device(device)
        super().__init__(Scorer(model.to(target), target, model.cfg.max_seq_len), tokenizer)


def run_lm_eval(argv: list[str], cache_root: Path, stdlib_docs: int = 200) -> int:
    """lm-eval's command line (``lm_eval run ARGS``) with the ``tessera`` model registered and the built-in
    tasks' directory appended to ``--include_path``."""
    from lm_eval.__main__ import cli_evaluate

    from tessera.evaluate.stdlib_task import builtin_task_dir

    builtin = str(builtin_task_dir(cache_root, stdlib_docs))
    args = list(argv)
    if "--include_path" in args:
        i = args.index("--include_path") + 1
        args[i] = f"{args[i]}:{builtin}" if i < len(args) else builtin
    else:
        args += ["--include_path", builtin]
    old = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    except SystemExit as stop:
        return int(stop.code or 0)
    finally:
        sys.argv = old
    return 0
