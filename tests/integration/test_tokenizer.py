"""SentencePiece tokenizer: training, newline round trip, content-hash cache."""

from __future__ import annotations

from tessera.validate import load_config
from tessera.data.pipeline import build_tokenizer
from tessera.data.sources import Document, load_corpus
from tessera.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_tokenizer

from helpers.runs import run_cli


def _docs(n: int = 60) -> list[Document]:
    return [Document(f"d{i}", f"def f{i}(x):\n    return x * {i} + 'caf\u00e9'\n\n") for i in range(n)]


def test_trains_bpe_with_specials_and_round_trips_text(tmp_path):
    path, cached = train_tokenizer(_docs(), "h1", 300, tmp_path)
    assert not cached
    tok = Tokenizer(path)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (300, PAD_ID, BOS_ID, EOS_ID)
    text = "def g(y):\n\treturn y  # \u00fcml\u00e4ut \U0001f600\n"
    assert tok.decode(tok.encode(text)) == text  # byte fallback covers unseen characters


def test_cache_is_reused_for_same_content_and_not_for_new(tmp_path):
    first, cached1 = train_tokenizer(_docs(), "h1", 300, tmp_path)
    mtime = first.stat().st_mtime_ns
    again, cached2 = train_tokenizer(_docs(), "h1", 300, tmp_path)
    other, cached3 = train_tokenizer(_docs(), "h2", 300, tmp_path)
    assert (cached1, cached2, cached3) == (False, True, False)
    assert again == first and again.stat().st_mtime_ns == mtime and other != first


def test_default_corpus_is_deterministic():
    docs_a, hash_a = load_corpus("default", 200_000)
    docs_b, hash_b = load_corpus("default", 200_000)
    assert hash_a == hash_b and [d.name for d in docs_a] == [d.name for d in docs_b]
    assert sum(len(d.text) for d in docs_a) == 200_000 and docs_a[0].name.endswith(".py")


def test_cli_trains_then_reuses(tmp_path):
    args = (
        "tokenizer",
        "train",
        "configs/smoke.toml",
        "data.max_chars=150000",
        "data.tokenizer_chars=150000",
        "model.vocab_size=400",
    )
    env = {"TESSERA_CACHE": str(tmp_path)}
    first = run_cli(*args, env=env)
    second = run_cli(*args, env=env)
    assert first.returncode == 0 and first.stdout.startswith("trained tokenizer: "), first.stderr
    assert second.returncode == 0 and second.stdout.startswith("reused cached tokenizer: ")
    assert first.stdout.split(": ")[1].split()[0] == second.stdout.split(": ")[1].split()[0]


def test_pipeline_reports_cache_hit(cache_dir):
    config = load_config(
        None,
        ["data.max_chars=100000", "data.tokenizer_chars=100000", "model.vocab_size=512", f"data.cache_dir={cache_dir}"],
    )
    docs, corpus_hash = load_corpus("default", 100_000)
    _, cached_first = build_tokenizer(config, docs, corpus_hash)
    tok, cached_second = build_tokenizer(config, docs, corpus_hash)
    assert cached_second and tok.vocab_size == 512
