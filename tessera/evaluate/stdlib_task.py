"""The shipped downstream tasks, built on this machine from the default corpus (the Python standard library).

``stdlib_next_line``: six lines of stdlib code, then four candidate next lines (the true one and three other
lines of the same file); the model picks the likeliest (multiple choice, accuracy; chance is 25%).
``stdlib_line_end``: the same six lines plus the first part of the next line; the model completes the line
greedily (generation, exact match).

Both are drawn deterministically (fixed seed, sorted paths) from the second half of the stdlib's files in
path order, which the smoke recipe's corpus (``data.max_chars`` = 6M characters, read in path order, about the
first quarter of the files) never reads: the task measures generalization, not recall. Each task directory
holds lm-eval-harness files (a task YAML with ``dataset_path: json`` and a JSONL data file), so
``lm_eval --include_path DIR`` reads it too.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tessera.data.sources import _default_files

CONTEXT_LINES = 6
CHOICES = 4
MIN_LINE_CHARS = 8
MAX_LINE_CHARS = 100
TASK_VERSION = 2  # bump when the generator changes: a new cache directory is built

MC_YAML = """task: stdlib_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""

GEN_YAML = """task: stdlib_line_end
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: target
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 32
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""

BUILTIN_TASKS = ("stdlib_next_line", "stdlib_line_end")


def _usable(line: str) -> bool:
    text = line.strip()
    return MIN_LINE_CHARS <= len(text) <= MAX_LINE_CHARS and not text.startswith("#")


def _file_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    return [line.rstrip() for line in text.splitlines()]


def _items_of_file(lines: list[str], rng: random.Random, per_file: int) -> list[tuple[str, str, list[str]]]:
    """(context, true line, three distractor lines) for up to ``per_file`` positions of one file."""
    pool = sorted({line for line in lines if _usable(line)})
    positions = [i for i in range(CONTEXT_LINES, len(lines)) if _usable(lines[i])]
    rng.shuffle(positions)
    items = []
    for i in positions[:per_file]:
        others = [line for line in pool if line.strip() != lines[i].strip()]
        if len(others) < CHOICES - 1:
            continue
        context = "\n".join(lines[i - CONTEXT_LINES : i]) + "\n"
        items.append((context, lines[i], rng.sample(others, CHOICES - 1)))
    return items


def stdlib_items(n_docs: int, seed: int = 0, per_file: int = 2) -> list[tuple[str, str, list[str]]]:
    """``n_docs`` items from the second half of the stdlib's files (path order), deterministically."""
    files = _default_files()
    held_out = files[len(files) // 2 :]
    rng = random.Random(seed)
    order = list(range(len(held_out)))
    rng.shuffle(order)
    items: list[tuple[str, str, list[str]]] = []
    for k in order:
        items.extend(_items_of_file(_file_lines(held_out[k][1]), rng, per_file))
        if len(items) >= n_docs:
            break
    return items[:n_docs]


def _mc_row(item: tuple[str, str, list[str]], rng: random.Random) -> dict:
    context, true, distractors = item
    label = rng.randrange(CHOICES)
    choices = distractors[:label] + [true] + distractors[label:]
    return {"context": context, "choices": choices, "label": label}


def _gen_row(item: tuple[str, str, list[str]]) -> dict:
    context, true, _ = item
    indent = len(true) - len(true.lstrip())
    cut = true.find(" ", indent + len(true.strip()) // 2)
    cut = cut if cut > 0 else indent + len(true.strip()) // 2
    return {"context": context + true[:cut], "target": true[cut:]}


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def build_stdlib_tasks(out_dir: str | Path, n_docs: int = 200, seed: int = 0) -> Path:
    """Write both tasks (YAML + JSONL each) under ``out_dir``; the same files every time on one Python."""
    out = Path(out_dir)
    items = stdlib_items(n_docs, seed)
    rng = random.Random(seed + 1)
    rows = {"stdlib_next_line": [_mc_row(i, rng) for i in items], "stdlib_line_end": [_gen_row(i) for i in items]}
    for name, yaml_text in (("stdlib_next_line", MC_YAML), ("stdlib_line_end", GEN_YAML)):
        task_dir = out / name
        task_dir.mkdir(parents=True, exist_ok=True)
        data = task_dir / f"{name}.jsonl"
        _write(data, "".join(json.dumps(r) + "\n" for r in rows[name]))
        _write(task_dir / f"{name}.yaml", yaml_text.format(data=json.dumps(str(data.resolve())), version=TASK_VERSION))
    return out


def builtin_task_dir(cache_root: Path, n_docs: int = 200) -> Path:
    """The built-in tasks' directory in the cache (built on first use; keyed by Python version and size)."""
    key = f"stdlib-{sys.version_info.major}.{sys.version_info.minor}-v{TASK_VERSION}-n{n_docs}"
    out = cache_root / "eval_tasks" / key
    if not (out / "stdlib_line_end" / "stdlib_line_end.yaml").is_file():
        build_stdlib_tasks(out, n_docs)
    return out
