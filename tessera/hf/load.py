"""An HF model directory read slice by slice: each rank reads only the parts of the safetensors files it owns.

:class:`HFSlices` opens the headers of an HF directory's safetensors files (one file, several, or
the shards a ``model.safetensors.index.json`` names), maps their names to tessera's with the
family's weight map (``tessera/hf/families``), and answers ``read(name, offsets, shape)``: the
block of the tessera tensor ``name`` that starts at ``offsets``, read with safetensors'
``get_slice`` so that only those bytes are touched. The family rules' transposes, fused QKV
splits and per-expert stacks become index arithmetic on the HF tensors; a family that rewrites
its tensors before mapping (DeepSeek's RoPE de-interleave) is read one whole HF tensor at a time.
Pickle files (``pytorch_model.bin``) are refused, never opened.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tessera.config import ModelConfig
from tessera.hf.families import FAMILIES, HFConversionError, Rule
from tessera.hf.families.common import SPLIT_LAST, split_last
from tessera.hf.weights import _OUTPUT_KEYS, config_from_hf, is_hf_dir

_INDEX = "model.safetensors.index.json"
_FIRST = 3  # names listed in a missing / unexpected tensor message


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _FIRST} more" if len(names) > _FIRST else ""
    return ", ".join(f"'{n}'" for n in names[:_FIRST]) + more


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of HF directory ``path`` (the index's shards when it has one)."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise HFConversionError(
                f"'{index}' is not a safetensors index (no weight_map); download it again"
            ) from None
        files = sorted({path / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise HFConversionError(f"'{index}' names shard '{absent[0]}', which is not in '{path}'; download it")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickles:
        raise HFConversionError(
            f"'{path}' holds only pickle weights ({pickles[0]}); tessera reads safetensors only and never unpickles a "
            "checkpoint. Convert it where you trust it: AutoModel.from_pretrained(DIR).save_pretrained(DIR, "
            "safe_serialization=True)"
        )
    found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
    raise HFConversionError(f"'{path}' has no *.safetensors weights (found: {found}); tessera reads safetensors only")


def _headers(files: list[Path]) -> dict[str, tuple[Path, torch.Size]]:
    """HF tensor name -> (file, shape), from the files' headers only (a truncated file is refused here)."""
    found: dict[str, tuple[Path, torch.Size]] = {}
    for file in files:
        _check_length(file, file.stat().st_size)
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    found[key] = (file, torch.Size(f.get_slice(key).get_shape()))
        except (SafetensorError, OSError) as err:
            raise HFConversionError(
                f"'{file}' is not a readable safetensors file ({str(err).splitlines()[0]}); download it again"
            ) from None
    return found


def _check_length(file: Path, size: int) -> None:
    """Refuse a file shorter than its header says (a download cut short)."""
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(header_len, size)))
    except (ValueError, UnicodeDecodeError):
        return  # not even a header: safetensors' own message says so
    if not isinstance(header, dict):
        return
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)]
    if 8 + header_len + max(ends, default=0) > size:
        raise HFConversionError(
            f"'{file}' is truncated ({size} bytes; its header needs {8 + header_len + max(ends)}); download it again"
        )


