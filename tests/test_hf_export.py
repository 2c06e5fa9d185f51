"""A trained run exports to a usable HF model directory: tokenizer, generation config, model card."""

from __future__ import annotations

import json

import torch
import transformers

from tessera.api import load_with_tokenizer
from tessera.hf.convert import hf_export
from tessera.model import generate
from tessera.train.trainer import train


def test_export_directory_tokenizes_and_generates_like_tessera(tiny_config, tmp_path):
    config = tiny_config("train.steps=2", "train.eval_every=2", "checkpoint.every=2")
    train(config)
    out = tmp_path / "hf"
    assert hf_export(config.train.run_dir, out) == "llama"
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    model, tok = load_with_tokenizer(config.train.run_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in ("def f(x):\n    return x * 2\n", "  two leading spaces\n\nand é ☃ 🎉"):
        ids = hf_tok(text)["input_ids"]
        assert ids == [tok.bos_id] + tok.encode(text)  # newlines map to tessera's symbol, not bytes
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.generation_config.eos_token_id == tok.eos_id and hf.config.bos_token_id == tok.bos_id
    prompt = hf_tok("def ", return_tensors="pt").input_ids
    want = generate(model, prompt, 12, temperature=0, eos_id=tok.eos_id)
    got = hf.generate(prompt, max_new_tokens=12)[:, prompt.shape[1] :]  # greedy from generation_config.json
    assert torch.equal(got, want)

    card = (out / "README.md").read_text()
    tokens = 2 * config.train.batch_size * config.train.seq_len
    assert "Trained with tessera for 2 steps" in card and f"{tokens:,} tokens" in card
    assert "Final training loss" in card and "validation loss" in card
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == config.model.max_seq_len
