"""Bad input for the 2026 attention options: one line on stderr, exit 2, before anything is built."""

from __future__ import annotations

import pytest

from helpers.runs import REPO
from tessera.cli import main


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.attention.sinks=true", "model.attention.kernel=linear"],
            "model.attention.sinks needs a softmax kernel",
        ),
        (
            ["model.attention.sinks=true", "model.attention.kernel=performer"],
            "model.attention.kernel='performer' has no softmax denominator",
        ),
        (
            ["model.attention.sinks=true", "model.mla.kv_rank=16"],
            "latent attention (model.mla.kv_rank > 0) has no sinks",
        ),
        (
            ["model.attention.sliding_window=4096", "model.max_seq_len=256"],
            "model.attention.sliding_window=4096 is larger than the context (model.max_seq_len=256)",
        ),
        (["model.position.nope_layers=1,9"], "model.position.nope_layers has layer 9, out of range"),
        (["model.position.nope_layers=1,x"], "is not a list of distinct layer indices"),
        (["model.attention.softcap=50"], "model.attention.softcap=50.0 needs the scores written out"),
        (["model.position.local_rope_theta=10000"], "needs model.position.kind='rope', model.attention.sliding_window"),
    ],
)
def test_bad_attention_options_are_one_line(overrides, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/smoke.toml", *overrides, "--print-config"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: ") and message in lines[0], lines
