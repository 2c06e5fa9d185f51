"""Bring-your-own tokenizers: HF tokenizer.json files and directories behind the one Tokenizer interface.

Every tokenizer here is built locally with the ``tokenizers`` library (nothing is downloaded):
a GPT-2-style byte-level BPE and a 128k-entry word-level vocabulary whose ids need int32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
from conftest import run_cli
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tessera.api import load_with_tokenizer
from tessera.validate import load_config
from tessera.hf.convert import hf_export, hf_import
from tessera.data.dataset import open_indexed
from tessera.data.pipeline import build_data, check_vocab
from tessera.data.prepare import prepare_source, write_indexed_dataset
from tessera.data.sources import DataError
from tessera.data.tokenizer import Tokenizer

TEXTS = [f"def f{i}(x):\n    return x * {i} + 'caf\u00e9'\n\n" for i in range(300)]
BIG_VOCAB = 128_000


def _byte_level_bpe(vocab_size: int = 400) -> RustTokenizer:
    """A GPT-2-style byte-level BPE trained on TEXTS, with <|endoftext|> (0) and <|pad|> (1)."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(TEXTS, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """An HF tokenizer directory: tokenizer.json + tokenizer_config.json naming BOS/EOS/PAD."""
    out = tmp_path_factory.mktemp("bpe")
    _byte_level_bpe().save(str(out / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|pad|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> Path:
    """A bare tokenizer.json of 128,000 words w0..w127999 plus <unk> and </s>: ids above 65,535 need int32."""
    out = tmp_path_factory.mktemp("big") / "tokenizer.json"
    vocab = {f"w{i}": i for i in range(BIG_VOCAB)} | {"<unk>": BIG_VOCAB, "</s>": BIG_VOCAB + 1}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens(["</s>"])
    tok.save(str(out))
    return out


def test_hf_directory_file_and_bare_json_load_with_their_special_tokens(bpe_dir, tmp_path):
    tok = Tokenizer(bpe_dir)
    assert (tok.kind, tok.path, tok.vocab_size) == ("hf", bpe_dir / "tokenizer.json", 400)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 0, 1)
    text = "def g(y):\n\treturn y  # \u00fcml\u00e4ut \U0001f600\n"
    assert tok.decode(tok.encode(text)) == text  # byte-level: any text round-trips
    assert tok.encode_batch([text, "x"]) == [tok.encode(text), tok.encode("x")]
    assert Tokenizer(bpe_dir / "tokenizer.json").eos_id == 0  # the config beside the file is read too
    assert tok.prompt_ids("x") == [0] + tok.encode("x")
    bare = tmp_path / "bare.json"  # no config: the usual names among the special tokens
    bare.write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    bare_tok = Tokenizer(bare)
    assert (bare_tok.bos_id, bare_tok.eos_id, bare_tok.pad_id) == (None, 0, 1)
    assert bare_tok.prompt_ids("x") == bare_tok.encode("x")  # no BOS to prepend


def test_missing_or_unknown_special_tokens_are_one_line_errors(tmp_path):
    tok = RustTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"has no EOS token.*set eos_token in .*tokenizer_config.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError, match=r"eos_token '</s>' is not in the vocabulary"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b", "bos_token": None}))
    assert (Tokenizer(tmp_path).eos_id, Tokenizer(tmp_path).bos_id) == (1, None)
    with pytest.raises(DataError, match="holds no tokenizer.json or tokenizer.model"):
        Tokenizer(tmp_path / "..")


def test_foreign_sentencepiece_model_keeps_its_own_newline_handling(tmp_path):
    """A SentencePiece model trained elsewhere (Llama-2 style: identity normalization, byte fallback, no tessera
    newline piece) is used as it is."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(t.replace("\n", " ") for t in TEXTS),
        model_prefix=str(tmp_path / "foreign"),
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    tok = Tokenizer(tmp_path / "foreign.model")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "foreign.model"))
    assert tok.kind == "sentencepiece" and tok.encode("a\nb") == sp.encode("a\nb")
    assert tok.decode(tok.encode("x\ny")) == "x\ny"  # newline through byte fallback, not tessera's piece


