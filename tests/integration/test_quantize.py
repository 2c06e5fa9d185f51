"""`tessera convert quantize`: torchao weight-only schemes, loaded by transformers and by tessera alike."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import run_cli

from tessera.api import load
from tessera.model import generate
from tessera.quantize.convert import quantize_run
from tessera.train.trainer import train

PROMPT = [[5, 17, 42, 9]]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, cache_dir):
    from helpers.runs import TINY_OVERRIDES

    from tessera.validate import load_config

    run = tmp_path_factory.mktemp("quant") / "run"
    overrides = [*TINY_OVERRIDES, f"train.run_dir={run}", f"data.cache_dir={cache_dir}", "train.eval_every=0"]
    train(load_config(None, [*overrides, "optim.lr=3e-3"]))
    return run


@pytest.mark.parametrize("scheme", ["int8-weight", "int4-weight", "fp8"])
def test_quantized_export_decodes_the_same_in_transformers_and_tessera(trained_run, tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    out = quantize_run(trained_run, tmp_path / scheme, scheme)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load(out)
    stored = type(hf.model.layers[0].mlp.up_proj.weight).__name__
    assert type(ours.layers["0"].feed_forward.up_proj.weight).__name__ == stored != "Parameter"
    ids = torch.tensor(PROMPT)
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    got = generate(ours, ids, 12, temperature=0.0)[0].tolist()
    assert got == want
    plain = load(trained_run)
    with torch.no_grad():
        diff = (ours(ids) - plain(ids)).abs().max().item()
    assert 0 < diff < 1.0, diff  # quantized (not the fp32 weights), and close to them


def test_bad_int4_group_size_is_one_line_exit_2(trained_run, tmp_path):
    args = ["convert", "quantize", str(trained_run), str(tmp_path / "q"), "--scheme", "int4-weight"]
    args += ["--group-size", "48"]
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    want = (
        "tessera: error: --group-size 48 does not divide the input dimension 64 of layers.0.attention.q_proj; "
        "use a divisor of 64 (e.g. 32)"
    )
    assert lines == [want], lines
    assert not (tmp_path / "q").exists()
