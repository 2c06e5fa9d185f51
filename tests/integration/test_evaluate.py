"""Downstream tasks in the loop and through lm-eval, length extrapolation, run comparison, MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.runs import run_cli

from tessera.config import ConfigError
from tessera.evaluate.compare import compare_runs, read_records
from tessera.evaluate.lengths import check_length, parse_lengths
from tessera.evaluate.stdlib_task import build_stdlib_tasks
from tessera.evaluate.tasks import check_tasks


def test_stdlib_tasks_are_deterministic_and_well_formed(tmp_path):
    a, b = build_stdlib_tasks(tmp_path / "a", 40), build_stdlib_tasks(tmp_path / "b", 40)
    rows = (a / "stdlib_next_line" / "stdlib_next_line.jsonl").read_text()
    assert rows == (b / "stdlib_next_line" / "stdlib_next_line.jsonl").read_text()
    docs = [json.loads(line) for line in rows.splitlines()]
    assert len(docs) == 40 and all(len(d["choices"]) == 4 and 0 <= d["label"] < 4 for d in docs)
    labels = [d["label"] for d in docs]
    assert len(set(labels)) == 4  # the true line is not always in the same place
    assert check_tasks(["stdlib_next_line", "stdlib_line_end"], [a], allow_harness=False)


def _bad_task(tmp_path: Path, row: str) -> Path:
    d = build_stdlib_tasks(tmp_path / "t", 5) / "stdlib_next_line" / "stdlib_next_line.jsonl"
    lines = d.read_text().splitlines()
    d.write_text("\n".join(lines[:2] + [row] + lines[2:]) + "\n")
    return tmp_path / "t"


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"context": "x", "choices": ["a", "b"]', "line 3 is not JSON"),
        ('{"context": "x", "choices": ["a", "b"], "label": 2}', "'label' 2 is not an index"),
        ('{"choices": ["a", "b"], "label": 0}', "has no field 'context'"),
    ],
)
def test_malformed_task_rows_are_one_line(tmp_path, row, message):
    with pytest.raises(ConfigError, match=message):
        check_tasks(["stdlib_next_line"], [_bad_task(tmp_path, row)], allow_harness=False)


def test_unknown_task_and_unrepresentable_length(tmp_path, tiny_config):
    with pytest.raises(ConfigError, match="unknown task 'no_such_task'"):
        check_tasks(["no_such_task"], [build_stdlib_tasks(tmp_path, 5)], allow_harness=False)
    cfg = tiny_config("model.position.kind=learned").model
    check_length(cfg, 64)
    with pytest.raises(ConfigError, match="beyond what learned positions represent"):
        check_length(cfg, parse_lengths("4x", 32)[0])


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line(tmp_path, tiny_config):
    config = tmp_path / "job.toml"
    config.write_text(tiny_config("eval.tasks=stdlib_next_lines").to_toml())
    result = run_cli("train", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "unknown task 'stdlib_next_lines'" in result.stderr
    result = run_cli("compare", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "has no metrics.jsonl" in result.stderr


@pytest.mark.slow
def test_in_loop_scores_equal_lm_eval_adapter_and_mlflow(tmp_path, tiny_config):
    """The in-loop evaluation and ``--model tessera`` on the saved checkpoint give the same scores."""
    from tessera.evaluate.harness import run_tasks
    from tessera.evaluate.loop import resolve_task_dirs
    from tessera.lm_eval_model import TesseraRunLM
    from tessera.train.trainer import train

    cfg = tiny_config(
        "eval.tasks=stdlib_next_line,stdlib_line_end",
        "eval.limit=6",
        "eval.stdlib_docs=20",
        "log.mlflow=true",
        f"log.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}",
    )
    train(cfg)
    final = [r for r in read_records(Path(cfg.train.run_dir)) if "eval/stdlib_next_line/acc" in r][-1]
    assert final["step"] == cfg.train.steps
    lm = TesseraRunLM(path=cfg.train.run_dir)
    dirs = resolve_task_dirs(cfg, Path(cfg.data.cache_dir))
    scores = run_tasks(lm, ["stdlib_next_line", "stdlib_line_end"], dirs, limit=6, include_defaults=False)
    assert scores and all(final[f"eval/{k}"] == v for k, v in scores.items()), (scores, final)
    logged = list((tmp_path / "mlruns").rglob("metrics/eval/stdlib_next_line/acc"))
    assert logged and logged[0].read_text().split()[1] == str(final["eval/stdlib_next_line/acc"])


def test_compare_reads_a_torn_line_and_overlays(tmp_path):
    for name, shift in (("a", 0.0), ("b", 0.5)):
        run = tmp_path / name
        run.mkdir()
        lines = [json.dumps({"step": s, "loss": 5 - s / 10 + shift, "val_loss": 5.1 - s / 10}) for s in range(1, 6)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')  # still being written
    table, png = compare_runs([str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "c.png")
    assert "| a | 5 | 4.5 |" in table and "| b | 5 | 5 |" in table and png.stat().st_size > 1000


def test_eval_of_hf_llama_equals_transformers_perplexity(tmp_path):
    """`tessera eval` on a tiny random LlamaForCausalLM directory matches transformers' own perplexity."""
    transformers = pytest.importorskip("transformers")
    from tessera.api import evaluate_lengths
    from tessera.data.prepare import indexed_dataset_classes

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    ids = np.random.default_rng(0).integers(0, 128, size=200).astype(np.int32)
    _, builder_cls = indexed_dataset_classes()
    builder = builder_cls(str(tmp_path / "text.bin"), dtype=np.int32)
    builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(str(tmp_path / "text.idx"))
    rows, _ = evaluate_lengths(tmp_path / "llama", "1x,2x", "model", str(tmp_path / "text"), 64, seq_len=16)
    for row in rows:
        n = 64 // row.length
        x = torch.from_numpy(ids[: n * row.length + 1].astype(np.int64))
        windows = torch.stack([x[i * row.length : (i + 1) * row.length + 1] for i in range(n)])
        with torch.no_grad():  # transformers' own forward; the same next-token targets tessera scores
            logits = hf(windows[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), windows[:, 1:].reshape(-1))
        assert abs(row.nll - float(want)) < 1e-4 * abs(float(want)), (row, float(want))


