"""Import and export of HF transformers checkpoints (config.json + safetensors) for the zoo families.

``load_hf(dir)`` builds the tessera model of an HF model directory; ``save_hf(model, dir)`` writes
one that ``transformers.AutoModel*.from_pretrained`` loads. Conversion is exact or refused: an
option tessera cannot reproduce is an :class:`HFConversionError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from tessera.config import ConfigError, ModelConfig, model_config
from tessera.hf.families import FAMILIES, HFConversionError, Rule
from tessera.hf.families.common import SPLIT_LAST, join_last, split_last
from tessera.model.block import layer_kind
from tessera.model.ffn import ffn_hidden_size
from tessera.model.moe import is_moe_layer
from tessera.validate import validate_model

__all__ = ["FAMILIES", "HFConversionError", "detect_family", "is_hf_dir", "load_hf", "read_hf", "save_hf"]

# Keys that only shape training or the kernel's memory use, never the exported numbers.
_TRAINING_ONLY = (
    "dropout",
    "attention.dropout",
    "init_std",
    "objective",
    "mask_prob",
    "mean_span_length",
    "sentinel_tokens",
    "moe.aux_loss_coef",
    "moe.z_loss_coef",
    "moe.aux_loss_scope",
    "moe.bias_update_rate",
    "multiple_of",
    "ffn_multiplier",
)


def is_hf_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like an HF model directory (config.json with a model_type)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "model_type" in data


def _read_tensors(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``path``; with ``meta``, meta tensors of the headers' shapes and
    dtypes (nothing is read or allocated)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = ", ".join(p.name for p in path.iterdir()) or "nothing"
        raise HFConversionError(
            f"'{path}' has no *.safetensors weights (found: {found}); tessera reads safetensors only"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = _meta_tensor(f.get_slice(key)) if meta else f.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise HFConversionError(
                f"'{file}' is not a readable safetensors file ({str(err).splitlines()[0]}); download it again"
            ) from None
    return tensors


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _meta_tensor(view: Any) -> torch.Tensor:
    return torch.empty(view.get_shape(), dtype=_SAFETENSORS_DTYPES.get(view.get_dtype(), torch.float32), device="meta")


def check_hf_shapes(hf_config: dict[str, Any], path: Path) -> None:
    """Refuse an HF directory whose config.json and weights disagree (a vocab_size or hidden size the files do
    not have, sizes beyond any memory), from the safetensors headers and a model on the meta device: nothing
    is allocated."""
    from tessera.model import build_model

    cfg, state, _ = state_from_hf(dict(hf_config), _read_tensors(path, meta=True), path / "config.json")
    with torch.device("meta"):
        expected = build_model(cfg).state_dict()
    for key, tensor in state.items():
        if key in expected and expected[key].shape != tensor.shape:
            raise HFConversionError(
                f"'{path / 'config.json'}' does not match its weights: the config makes '{key}' "
                f"{tuple(expected[key].shape)} but the safetensors files hold {tuple(tensor.shape)} "
                "(vocab_size, hidden_size, heads?); fix config.json or download the model again"
            )


def config_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, str]:
    """The tessera ModelConfig of an HF config.json dict, and the family name."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFConversionError(f"HF model_type {family!r} is not supported; supported families: {', '.join(FAMILIES)}")
    cfg = model_config(**FAMILIES[family].from_hf(hf))
    try:
        validate_model(cfg)
    except ConfigError as err:
        raise HFConversionError(f"the {family} config maps to an invalid tessera config: {err}") from None
    return cfg, family


