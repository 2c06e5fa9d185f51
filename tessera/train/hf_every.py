"""``checkpoint.hf_every``: an HF model directory written from the training state every N steps.

At such a step the run saves its (sharded, any-layout) DCP checkpoint as usual, then rank 0 starts
``tessera convert hf-export CHECKPOINT RUN/hf/step_N`` as a separate process: it reassembles the
weights from the checkpoint's shards and writes config, safetensors, tokenizer, generation config
and model card, while every rank trains on. No rank waits longer than for the save itself; the
next save (whose pruning could delete the checkpoint being read) and the end of the run wait for
the export, which is much shorter than a save interval on any real job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tessera.config import ConfigError

HF_DIR = "hf"


class HFExports:
    """Starts one background ``hf-export`` per due step (rank 0) and collects their outcome."""

    def __init__(self, run_dir: Path, every: int, is_main: bool) -> None:
        self.run_dir, self.every, self.is_main = run_dir, every, is_main
        self.running: tuple[subprocess.Popen, Path] | None = None

    def due(self, step: int) -> bool:
        """Whether ``step`` writes an HF directory."""
        return self.every > 0 and step % self.every == 0

    def start(self, checkpoint: Path, step: int) -> None:
        """Export ``checkpoint`` into ``RUN/hf/step_N`` in a separate process (rank 0; the others return)."""
        if not self.is_main:
            return
        self.wait()
        out = self.run_dir / HF_DIR / f"step_{step:08d}"
        out.parent.mkdir(parents=True, exist_ok=True)
        log = (out.parent / f"step_{step:08d}.log").open("w")
        cmd = [sys.executable, "-m", "tessera", "convert", "hf-export", str(checkpoint), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside training: one core, not all of them
        self.running = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), out)
        log.close()

    def wait(self) -> None:
        """Wait for the export in flight; a failed one raises with the last line of its log."""
        if self.running is None:
            return
        proc, out = self.running
        self.running = None
        if proc.wait() != 0:
            log = out.parent / f"{out.name}.log"
            lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
            raise ConfigError(
                f"checkpoint.hf_every: exporting {out} failed ({lines[-1] if lines else proc.returncode}); see {log}"
            )
