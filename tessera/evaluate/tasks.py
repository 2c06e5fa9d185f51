"""Which downstream tasks exist and whether their files are sound, checked before any work starts.

Tasks are lm-eval-harness task YAMLs. tessera looks in the built-in directory (the stdlib tasks, built on
first use, see :mod:`tessera.evaluate.stdlib_task`) and in the directories of ``eval.task_dirs``; any
other name is looked up among lm-eval's own tasks (those download their data: not for offline jobs).
Local JSONL data files (``dataset_path: json``) are read row by row here, so a malformed row is one clear
line naming the file, the row and the fix, not a traceback from inside lm-eval.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tessera.config import ConfigError
from tessera.evaluate.stdlib_task import BUILTIN_TASKS, builtin_task_dir


def _yaml_files(task_dirs: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in task_dirs:
        for path in sorted(Path(root).rglob("*.yaml")):
            try:
                doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_IgnoreTags)
            except yaml.YAMLError as err:
                raise ConfigError(f"task file {path} is not valid YAML: {err}; fix the file") from None
            if isinstance(doc, dict) and isinstance(doc.get("task"), str):
                found.setdefault(doc["task"], path)
    return found


class _IgnoreTags(yaml.SafeLoader):
    """A safe loader that reads lm-eval's ``!function`` tags as plain strings."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_dirs_for(tasks: list[str], extra_dirs: list[str], cache_root: Path, n_docs: int = 200) -> list[Path]:
    """The directories lm-eval must include: the built-in one (when a built-in task is named) and ``extra_dirs``."""
    dirs = [Path(d) for d in extra_dirs]
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"eval.task_dirs: '{d}' is not a directory; give directories of lm-eval task YAMLs")
    if any(t in BUILTIN_TASKS for t in tasks):
        dirs.insert(0, builtin_task_dir(cache_root, n_docs))
    return dirs


def check_tasks(tasks: list[str], task_dirs: list[Path], allow_harness: bool = True) -> bool:
    """ConfigError for an unknown task name or a malformed row of a local task; True when every task is local."""
    local = _yaml_files(task_dirs)
    missing = [t for t in tasks if t not in local]
    if missing and allow_harness:
        from tessera.evaluate.harness import task_manager

        known = set(task_manager([]).all_tasks)
        missing = [t for t in missing if t not in known]
    if missing:
        names = ", ".join(sorted(local)) or "none"
        raise ConfigError(
            f"eval.tasks: unknown task {missing[0]!r}; local tasks: {names}; add its YAML directory to "
            "eval.task_dirs or use an lm-eval task name"
        )
    for name in tasks:
        if name in local:
            check_task_rows(local[name])
    return all(t in local for t in tasks)


def _data_files(config: dict[str, Any], yaml_path: Path) -> list[Path]:
    if config.get("dataset_path") != "json":
        return []
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    values = files.values() if isinstance(files, dict) else [files]
    paths = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            path = Path(item)
            paths.append(path if path.is_absolute() else Path.cwd() / path)
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"task {yaml_path}: data file '{path}' does not exist; fix dataset_kwargs.data_files")
    return paths


def _field(spec: Any) -> str | None:
    """The row field a ``doc_to_*`` entry names directly (``label`` or ``{{label}}``), else None (a template)."""
    if not isinstance(spec, str):
        return None
    text = spec.strip()
    if text.startswith("{{") and text.endswith("}}") and text.count("{{") == 1:
        text = text[2:-2].strip()
    return text if text.isidentifier() else None


def check_task_rows(yaml_path: Path) -> None:
    """Every row of the task's local JSONL files: a JSON object with the fields the task reads."""
    config = yaml.load(yaml_path.read_text(encoding="utf-8"), Loader=_IgnoreTags)
    fields = {key: _field(config.get(key)) for key in ("doc_to_text", "doc_to_choice", "doc_to_target")}
    multiple_choice = config.get("output_type") == "multiple_choice"
    for data in _data_files(config, yaml_path):
        for n, line in enumerate(data.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                _check_row(line, fields, multiple_choice, f"task {config['task']}: {data} line {n}")


def _check_row(line: str, fields: dict[str, str | None], multiple_choice: bool, where: str) -> None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not JSON ({err.msg}); write one JSON object per line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a {type(row).__name__}, not a JSON object; write one object per line")
    for key, name in fields.items():
        if name is not None and name not in row:
            raise ConfigError(f"{where} has no field {name!r} (the task's {key}); add it to every row")
    choice, target = fields["doc_to_choice"], fields["doc_to_target"]
    if not (multiple_choice and choice and target and choice in row and target in row):
        return
    options, label = row[choice], row[target]
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
        raise ConfigError(f"{where}: {choice!r} must be a list of at least two strings; fix the row")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
        raise ConfigError(f"{where}: {target!r} {label!r} is not an index into its {len(options)} choices; fix it")