@pytest.mark.slow
def test_scores_equal_at_dp2_and_tp2(tmp_path):
    """One spawned world of 2 ranks: dp=2 and tp=2 reproduce the single-process scores (1e-6 relative)."""
    from helpers.runs import torchrun

    out = tmp_path / "scores.json"
    torchrun(2, "tests/helpers/dist_eval.py", str(out))
    got = json.loads(out.read_text())
    want = got["single"]
    for layout in ("dp2", "tp2"):
        for (a, greedy_a), (b, greedy_b) in zip(got[layout]["loglik"], want["loglik"]):
            assert abs(a - b) <= 1e-6 * abs(b) and greedy_a == greedy_b, (layout, a, b)
    assert got["dp2"]["greedy"] == want["greedy"] and got["tp2"]["greedy"] == want["greedy"]


def test_eval_rules_and_missing_extras_are_one_line(tiny_config, monkeypatch):
    import importlib.util

    from tessera.config import LogConfig
    from tessera.evaluate.harness import require_lm_eval
    from tessera.train.metrics import check_sinks

    with pytest.raises(ConfigError, match="not with parallel.pp > 1"):
        tiny_config("eval.tasks=stdlib_next_line", "parallel.pp=2")
    with pytest.raises(ConfigError, match="eval.limit must be >= 0"):
        tiny_config("eval.limit=-1")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("mlflow", "lm_eval") else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'tessera\[mlflow\]'"):
        check_sinks(LogConfig(mlflow=True))
    with pytest.raises(ConfigError, match=r"pip install 'tessera\[eval\]'"):
        require_lm_eval()


def test_generated_text_keeps_its_leading_space(small_tokenizer):
    """A continuation decoded alone loses SentencePiece's leading space; the adapter decodes it after its prompt."""
    from types import SimpleNamespace

    from tessera.data.tokenizer import Tokenizer
    from tessera.evaluate.harness import TesseraLM

    tok = Tokenizer(small_tokenizer)
    prompt, continuation = "def f1(x):\n    return", " x * 1\n"
    full = tok.encode(prompt + continuation)
    n = len(tok.encode(prompt))
    scorer = SimpleNamespace(greedy=lambda prompts, max_new, eos: [full[n:]])
    request = SimpleNamespace(args=(prompt, {"until": ["\n"], "max_gen_toks": 16}))
    assert TesseraLM(scorer, tok).generate_until([request]) == [" x * 1"]
