"""The component registry: each component declares one spec next to its code, and compat, validation,
the planner and the model's dispatch read the specs instead of listing names.

A leaf: imports nothing of tessera (a spec holds plain callables, so the module that owns the code
registers it and everyone else only looks it up).

Kinds (``Spec.kind``) and what reads them:

- ``"attention_kernel"`` (:class:`KernelSpec`): selected by ``model.attention.kernel``; ``Attention.attend``
  calls ``spec.attend``. Files: ``tessera/model/kernels/<name>.py``, listed in ``tessera/model/kernels/__init__.py``.
- ``"mixer"`` (:class:`MixerSpec`): the token mixer of a block, selected by its ``model.layer_pattern``
  letter (and ``selects``); ``TransformerBlock`` builds, calls and caches it through the spec.
  Listed in ``tessera/model/components.py``.
- ``"ffn"``, ``"position"``, ``"option"`` (:class:`Spec`): FFN/MoE, position schemes and model options
  (QK-norm scope, MTP, architectures). Listed in ``tessera/model/components.py``.
- ``"layout"`` (:class:`LayoutSpec`): a parallel dimension or engine, a column of the compatibility table;
  ``unsupported`` names the other layouts it does not combine with. ``"feature"``: a job-level feature
  (precision, checkpointing, compile, distillation). Both in ``tessera/features.py``.

Adding a component (see docs/ARCHITECTURE.md, "Adding a component")::

    from tessera.registry import KernelSpec, Terms, register, uses_kernel

    SPEC = register(KernelSpec(
        name="local",                                  # the config value that selects it
        feature="local attention kernel",             # its row in the compatibility table (specs may share one)
        keys=("model.attention.kernel", "model.attention.block_size"),   # the config keys it reads
        uses=uses_kernel("local"),                     # does a ModelConfig (scope="model") / JobConfig use it
        unsupported={"cp": "why, and what to use instead"},   # layout -> reason; {} = every layout works
        checks=(check_local,),                         # rules over the scope's config (raise ConfigError); ()
        terms=Terms(flops=..., memory=...),            # the planner's terms (see Terms)
        tp_plan=ATTENTION_TP,                          # submodule -> "colwise" | "rowwise"; None: no TP plan
        attend=local_attend,                           # kind-specific fields (KernelSpec, MixerSpec)
    ))

``register`` returns the spec and refuses a second spec of the same kind and name (``option(**fields)``
registers a ``Spec(kind="option")``); ``get(kind, name)``
raises ``KeyError`` naming the registered ones; ``names(kind)`` and ``specs(kind)`` list them in
registration order; ``used(job, kind)`` lists the specs a JobConfig turns on, ``used_by_model(m, kind)``
the model-scoped ones a ModelConfig turns on (``model/rules.py`` runs their ``checks``);
``declaration_problems(spec, layouts)`` says what a spec fails to declare (tests/unit/test_registry.py).
:data:`REGISTRY` is the live table (kind -> name -> spec); tests replace an entry with
``monkeypatch.setitem(REGISTRY[kind], name, dataclasses.replace(spec, ...))``.

Who reads what: ``Attention.attend`` -> ``KernelSpec.attend`` (looked up per call by the layer's
``kernel``); ``TransformerBlock`` -> ``MixerSpec`` (``model/mixers.mixer_for``); ``compat`` -> every
spec's ``feature``/``unsupported``/``uses`` and the layouts; ``plan/activations`` -> kernel, mixer and
FFN ``terms.memory``; ``plan/speed`` -> mixer ``terms.flops``; ``parallel/tensor`` ->
``tp_plan``; ``python -m tessera.refdoc`` -> docs/reference/components.md and the compatibility tables.
The API only grows: fields are added with defaults, never renamed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

KINDS = ("attention_kernel", "mixer", "ffn", "position", "option", "layout", "feature")
MODEL_KINDS = ("attention_kernel", "mixer", "ffn", "position")  # per-layer components: planner terms required

TRACED = "traced"  # Terms.memory of a mixer the planner measures on fake tensors (no short formula follows it)
ATTENTION_TP: Mapping[str, str] = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}


def zero(*_: Any) -> float:
    """A planner term that is zero by design (e.g. a position scheme adds no per-token FLOPs)."""
    return 0.0


@dataclass(frozen=True)
class Terms:
    """A component's planner terms, per token (kind-specific signatures, documented where they are read).

    - attention kernel: ``flops(cfg, seq_len)`` training FLOPs of the score and value products of one layer
      (train/flops.py); ``memory(cfg, heads, q_width, kept) -> (kept, scores_per_key)`` saved bytes, given the
      bytes a flash-style kernel keeps (plan/activations.py).
    - mixer: ``flops(cfg, seq_len)`` as above for one layer of this mixer; ``memory`` is :data:`TRACED` (the
      planner measures the module) or ``"kernel"`` (the attention formula with the kernel's term).
    - ffn: ``flops`` 0 (its matmuls are in 6 * N); ``memory(shape, block, prec) -> (gathered, sharded,
      op_gathered, op_sharded)`` saved bytes (plan/activations.py).
    - position: ``flops``/``memory`` per token (``zero`` when the scheme adds none).
    """

    flops: Callable[..., float]
    memory: Callable[..., Any] | str


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every component declares (see the module docstring)."""

    kind: str
    name: str
    feature: str  # the compatibility table's row; specs sharing a row must share ``unsupported``
    keys: tuple[str, ...] = ()
    uses: Callable[[Any], bool] = field(default=lambda _: False)
    scope: str = "model"  # what ``uses`` and ``checks`` receive: "model" (ModelConfig) or "job" (JobConfig)
    unsupported: Mapping[str, str] | None = None  # layout -> reason; None = not declared (a test refuses it)
    checks: tuple[Callable[[Any], None], ...] | None = None  # None = not declared; () = nothing to check
    terms: Terms | None = None
    tp_plan: Mapping[str, str] | None = None
    doc: str = ""


@dataclass(frozen=True, kw_only=True)
class KernelSpec(Spec):
    """An attention kernel: ``attend(layer, q, k, v, ctx, dropout) -> out`` with (B, H, Tq, D) queries and
    (B, H_kv, Tk, D) keys/values; ``scores``: it forms a score matrix (takes masks, score biases, windows
    and document masks); ``state(cfg, head_dim)``: a per-layer module it keeps (``layer.features``) or None;
    ``pattern``: its own sparsity pattern (a ``tessera.model.masks.Pattern``, which model/masks.py draws) or
    None; a kernel with one cannot serve layers that need plain (global) attention; ``dense_mask``: it reads
    the whole boolean (Tq, Tk) mask (its weights are what inspection tools observe), so the stack builds no
    block-sparse plan for it and context parallelism hands it the boolean mask, not sdpa's additive copy."""

    kind: str = "attention_kernel"
    attend: Callable[..., Any]
    scores: bool = True
    state: Callable[..., Any] | None = None
    pattern: Any = None
    dense_mask: bool = False


@dataclass(frozen=True, kw_only=True)
class MixerSpec(Spec):
    """A token mixer. ``letters``: the ``model.layer_pattern`` letters it serves (letter -> description);
    ``selects(cfg)``: among the mixers serving a letter, whether this one builds it; ``attr``: the block's
    attribute (``attention`` or ``mamba``: parameter names stay what checkpoints and HF maps read);
    ``build(cfg, layer_id) -> module``; ``forward(module, h, ctx, cache, start) -> out``;
    ``new_cache(module, batch, max_len, dtype, device)``; ``has_ffn(cfg)``: a FFN/MoE sublayer follows it;
    ``recurrent``: it carries a state along the sequence (Mamba), so speculative decoding cannot rewind it,
    packed-document masks cannot reset it and left padding would flow into it (those paths refuse it)."""

    kind: str = "mixer"
    letters: Mapping[str, str]
    selects: Callable[[Any], bool] = field(default=lambda _: True)
    attr: str = "attention"
    has_ffn: Callable[[Any], bool] = field(default=lambda _: True)
    recurrent: bool = False
    build: Callable[..., Any]
    forward: Callable[..., Any]
    new_cache: Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class LayoutSpec(Spec):
    """A parallel dimension or engine: a column of the compatibility table. ``unsupported`` maps the other
    layouts it cannot combine with to the reason; ``uses`` is unused (compat.job_layouts derives layouts)."""

    kind: str = "layout"
    scope: str = "job"


REGISTRY: dict[str, dict[str, Spec]] = {kind: {} for kind in KINDS}


def register(spec: Spec) -> Spec:
    """Add ``spec`` (a kind of :data:`KINDS`, a name not yet taken) and return it."""
    if spec.kind not in REGISTRY:
        raise ValueError(f"unknown component kind {spec.kind!r}; use one of {', '.join(KINDS)}")
    if spec.name in REGISTRY[spec.kind]:
        raise ValueError(f"a {spec.kind} named {spec.name!r} is already registered")
    REGISTRY[spec.kind][spec.name] = spec
    return spec


def option(**declared: Any) -> Spec:
    """Register a model or job option (``Spec(kind="option", **declared)``) and return its spec."""
    return register(Spec(kind="option", **declared))


def get(kind: str, name: str) -> Any:
    """The spec of ``kind`` named ``name``; KeyError naming the registered ones otherwise."""
    try:
        return REGISTRY[kind][name]
    except KeyError:
        names = ", ".join(REGISTRY.get(kind, {})) or "none"
        raise KeyError(f"no {kind} named {name!r} is registered (registered: {names})") from None


def names(kind: str) -> tuple[str, ...]:
    """The names of ``kind``'s specs, in registration order."""
    return tuple(REGISTRY[kind])


def specs(kind: str | None = None) -> list[Any]:
    """Every spec of ``kind`` (or of all kinds, kind by kind), in registration order."""
    kinds = KINDS if kind is None else (kind,)
    return [spec for k in kinds for spec in REGISTRY[k].values()]


def scoped(spec: Spec, job: Any) -> Any:
    """What ``spec.uses`` and ``spec.checks`` receive from a JobConfig: its model, or the job itself."""
    return job.model if spec.scope == "model" else job


def used(job: Any, kind: str | None = None) -> list[Any]:
    """The specs (of ``kind``, or all but layouts) that a JobConfig turns on."""
    pool = specs(kind) if kind is not None else [s for s in specs() if s.kind != "layout"]
    return [spec for spec in pool if spec.uses(scoped(spec, job))]


def used_by_model(m: Any, kind: str) -> list[Any]:
    """The specs of a model kind (``scope="model"``) that a ModelConfig turns on."""
    return [spec for spec in specs(kind) if spec.scope == "model" and spec.uses(m)]


def declaration_problems(spec: Spec, layouts: tuple[str, ...]) -> list[str]:
    """What ``spec`` fails to declare: its checks, its unsupported layouts (each a known layout, with a reason),
    planner terms for a per-layer component, and a TP plan or a "tp" refusal for kernels and mixers."""
    where = f"{spec.kind} {spec.name!r}"
    found = []
    if spec.checks is None:
        found.append(f"{where} declares no checks (use () when nothing needs checking)")
    if spec.unsupported is None:
        found.append(f"{where} declares no unsupported layouts (use {{}} when every layout works)")
    for layout, reason in (spec.unsupported or {}).items():
        if layout not in layouts or not reason.strip():
            found.append(f"{where}: unsupported layout {layout!r} is not a registered layout or has no reason")
    if spec.kind in MODEL_KINDS and (spec.terms is None or not callable(spec.terms.flops)):
        found.append(f"{where} declares no planner terms (Terms(flops=..., memory=...))")
    elif spec.kind in MODEL_KINDS and not (callable(spec.terms.memory) or spec.terms.memory in (TRACED, "kernel")):
        found.append(f"{where}: Terms.memory must be a callable, TRACED or 'kernel'")
    if spec.kind in ("attention_kernel", "mixer") and spec.tp_plan is None and "tp" not in (spec.unsupported or {}):
        found.append(f"{where} has no tp_plan and does not refuse 'tp'")
    return found


def recurrent_layers(layers: Any) -> str:
    """The table row (``feature``) of the first recurrent mixer among ``layers`` (TransformerBlocks), or ""."""
    return next((layer.mixer_spec.feature for layer in layers if layer.mixer_spec.recurrent), "")


def uses_kernel(name: str) -> Callable[[Any], bool]:
    """``uses`` of a kernel: the model's ``model.attention.kernel`` is ``name``."""
    return lambda m: m.attention.kernel == name


Check = Callable[[Any], None]


def register_options(options: dict[str, tuple], unsupported: dict[str, dict[str, str]] | None = None) -> None:
    """Register model options: name -> (feature, dotted key, check[, uses]); without ``uses`` an option is on
    when its key is set (nonzero, nonempty). ``unsupported``: name -> {layout: reason}."""
    for name, (feature, key, check, *uses) in options.items():
        read = operator.attrgetter(key.removeprefix("model."))
        used = uses[0] if uses else (lambda m, read=read: bool(read(m)))
        spec = Spec(
            kind="option",
            name=name,
            feature=feature,
            keys=(key,),
            uses=used,
            checks=(check,),
            unsupported=(unsupported or {}).get(name, {}),
        )
        register(spec)