class HFSlices:
    """The tessera-named tensors of an HF directory, read block by block (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not is_hf_dir(self.path):
            raise HFConversionError(f"'{self.path}' is not an HF model directory (no config.json with a model_type)")
        self.hf_config: dict[str, Any] = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
        self.headers = _headers(weight_files(self.path))
        self.cfg, self.family = self._resolve_config()
        self.spec = FAMILIES[self.family]
        self.rules: dict[str, tuple[Rule, int]] = {}  # tessera name -> (its rule, its index in rule.ours)
        for rule in self.spec.rules(self.cfg, self.family):
            for i, ours in enumerate(rule.ours):
                self.rules[ours] = (rule, i)
        self._check_names()

    def _resolve_config(self) -> tuple[ModelConfig, str]:
        hf = self.hf_config
        if hf.get("model_type") == "t5":
            raise HFConversionError(f"'{self.path}': train.init_from reads decoder families; t5 is not one yet")
        try:
            cfg, family = config_from_hf(dict(hf))
        except KeyError as err:
            raise HFConversionError(
                f"'{self.path / 'config.json'}' lacks the key {err}; fix or re-download it"
            ) from None
        prepare = FAMILIES[family].prepare
        if prepare is not None:  # on meta tensors: resolves what it decides from the names (DeepSeek's MTP depth)
            prepare(hf, cfg, {k: torch.empty(s, device="meta") for k, (_, s) in self.headers.items()})
        return cfg, family

    def _check_names(self) -> None:
        used = {k for rule, _ in self.rules.values() for k in rule.theirs}
        missing = sorted(k for k in used if k not in self.headers)
        if missing:
            raise HFConversionError(f"'{self.path}' lacks the {self.family} tensor(s) {_names(missing)}")
        ignored = self.spec.ignored + (_OUTPUT_KEYS if self.cfg.tie_embeddings else ())
        unexpected = sorted(k for k in self.headers if k not in used and not any(s in k for s in ignored))
        if unexpected:
            raise HFConversionError(
                f"'{self.path}' has tensor(s) {_names(unexpected)} that a {self.family} model of its config.json has "
                "no place for (an unsupported option, or a config.json that does not match the weights)"
            )

    def names(self) -> list[str]:
        """The tessera tensor names this source provides."""
        return list(self.rules)

    def source_name(self, name: str) -> str:
        """The HF tensor name(s) tessera tensor ``name`` is made of."""
        return ", ".join(self.rules[name][0].theirs[:2]) + (", ..." if len(self.rules[name][0].theirs) > 2 else "")

    def shape(self, name: str) -> torch.Size:
        """The shape tessera tensor ``name`` has in this source."""
        rule, _ = self.rules[name]
        first = self.headers[rule.theirs[0]][1]
        if rule.kind == "copy":
            return first
        if rule.kind == "t":
            return torch.Size(reversed(first))
        if rule.kind == "experts":
            return torch.Size((len(rule.theirs), first[1], first[0]))
        if rule.kind in SPLIT_LAST:
            return torch.Size((*first[:-1], first[-1] // len(rule.ours)))
        rows = first[-1] if rule.kind == "fused_t" and len(first) == 2 else first[0]
        part = math.ceil(rows / len(rule.ours))
        rest = first[1:] if rule.kind == "fused" else first[:1] if len(first) == 2 else ()
        return torch.Size((part, *rest))

    def _slice(self, hf_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        file = self.headers[hf_name][0]
        with safe_open(str(file), framework="pt") as f:
            if self.spec.prepare is None:
                return f.get_slice(hf_name)[index] if index else f.get_tensor(hf_name)
            tensors = {hf_name: f.get_tensor(hf_name)}  # the family rewrites whole tensors: one at a time
        self.spec.prepare(dict(self.hf_config), copy.deepcopy(self.cfg), tensors)
        return tensors[hf_name][index]

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tessera tensor ``name`` at ``offsets`` with ``shape`` (fp32, contiguous)."""
        rule, i = self.rules[name]
        idx = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        theirs = rule.theirs
        if rule.kind == "copy":
            out = self._slice(theirs[0], idx)
        elif rule.kind == "t":
            out = self._slice(theirs[0], idx[::-1]).T
        elif rule.kind == "experts":
            e, rows, cols = idx
            out = torch.stack([self._slice(theirs[k], (cols, rows)).T for k in range(e.start, e.stop)])
        elif rule.kind in SPLIT_LAST:  # the HF tensor's leading dims sliced, then our part of its last dim
            out = split_last(self._slice(theirs[0], idx[:-1]), i, len(rule.ours), rule.kind)[..., idx[-1]]
        else:
            out = self._fused_part(rule, i, idx)
        return out.float().contiguous()

    def _fused_part(self, rule: Rule, i: int, idx: tuple[slice, ...]) -> torch.Tensor:
        """Part ``i`` of a fused HF tensor (chunked along HF's output dim; Conv1D keeps it last)."""
        full = self.headers[rule.theirs[0]][1]
        transposed = rule.kind == "fused_t" and len(full) == 2
        rows = full[-1] if transposed else full[0]
        start = i * math.ceil(rows / len(rule.ours))
        first = slice(start + idx[0].start, start + idx[0].stop)
        if transposed:
            return self._slice(rule.theirs[0], (idx[1], first)).T
        return self._slice(rule.theirs[0], (first, *idx[1:]))