def test_128k_vocabulary_is_stored_as_int32_and_reaches_the_batches(big_vocab, tmp_path, cache_dir):
    tok = Tokenizer(big_vocab)
    assert tok.vocab_size == BIG_VOCAB + 2 and tok.eos_id == BIG_VOCAB + 1 and tok.bos_id is None
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in rng.integers(0, BIG_VOCAB, 200)) for _ in range(60)]
    summary = write_indexed_dataset(docs, tok, tmp_path / "big", num_proc=2)
    assert summary.dtype == "int32" and open_indexed(tmp_path / "big").index.dtype == np.int32
    assert open_indexed(tmp_path / "big").get(3).tolist() == tok.encode(docs[3]) + [tok.eos_id]
    config = load_config(None, [
        f"model.vocab_size={BIG_VOCAB + 2}", "model.dim=32", "model.n_heads=4", "model.max_seq_len=64",
        "train.seq_len=32", "train.batch_size=4", f"data.blend={tmp_path / 'big'}", f"data.tokenizer={big_vocab}",
        f"data.cache_dir={cache_dir}", "data.prefetch=0", f"train.run_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    batch = build_data(config).train.next_batch()
    assert batch.tokens.dtype == torch.int64 and int(batch.tokens.max()) > 65_535
    config.model.vocab_size = 2048
    with pytest.raises(DataError, match=r"has 128002 tokens but model.vocab_size is 2048; set model.vocab_size >= "):
        check_vocab(tok, config)


def test_prepare_workers_encode_with_the_batch_api_like_one_process(bpe_dir, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tok = Tokenizer(bpe_dir)
    one = prepare_source(str(source), tmp_path / "one", tok, num_proc=1)
    two = prepare_source(str(source), tmp_path / "two", tok, num_proc=2)
    assert one.tokens == two.tokens and (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    reader = open_indexed(tmp_path / "two")
    assert [reader.get(i).tolist() for i in (0, 299)] == [tok.encode(TEXTS[i]) + [0] for i in (0, 299)]


def test_training_with_an_hf_tokenizer_keeps_it_in_the_run_for_generate(bpe_dir, tiny_config, tmp_path):
    from tessera.train.trainer import train

    run = tmp_path / "run"
    train(tiny_config("train.steps=2", "train.eval_every=2", f"data.tokenizer={bpe_dir}", run_dir=run))
    assert {p.name for p in run.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert not (run / "tokenizer.model").exists()
    _, tok = load_with_tokenizer(run)
    assert tok.kind == "hf" and tok.eos_id == 0 and tok.encode("def f") == Tokenizer(bpe_dir).encode("def f")
    out = run_cli("generate", str(run), "--prompt", "def f", "--max-new-tokens", "5", "--greedy")
    assert out.returncode == 0 and out.stdout.startswith("def f"), out.stderr


def test_cli_trains_a_byte_level_bpe_then_reuses_it(tmp_path):
    args = ("tokenizer", "train", "configs/smoke.toml", "--kind", "bpe", "data.max_chars=60000", "model.vocab_size=400")
    env = {"TESSERA_CACHE": str(tmp_path)}
    first, second = run_cli(*args, env=env), run_cli(*args, env=env)
    assert first.returncode == 0 and first.stdout.startswith("trained tokenizer: "), first.stderr
    assert second.stdout.startswith("reused cached tokenizer: ")
    path = Path(first.stdout.split(": ")[1].split()[0])
    assert path.name == "tokenizer.json" and path == Path(second.stdout.split(": ")[1].split()[0])
    tok = Tokenizer(path)
    assert (tok.kind, tok.vocab_size, tok.eos_id, tok.pad_id) == ("hf", 400, 0, 1)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent)  # a directory transformers reads as is
    assert hf.eos_token == "<|endoftext|>" and hf.encode("x = 1\n") == tok.encode("x = 1\n")


def test_hf_import_keeps_the_source_tokenizer_and_it_round_trips(bpe_dir, tmp_path):
    hf_dir = tmp_path / "hf"
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    source = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    source.eos_token, source.pad_token = "<|endoftext|>", "<|pad|>"
    source.save_pretrained(hf_dir)
    run = tmp_path / "run"
    hf_import(hf_dir, run)
    _, tok = load_with_tokenizer(run)
    text = "def g(x):\n    return 'caf\u00e9'\n"
    assert tok.kind == "hf" and tok.encode(text) == source.encode(text) and tok.eos_id == source.eos_token_id
    export = tmp_path / "export"
    hf_export(run, export)  # imported, then exported: the tokenizer comes back as it was
    again = transformers.AutoTokenizer.from_pretrained(export)
    assert again.encode(text) == source.encode(text) and again.eos_token_id == source.eos_token_id
    assert (export / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
