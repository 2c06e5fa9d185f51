"""``train.init_from``: start a run from another model's weights (continued pretraining).

The source is an HF model directory (safetensors, one file or an index's shards), a tessera run
or checkpoint, or a DeepSpeed checkpoint. Only the weights come from it: the optimizer, the LR
schedule, the data position and the step start fresh. Everything is checked before a process
group starts (:func:`check_init_from`): the recipe's ``[model]`` against the source's config (the
first differing key, both values), then every tensor's name and shape.

Loading happens after the model is parallelized (:meth:`InitSource.load_into`): each rank fills
only the blocks of the tensors it holds. From an HF directory they are read with safetensors
slices (:class:`tessera.hf.load.HFSlices`); from a tessera checkpoint DCP reads the shards each
rank's DTensors need; a DeepSpeed checkpoint is assembled in memory (its files are per-rank
pickled partitions of flat groups, not addressable tensors) and then sliced the same way.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.config import ConfigError, JobConfig, ModelConfig
from tessera.hf.weights import _canonical, is_hf_dir
from tessera.validate import config_from_dict

# Keys a continued run may change without touching a weight's meaning: RoPE models extend their context
# this way (a learned position table's size is still checked, as a tensor shape).
_FREE_KEYS = ("max_seq_len",)


class TensorSource(Protocol):
    """Tessera-named tensors that can be read block by block."""

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> torch.Size: ...
    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor: ...


class _InMemory:
    """Full tensors already in memory (a DeepSpeed checkpoint, assembled), read block by block."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> torch.Size:
        return self.tensors[name].shape

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        idx = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        return self.tensors[name][idx].float().contiguous()


class _Checkpoint:
    """A tessera checkpoint's model tensors (names and shapes from its DCP metadata; DCP reads the shards)."""

    def __init__(self, path: Path) -> None:
        from tessera.train.checkpoint import SafeFileSystemReader

        self.path = path
        metadata = SafeFileSystemReader(str(path)).read_metadata()
        prefix = "model."
        self.shapes = {
            k[len(prefix) :]: torch.Size(v.size)
            for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix)
        }

    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> torch.Size:
        return self.shapes[name]


@dataclasses.dataclass
class InitSource:
    """Where a run's first weights come from: the path, what it is, its model config and its tensors."""

    path: Path
    kind: str  # "HF llama", "tessera checkpoint step_00000100", "DeepSpeed zero-2", ...
    cfg: ModelConfig
    tensors: Any  # a TensorSource, or a _Checkpoint (loaded by DCP)
    key: str = "train.init_from"  # the config key that named it (messages say it): or train.distill.teacher

    def describe(self) -> str:
        """One line for the banner and the model card."""
        return f"{self.path} ({self.kind})"

    def load_into(self, model: nn.Module, no_dist: bool = False) -> None:
        """Overwrite ``model``'s weights (parallelized or not: each rank fills the blocks it holds). ``no_dist``:
        each rank reads its blocks alone (a model only some ranks hold, like a distillation teacher on the
        pipeline's last stage, cannot join a load's collectives)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        state = get_model_state_dict(model)
        if isinstance(self.tensors, _Checkpoint):
            from tessera.train.checkpoint import load_tensors

            wanted = {k: v for k, v in state.items() if k in self.tensors.shapes}
            load_tensors(self.tensors.path, {"model": wanted}, no_dist)
            set_model_state_dict(model, wanted, options=_partial())
            return
        with torch.no_grad():
            for name, tensor in state.items():
                if name in self.tensors.names():
                    _fill(tensor, name, self.tensors)


def _partial() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)


def _fill(tensor: torch.Tensor, name: str, source: TensorSource) -> None:
    """Copy this rank's block of ``name`` from ``source`` into ``tensor`` (a DTensor's local shard, or all of it)."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
    else:
        shape, offsets, local = tuple(tensor.shape), (0,) * tensor.dim(), tensor
    if local.numel() == 0:
        return
    local.copy_(source.read(name, tuple(offsets), tuple(shape)).reshape(local.shape))


