"""Short trials just work: a warmup longer than the run is clipped with a notice, and a validation
split too small for one sequence takes documents from the training split with a notice."""

from __future__ import annotations

import random

import numpy as np

from tessera.config import OptimConfig
from tessera.data.blend import sized_up_ranges, split_ranges
from tessera.train.optim import lr_multiplier, warmup_notice
from tessera.train.trainer import train


def test_warmup_longer_than_the_run_is_clipped_to_it():
    cfg = OptimConfig(warmup_steps=30, schedule="cosine")
    assert [lr_multiplier(s, cfg, 5) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert "longer than train.steps=5: warming up over all 5 steps" in warmup_notice(cfg, 5)
    assert warmup_notice(cfg, 30) == "" and lr_multiplier(29, cfg, 100) == 1.0


def test_a_valid_split_of_no_sequence_takes_the_last_training_documents():
    fake = type("Indexed", (), {"__len__": lambda self: 6, "sequence_lengths": np.full(6, 40, dtype=np.int32)})()
    assert split_ranges(6, [0.95, 0.05, 0.0])[1] == (6, 6)  # what megatron's rounding gives: nothing
    ranges, notice = sized_up_ranges(fake, [0.95, 0.05, 0.0], seq_len=64)
    assert ranges[0] == (0, 4) and ranges[1] == (4, 6)  # two 40-token documents hold one 65-token window
    assert "takes the last 2 training document(s) (80 tokens" in notice
    assert sized_up_ranges(fake, [0.5, 0.5, 0.0], seq_len=64) == (split_ranges(6, [0.5, 0.5, 0.0]), "")


def test_a_small_folder_trains_five_steps_with_both_notices(tiny_config, tmp_path, capfd):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    (tmp_path / "texts").mkdir()
    for i in range(6):
        (tmp_path / "texts" / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(3000)))
    config = tiny_config(
        f"data.source={tmp_path / 'texts'}", "train.steps=5", "optim.warmup_steps=30", "log.progress=lines"
    )
    result = train(config)
    out = "".join(capfd.readouterr())
    assert len(result.losses) == 5 and result.val_losses
    assert "warming up over all 5 steps" in out and "takes the last 1 training document(s)" in out