def _from_hf_tensors(rules: list[Rule], hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        missing = [k for k in rule.theirs if k not in hf]
        if missing:
            raise HFConversionError(f"the HF checkpoint lacks weight '{missing[0]}'")
        theirs = [hf[k] for k in rule.theirs]
        if rule.kind == "copy":
            out[rule.ours[0]] = theirs[0]
        elif rule.kind == "t":
            out[rule.ours[0]] = theirs[0].T.contiguous()
        elif rule.kind == "experts":
            out[rule.ours[0]] = torch.stack([w.T for w in theirs])
        elif rule.kind in SPLIT_LAST:
            for i, name in enumerate(rule.ours):
                out[name] = split_last(theirs[0], i, len(rule.ours), rule.kind).contiguous()
        else:
            fused = theirs[0].T if rule.kind == "fused_t" else theirs[0]
            for name, part in zip(rule.ours, fused.chunk(len(rule.ours), dim=0)):
                out[name] = part.contiguous()
    return out


def _to_hf_tensors(rules: list[Rule], ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        tensors = [ours[k].detach() for k in rule.ours]
        if rule.kind == "copy":
            out[rule.theirs[0]] = tensors[0]
        elif rule.kind == "t":
            out[rule.theirs[0]] = tensors[0].T
        elif rule.kind == "experts":
            out.update({name: w.T for name, w in zip(rule.theirs, tensors[0])})
        elif rule.kind in SPLIT_LAST:
            out[rule.theirs[0]] = join_last(tensors, rule.kind)
        else:
            fused = torch.cat(tensors, dim=0)
            out[rule.theirs[0]] = fused.T if rule.kind == "fused_t" else fused
    return {k: v.contiguous().clone() for k, v in out.items()}


_OUTPUT_KEYS = ("lm_head.weight", "cls.predictions.decoder.weight")


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The config.json of ``folder`` as a dict, or one HFConversionError naming it (not UTF-8, not JSON, no object)."""
    file = Path(folder) / "config.json"
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFConversionError(f"'{file}' is not a JSON text ({str(err)[:120]}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise HFConversionError(f"'{file}' must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(ModelConfig, tessera state dict, family) of an HF model directory."""
    path = Path(path)
    if not is_hf_dir(path):
        raise HFConversionError(f"'{path}' is not an HF model directory (no config.json with a model_type)")
    hf_config = read_hf_config(path)
    check_hf_shapes(hf_config, path)
    return state_from_hf(hf_config, _read_tensors(path), path / "config.json")


def state_from_hf(
    hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], source: str | Path = "config.json"
) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """(ModelConfig, tessera state dict, family) of HF-named tensors and their config.json as a dict.

    The mapping only moves, transposes, splits and stacks tensors, so it also maps tensors laid
    out like the weights (e.g. Adam moments).
    """
    if hf_config.get("model_type") == "t5":
        head = tensors.get("lm_head.weight")
        same = head is None or (not head.is_meta and torch.equal(head, tensors["shared.weight"]))
        hf_config["tie_word_embeddings"] = same
    try:
        cfg, family = config_from_hf(hf_config)
    except KeyError as err:
        raise HFConversionError(
            f"'{source}' lacks the key {err} that a {hf_config.get('model_type')} config needs; fix or re-download it"
        ) from None
    spec = FAMILIES[family]
    if family == "gpt2" and "wte.weight" in tensors:  # original OpenAI-format files lack the prefix
        tensors = {f"transformer.{k}": v for k, v in tensors.items()}
    if spec.prepare is not None:
        spec.prepare(hf_config, cfg, tensors)
    rules = spec.rules(cfg, family)
    used = {k for r in rules for k in r.theirs}
    ignored = spec.ignored + (_OUTPUT_KEYS if cfg.tie_embeddings else ())
    unexpected = [k for k in tensors if k not in used and not any(s in k for s in ignored)]
    if unexpected:
        raise HFConversionError(
            f"the {family} checkpoint has weight '{unexpected[0]}' that tessera has no place for (an unsupported "
            "option?)"
        )
    state = _from_hf_tensors(rules, {k: v.float() for k, v in tensors.items()})
    return cfg, state, family


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a converted state dict strictly (tied output weights come from the embedding)."""
    cfg = model.cfg
    if cfg.tie_embeddings:
        state = {**state, "output.weight": state["tok_embeddings.weight"]}
    extra = {k: v for k, v in model.state_dict().items() if k not in state and k.endswith("features.projection")}
    model.load_state_dict({**state, **extra}, strict=True)


def load_hf(path: str | Path) -> nn.Module:
    """The tessera model of an HF model directory, in eval mode on CPU (fp32)."""
    from tessera.model import build_model

    cfg, state, _ = read_hf(path)
    model = build_model(cfg)
    load_state(model, state)
    return model.eval()


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _canonical(cfg: ModelConfig) -> dict[str, Any]:
    """The config's fields that decide the numbers (dotted names), derived sizes resolved, irrelevant keys dropped."""
    values = _flat(dataclasses.asdict(cfg))
    values["ffn_hidden"] = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
    values["n_kv_heads"] = cfg.n_kv_heads or cfg.n_heads
    values["head_dim"] = cfg.head_dim or cfg.dim // cfg.n_heads
    values["n_decoder_layers"] = (cfg.n_decoder_layers or cfg.n_layers) if cfg.arch == "encoder_decoder" else 0
    values["attention.kernel"] = "sdpa" if cfg.attention.kernel == "eager" else cfg.attention.kernel
    values["attention.o_bias"] = cfg.bias or cfg.attention.o_bias  # where a bias is, not which switch put it there
    values["ffn_bias"] = cfg.bias or cfg.ffn_bias
    kinds = "".join(layer_kind(cfg, i) for i in range(cfg.n_layers))
    values["layer_pattern"] = kinds
    values.update(_resolved_rope(cfg))
    values["moe.ffn_hidden"] = cfg.moe.ffn_hidden or values["ffn_hidden"]
    values["mla.norm_eps"] = cfg.mla.norm_eps or cfg.norm_eps
    if "moe.shared_ffn_hidden" in values:  # issue 13's key: 0 means shared_experts x the expert width
        shared = values["moe.shared_ffn_hidden"] or values["moe.ffn_hidden"] * cfg.moe.shared_experts
        values["moe.shared_ffn_hidden"] = shared
    if set(kinds) & {"M", "m"} and not cfg.mamba.dt_rank:
        values["mamba.dt_rank"] = math.ceil(cfg.dim / 16)
    drop = set(_TRAINING_ONLY) | {"bias", "mamba.chunk", "gdn.chunk", "kda.chunk"} | _unused(cfg, kinds)
    drop |= {f"attention.{k}" for k in ("block_size", "random_blocks", "performer_features", "global_tokens")}
    prefixes = tuple(k for k in drop if k.endswith("."))
    return {k: v for k, v in values.items() if k not in drop and not k.startswith(prefixes)}


def _unused(cfg: ModelConfig, kinds: str) -> set[str]:
    """Dotted keys (or prefixes ending in '.') that cannot change this model's numbers."""
    drop: set[str] = set()
    pos = cfg.position
    if pos.kind != "rope":
        drop |= {f"position.rope_{k}" for k in ("theta", "scaling", "scaling_factor", "original_max_len")}
        drop |= {"position.rotary_fraction", "position.rope_attention_factor", "position.rope_yarn_truncate"}
    if pos.rope_scaling != "llama3":
        drop |= {"position.rope_low_freq_factor", "position.rope_high_freq_factor"}
    if pos.rope_scaling != "yarn":
        drop |= {"position.rope_attention_factor", "position.rope_yarn_truncate"}
    if pos.rope_scaling == "none":
        drop.add("mla.mscale")
    if pos.rope_scaling not in ("yarn", "llama3"):
        drop.add("position.rope_original_max_len")
    if pos.kind != "t5_bias":
        drop |= {"position.rel_buckets", "position.rel_max_distance"}
    if not set(kinds) - {"M", "m", "D", "K"}:  # no attention layer at all
        drop |= {"n_heads", "n_kv_heads", "head_dim", "attention.", "position.", "mla."}
    if not set(kinds) & {"M", "m"}:
        drop.add("mamba.")
    if "D" not in kinds:
        drop.add("gdn.")
    if "K" not in kinds:
        drop.add("kda.")
    mamba2_only = {"mamba.head_dim", "mamba.groups", "mamba.dt_min"}
    drop |= mamba2_only if cfg.mamba.version == 1 else {"mamba.dt_rank", "mamba.dt_norm"}
    if not cfg.mla.kv_rank:
        drop.add("mla.")
    drop |= {"dsa."} if not cfg.dsa.topk else {"dsa.indexer_loss_coef"}
    if not cfg.moe.experts:
        drop.add("moe.")
    if not cfg.attention.qk_norm:
        drop.add("attention.qk_norm_scope")
    has_ffn = [k not in "Mm" or (k == "M" and cfg.mamba.ffn) for k in kinds]
    if not any(f and not is_moe_layer(cfg, i) for i, f in enumerate(has_ffn)):
        drop.add("ffn_hidden")  # no dense FFN anywhere
    if not any(has_ffn):  # no FFN either
        drop |= {"ffn_hidden", "activation", "ffn_bias", "moe.", "mamba.ffn"}
    return drop


def _resolved_rope(cfg: ModelConfig) -> dict[str, Any]:
    pos = cfg.position
    if pos.rope_scaling in ("yarn", "llama3") and not pos.rope_original_max_len:
        return {"position.rope_original_max_len": int(cfg.max_seq_len / pos.rope_scaling_factor)}
    return {}


def detect_family(cfg: ModelConfig) -> str:
    """The HF family a tessera config exports to (checked exactly by :func:`export_config`)."""
    kinds = {layer_kind(cfg, i) for i in range(cfg.n_layers)}
    if cfg.arch == "encoder":
        return "bert"
    if cfg.arch == "encoder_decoder":
        return "t5"
    if "H" in kinds:
        return "falcon_h1"
    if "D" in kinds:
        return "qwen3_next"
    if "K" in kinds:
        return "kimi_linear"
    if "m" in kinds or "M" in kinds and cfg.activation == "relu2":
        return "nemotron_h"
    if "M" in kinds:
        return "jamba" if kinds != {"M"} or cfg.mamba.ffn else "mamba2" if cfg.mamba.version == 2 else "mamba"
    if cfg.mla.kv_rank:
        return "deepseek_v32" if cfg.dsa.topk else "deepseek_v3"
    if cfg.attention.sinks:
        return "gpt_oss"
    layered = {"sandwich": "gemma3_text", "reordered": "olmo3"}.get(cfg.norm_position)
    if layered and not cfg.moe.experts:
        return layered
    if cfg.moe.scale_input or cfg.attention.chunk_size or cfg.attention.qk_l2_norm:
        return "llama4_text"
    if cfg.position.nope_layers:
        return "smollm3"
    if cfg.moe.experts:
        return _moe_family(cfg)
    if cfg.position.kind == "learned":
        return "gpt2"
    if "G" in kinds or cfg.attention.qkv_bias and not (cfg.attention.o_bias or cfg.ffn_bias):
        return "qwen2"
    if cfg.attention.qkv_bias or cfg.attention.o_bias or cfg.ffn_bias:
        return "llama"
    return "mistral" if cfg.attention.sliding_window else "llama"


def _moe_family(cfg: ModelConfig) -> str:
    a, moe = cfg.attention, cfg.moe
    if a.qk_norm and a.qk_norm_scope == "all":
        return "olmoe"
    if getattr(moe, "shared_gate", False):
        return "qwen2_moe"
    if a.qk_norm or moe.router == "softmax_topk" or moe.every != 1 or getattr(moe, "first_dense", 0):
        return "qwen3_moe"
    return "mixtral"


def export_config(cfg: ModelConfig, family: str | None = None) -> tuple[dict[str, Any], str]:
    """The HF config.json dict of ``cfg`` (family auto-detected unless given); refuses inexact exports."""
    family = family or detect_family(cfg)
    if family not in FAMILIES:
        raise HFConversionError(f"unknown HF family {family!r}; supported: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    if cfg.attention.heads_per_layer:
        raise HFConversionError(
            f"model.attention.heads_per_layer={cfg.attention.heads_per_layer!r} (a head count per layer) cannot be "
            f"expressed in an HF {family} checkpoint, whose config has one head count for all layers"
        )
    hf = {"architectures": [spec.architecture], "model_type": family, "dtype": "float32", **spec.to_hf(cfg)}
    back, _ = config_from_hf(json.loads(json.dumps(hf)))
    ours, theirs = _canonical(cfg), _canonical(back)
    for key, value in ours.items():
        if theirs.get(key) != value:
            raise HFConversionError(
                f"model.{key}={value!r} cannot be expressed in an HF {family} checkpoint (it would be "
                f"{theirs.get(key)!r})"
            )
    return hf, family


def save_hf(model: nn.Module, path: str | Path, family: str | None = None) -> str:
    """Write ``model`` as an HF checkpoint (config.json + model.safetensors); returns the family."""
    cfg: ModelConfig = model.cfg
    hf_config, family = export_config(cfg, family)
    state = {k: v.float() for k, v in model.state_dict().items()}
    tensors = _to_hf_tensors(FAMILIES[family].rules(cfg, family), state)
    if FAMILIES[family].finish is not None:
        FAMILIES[family].finish(cfg, tensors)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return family