def _is_deepspeed(path: Path) -> bool:
    return (path / "latest").is_file() or (path / "zero").is_dir() or any(path.glob("*optim_states.pt"))


def open_source(path: str, recipe: ModelConfig, key: str = "train.init_from") -> InitSource:
    """The :class:`InitSource` of ``train.init_from`` (or of ``key``, e.g. ``train.distill.teacher``; only headers
    and metadata are read here)."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(
            f"{key}='{path}' does not exist; give an HF model directory, a tessera run or checkpoint, or a "
            "DeepSpeed checkpoint"
        )
    if is_hf_dir(where):
        from tessera.hf.load import HFSlices

        slices = HFSlices(where)
        return InitSource(where, f"HF {slices.family}", slices.cfg, slices, key)
    if where.is_dir() and _is_deepspeed(where):
        return dataclasses.replace(_deepspeed_source(where, recipe), key=key)
    from tessera.api import find_checkpoint
    from tessera.train.checkpoint import read_meta

    ckpt = find_checkpoint(where)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"], where=str(ckpt / "meta.json")).model
    return InitSource(ckpt, f"tessera checkpoint {ckpt.name}", cfg, _Checkpoint(ckpt), key)


def _hf_config_near(path: Path) -> dict[str, Any] | None:
    """The config.json of an HF Trainer + DeepSpeed checkpoint (in the global_stepN folder or next to it)."""
    for folder in (path, path.parent):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return None


def _deepspeed_source(path: Path, recipe: ModelConfig) -> InitSource:
    """A DeepSpeed checkpoint: HF-named (a config.json beside it) or tessera-named (then the recipe is its model)."""
    from tessera.hf.weights import state_from_hf
    from tessera.train.ds_checkpoint import find_deepspeed_checkpoint, read_deepspeed

    state = read_deepspeed(path)
    hf_config = _hf_config_near(find_deepspeed_checkpoint(path))
    if hf_config is not None:
        cfg, weights, family = state_from_hf(dict(hf_config), dict(state.weights))
        return InitSource(path, f"DeepSpeed {state.kind}, HF {family} names", cfg, _InMemory(weights))
    weights = {k: v for k, v in state.weights.items() if not (recipe.tie_embeddings and k == "output.weight")}
    return InitSource(path, f"DeepSpeed {state.kind}, tessera names", recipe, _InMemory(weights))


def is_upcycling(recipe: ModelConfig, source: ModelConfig) -> bool:
    """A dense source into an MoE recipe (sparse upcycling, Komatsuzaki et al. 2022)."""
    return bool(recipe.moe.experts) and not source.moe.experts


def first_difference(recipe: ModelConfig, source: ModelConfig) -> tuple[str, Any, Any] | None:
    """The first key (dotted, under ``model.``) whose resolved value differs, with both values; None if none.
    Upcycling compares everything but the MoE keys, and the experts' width with the dense FFN's."""
    ours, theirs = _canonical(recipe), _canonical(source)
    if is_upcycling(recipe, source):
        expert = ours.get("moe.ffn_hidden")
        ours = {k: v for k, v in ours.items() if not k.startswith("moe.") and k != "ffn_hidden"}
        ours["moe.ffn_hidden"] = expert
        theirs = {k: v for k, v in theirs.items() if k != "ffn_hidden"} | {"moe.ffn_hidden": theirs.get("ffn_hidden")}
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        if key not in _FREE_KEYS and ours.get(key) != theirs.get(key):
            return key, ours.get(key), theirs.get(key)
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The tensors a model of ``cfg`` loads (tied output weights come from the embedding), by name."""
    from tessera.model import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items() if not k.endswith("features.projection")}
    if cfg.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def _listed(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_tensors(source: InitSource, recipe: ModelConfig) -> None:
    """Refuse a source whose tensors do not fit the recipe's model: missing, unexpected or of another shape."""
    want = expected_shapes(recipe)
    if isinstance(source.tensors, _Upcycled):  # the routers start as the recipe initializes them
        want = {k: v for k, v in want.items() if ".moe.router." not in k}
    have = set(source.tensors.names())
    missing = [k for k in want if k not in have]
    unexpected = sorted(have - set(want))
    where = f"{source.key}='{source.path}'"
    if missing:
        raise ConfigError(f"{where} lacks tensor(s) {_listed(missing)} of the recipe's model")
    if unexpected:
        raise ConfigError(f"{where} has tensor(s) {_listed(unexpected)} that the recipe's model has no place for")
    for name, shape in want.items():
        if source.tensors.shape(name) != shape:
            theirs = getattr(source.tensors, "source_name", lambda n: n)(name)
            label = f"'{theirs}'" + (f" (tessera '{name}')" if theirs != name else "")
            raise ConfigError(
                f"{where}: tensor {label} has shape {tuple(source.tensors.shape(name))} there but "
                f"{tuple(shape)} in the recipe's model"
            )


class _CheckpointTensors:
    """A tessera checkpoint read tensor by tensor (for upcycling's index arithmetic): each read loads the whole
    tensor on this rank alone (DCP, no collectives) and returns the block; one tensor is resident at a time."""

    def __init__(self, checkpoint: _Checkpoint) -> None:
        self.checkpoint, self._name, self._tensor = checkpoint, "", torch.empty(0)

    def names(self) -> list[str]:
        return self.checkpoint.names()

    def shape(self, name: str) -> torch.Size:
        return self.checkpoint.shape(name)

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        from tessera.train.checkpoint import load_tensors

        if name != self._name:
            tensors = {"model": {name: torch.empty(self.shape(name))}}
            load_tensors(self.checkpoint.path, tensors, no_dist=True)
            self._name, self._tensor = name, tensors["model"][name]
        return _InMemory({name: self._tensor}).read(name, offsets, shape)


def expert_noise(seed: int, name: str, expert: int, shape: tuple[int, int]) -> torch.Tensor:
    """The N(0, 1) draws of expert ``expert`` of stack ``name`` (the same whatever the layout reads of it)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{expert}".encode()))
    return torch.randn(shape, generator=generator)


class _Upcycled:
    """A dense source seen as an MoE model: every expert (and shared expert) of layer i is layer i's dense FFN;
    with ``noise`` > 0 each routed expert's copy is multiplied by ``1 + noise * N(0, 1)`` (its own draws, seeded
    by ``seed``, the layer and the expert) to break the experts' symmetry."""

    def __init__(self, dense: TensorSource, recipe: ModelConfig, noise: float = 0.0, seed: int = 0) -> None:
        from tessera.model.moe import is_moe_layer

        self.dense, self.map, self.noise, self.seed = dense, {}, noise, seed
        names = set(dense.names())
        for i in range(recipe.n_layers):
            if not is_moe_layer(recipe, i):
                continue
            for proj in ("gate_proj", "up_proj", "down_proj"):
                ffn = f"layers.{i}.feed_forward.{proj}.weight"
                if ffn not in names:
                    continue
                names.discard(ffn)
                self.map[f"layers.{i}.moe.experts.{proj}"] = (ffn, recipe.moe.experts)
                if recipe.moe.shared_experts:
                    self.map[f"layers.{i}.moe.shared.{proj}.weight"] = (ffn, 0)
        self.plain = names

    def names(self) -> list[str]:
        return [*self.plain, *self.map]

    def shape(self, name: str) -> torch.Size:
        if name not in self.map:
            return self.dense.shape(name)
        ffn, experts = self.map[name]
        out, inp = self.dense.shape(ffn)
        return torch.Size((experts, inp, out)) if experts else torch.Size((out, inp))

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.map:
            return self.dense.read(name, offsets, shape)
        ffn, experts = self.map[name]
        if not experts:
            return self.dense.read(ffn, offsets, shape)
        block = self.dense.read(ffn, (offsets[2], offsets[1]), (shape[2], shape[1])).T  # (in, out) of every expert
        copies = block.unsqueeze(0).expand(shape[0], -1, -1).contiguous()
        if self.noise:
            full = tuple(self.shape(name)[1:])
            rows, cols = slice(offsets[1], offsets[1] + shape[1]), slice(offsets[2], offsets[2] + shape[2])
            for i in range(shape[0]):
                copies[i] *= 1 + self.noise * expert_noise(self.seed, name, offsets[0] + i, full)[rows, cols]
        return copies


