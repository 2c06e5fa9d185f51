"""Corpus sources: plain text, JSON/JSONL, Parquet and Arrow files and folders; hub names offline."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tessera.data.sources import DataError, is_hub_name, iter_documents, load_corpus


def _rows(tag: str, n: int) -> list[dict]:
    return [{"content": f"{tag} document {i}\nsecond line", "id": i} for i in range(n)]


def _write_mixed_folder(root):
    root.mkdir()
    (root / "a.txt").write_text("plain text file\n")
    with open(root / "b.jsonl", "w") as f:
        for row in _rows("jsonl", 3):
            f.write(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist(_rows("parquet", 2)), root / "c.parquet")
    table = pa.Table.from_pylist(_rows("arrow", 2))
    with pa.OSFile(str(root / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (root / "e.txt").write_text("   \n")  # blank: skipped
    return root


def test_folder_of_text_jsonl_parquet_arrow_in_fixed_order(tmp_path):
    root = _write_mixed_folder(tmp_path / "corpus")
    docs = list(iter_documents(str(root), text_field="content"))
    assert [d.name for d in docs] == [
        "a.txt",
        "b.jsonl#0",
        "b.jsonl#1",
        "b.jsonl#2",
        "c.parquet#0",
        "c.parquet#1",
        "d.arrow#0",
        "d.arrow#1",
    ]
    assert docs[0].text == "plain text file\n"
    assert docs[2].text == "jsonl document 1\nsecond line" and docs[-1].text == "arrow document 1\nsecond line"
    again, digest = load_corpus(str(root), text_field="content")
    assert again == docs and digest == load_corpus(str(root), text_field="content")[1]


def test_single_structured_file_and_max_chars(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(_rows("p", 50)), path)
    docs = list(iter_documents(str(path), max_chars=100, text_field="content"))
    assert sum(len(d.text) for d in docs) == 100 and len(docs) == 5 and docs[-1].text == "p do"  # 24 chars each


def test_wrong_text_field_names_the_file_and_the_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl' row 0 has no field 'text' \(fields: body\)"):
        load_corpus(str(path))


def test_unparseable_structured_file_is_a_data_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken.parquet' could not be read as parquet"):
        load_corpus(str(path))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match=r"'.*nope' does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match="has no non-empty text documents"):
        load_corpus(str(tmp_path / "empty"))


def test_hub_names_offline_fail_fast_and_clearly(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert is_hub_name("hf:wikitext") and is_hub_name("someone/some-data") and not is_hub_name("default")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(
        DataError, match=r"'someone/some-data' is a Hugging Face hub dataset but this machine is offline"
    ):
        load_corpus("someone/some-data")
    assert time.perf_counter() - started < 5