def check_source(source: InitSource, recipe: ModelConfig, noise: float = 0.0, seed: int = 0) -> None:
    """The recipe's ``[model]`` must be the source's (one line: the first differing key), then its tensors must fit.
    A dense source into an MoE recipe is upcycled (``noise``, ``seed``: ``train.upcycle_noise``, ``train.seed``)."""
    if is_upcycling(recipe, source.cfg):
        if isinstance(source.tensors, _Checkpoint):  # upcycling's index arithmetic reads tensors by name
            source.tensors = _CheckpointTensors(source.tensors)
        source.tensors = _Upcycled(source.tensors, recipe, noise, seed)
        source.kind += f", upcycled into {recipe.moe.experts} experts" + (f" (noise {noise:g})" if noise else "")
    elif noise:
        raise ConfigError(
            f"train.upcycle_noise={noise:g} perturbs the experts of an upcycled model, but train.init_from="
            f"'{source.path}' is not a dense source for an MoE recipe; set train.upcycle_noise=0"
        )
    diff = first_difference(recipe, source.cfg)
    if diff is not None:
        key, ours, theirs = diff
        raise ConfigError(
            f"train.init_from='{source.path}' is a different model: model.{key} is {ours!r} in the recipe but "
            f"{theirs!r} in the source ({source.kind}); make [model] match (tessera convert hf-import SOURCE RUN "
            "writes a matching recipe)"
        )
    check_tensors(source, recipe)


def own_checkpoint(config: JobConfig) -> Path | None:
    """The run's newest checkpoint that it can resume (a ``convert hf-import`` step 0 holds weights only)."""
    from tessera.train.checkpoint import latest_checkpoint, read_meta

    newest = latest_checkpoint(config.train.run_dir)
    if newest is None or is_weights_only(read_meta(newest)):
        return None
    return newest


def is_weights_only(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's meta.json is an import without a schedule (``convert hf-import``): weights only."""
    return "imported_from" in meta and "scheduler" not in meta


def check_init_from(config: JobConfig) -> InitSource | None:
    """Before anything is built: the source opened and checked against the recipe (None without init_from,
    or when the run resumes its own checkpoints, which then win)."""
    t = config.train
    if not t.init_from:
        return None
    if t.resume == "none" and own_checkpoint(config) is not None:
        raise ConfigError(
            f"train.init_from='{t.init_from}' with train.resume=none, but train.run_dir '{t.run_dir}' already holds "
            "checkpoints; use a new train.run_dir, set train.overwrite=true to delete that run, or drop init_from to "
            "resume it"
        )
    if t.resume == "auto" and own_checkpoint(config) is not None and not t.overwrite:
        return None
    source = open_source(t.init_from, config.model)
    check_source(source, config.model, t.upcycle_noise, t.seed)
    check_tokenizer(source, config)
    return source


_TRAINED = ("default", "bpe")  # data.tokenizer values that train a new tokenizer on the corpus


def check_tokenizer(source: InitSource, config: JobConfig) -> None:
    """A source with its own tokenizer must train with it, and the tokenizer must fit the source's vocabulary."""
    from tessera.data.tokenizer import Tokenizer

    spec = config.data.tokenizer
    has_own = any((source.path / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
    if has_own and spec in _TRAINED:
        raise ConfigError(
            f"train.init_from='{source.path}' has its own tokenizer but data.tokenizer={spec!r} would train a new one "
            f"(its ids would mean other tokens); set data.tokenizer={str(source.path)!r}"
        )
    if spec in _TRAINED:
        return
    tokens = Tokenizer(Path(spec)).vocab_size
    vocab = source.cfg.vocab_size - config.model.sentinel_tokens
    if tokens > vocab:
        raise ConfigError(
            f"data.tokenizer='{spec}' has {tokens} tokens but train.init_from='{source.path}' embeds only {vocab}; "
            "its ids past that have no embedding: use the source's own tokenizer"
        )
