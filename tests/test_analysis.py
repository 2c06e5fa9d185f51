"""Looking inside a model (issue 20): exact attention capture for every kernel, head importance, pruning
to per-layer head counts, MHA -> GQA pooling, and the CLI commands end to end on a trained tiny run."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.analysis.capture import attention_layers, observe_attention
from tessera.analysis.gqa import pool_kv_heads
from tessera.analysis.importance import head_importance
from tessera.analysis.inspect import Recording, record_decoder
from tessera.analysis.prune import plan_global, prune_heads, prune_model
from tessera.analysis.runs import count_kv_bytes, validation_loss
from tessera.config import ConfigError, model_config
from tessera.validate import load_config, validate_model
from tessera.model import build_model
from tessera.hf.weights import HFConversionError, save_hf
from tessera.model.mla import LatentAttention

V = 64


def _model(seed: int = 0, **keys) -> torch.nn.Module:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    return build_model(model_config(**{**base, **keys})).eval()


def _call(model, x):
    return model(x, x[:, :5]) if model.cfg.arch == "encoder_decoder" else model(x)


def _attention_io(model, x) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each attention module's values (B, H, Tk, d) and attention output (B, H, Tq, d), from a normal forward
    with the model's own kernel."""
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        seen.setdefault(name, []).append(tensor)

    hooks = []
    for name, m in attention_layers(model):
        values = m.kv_b_proj if isinstance(m, LatentAttention) else m.v_proj
        hooks.append(values.register_forward_hook(lambda mod, i, o, n=name: keep(n, o)))
        hooks.append(m.o_proj.register_forward_pre_hook(lambda mod, i, n=name: keep(n, i[0])))
    with torch.no_grad():
        _call(model, x)
    for h in hooks:
        h.remove()
    out = {}
    for name, m in attention_layers(model):
        v, o = seen[name]
        b = v.shape[0]
        if isinstance(m, LatentAttention):
            v = v.view(b, v.shape[1], m.n_heads, -1)[..., m.nope :]
        else:
            v = v.view(b, v.shape[1], -1, m.head_dim)
        v = v.transpose(1, 2)
        heads = o.view(b, o.shape[1], -1, v.shape[-1]).transpose(1, 2)
        out[name] = (v.repeat_interleave(heads.shape[1] // v.shape[1], dim=1), heads)
    return out


KERNELS = [
    dict(attention={"kernel": "sdpa"}, n_kv_heads=2),
    dict(attention={"kernel": "eager", "qk_norm": True}),
    dict(attention={"kernel": "sdpa", "sliding_window": 4}),
    dict(attention={"kernel": "longformer", "sliding_window": 3, "global_tokens": 2}),
    dict(attention={"kernel": "bigbird", "block_size": 4, "global_tokens": 4, "random_blocks": 1}),
    dict(attention={"kernel": "linear"}, n_kv_heads=2),
    dict(attention={"kernel": "performer", "performer_features": 16}),
    dict(position={"kind": "alibi"}),
    dict(arch="encoder", norm_position="post", position={"kind": "learned"}, sentinel_tokens=1),
    dict(arch="encoder", attention={"kernel": "linear"}, position={"kind": "sinusoidal"}, sentinel_tokens=1),
    dict(arch="encoder_decoder", position={"kind": "t5_bias"}, attention={"scale": 1.0}),
    dict(n_layers=2, mla={"kv_rank": 16, "rope_head_dim": 4, "nope_head_dim": 8, "v_head_dim": 8}),
]


@pytest.mark.parametrize("keys", KERNELS, ids=lambda k: json.dumps(k, sort_keys=True))
def test_captured_weights_are_exactly_what_the_training_kernel_applies(keys):
    """weights @ V from the capture pass reproduces every module's attention output of a normal forward with
    the model's own kernel (sdpa, masks, score biases, linear kernels, cross and latent attention), and the
    model keeps nothing afterwards."""
    model = _model(**keys)
    x = torch.randint(4, V, (2, 12))
    io = _attention_io(model, x)
    kernels = {name: getattr(m, "kernel", None) for name, m in attention_layers(model)}
    captured: dict[str, torch.Tensor] = {}
    with torch.no_grad(), observe_attention(model, lambda name, w: captured.update({name: w})):
        _call(model, x)
    assert captured.keys() == io.keys() and captured
    for name, (v, out) in io.items():
        weights = captured[name]
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5)
        torch.testing.assert_close(weights @ v.float(), out.float(), atol=2e-5, rtol=1e-4, msg=name)
    for name, m in attention_layers(model):
        assert m.weights_observer is None and getattr(m, "kernel", None) == kernels[name]


def test_generation_steps_record_the_rows_of_a_full_forward():
    """--generate: the maps of cached decoding steps, stacked under the prompt's, equal one forward's maps."""
    model = _model(n_kv_heads=2)
    recording = Recording()
    prompt = [2, 17, 5, 9]
    generated = record_decoder(model, prompt, 5, recording)
    full: dict[str, torch.Tensor] = {}
    with torch.no_grad(), observe_attention(model, lambda name, w: full.update({name: w[0]})):
        model(torch.tensor([prompt + generated]))
    maps = recording.maps()
    for name, m in full.items():
        assert maps[name].shape == (4, 9, 9)
        torch.testing.assert_close(maps[name], m, atol=1e-6, rtol=1e-5)


def _letters_codec():
    from tessera.analysis.text import Codec

    return Codec(lambda t: [4 + ord(c) % (V - 4) for c in t], lambda i: f"t{i}", lambda ids: "".join(map(str, ids)), 1)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_inspect_records_and_draws_encoders_and_cross_attention(arch, tmp_path):
    """Encoder and encoder-decoder maps have the right axes (cross: decoder steps x source tokens), sum to 1 per
    row, and a text longer than --window is drawn in windows (a causal map's empty upper windows skipped)."""
    from tessera.analysis.inspect import draw_module, record

    model = _model(arch=arch, sentinel_tokens=1)
    maps, tokens = record(model, _letters_codec(), "abcdefghij", 3 if arch == "encoder_decoder" else 0)
    names = [n for n, _ in attention_layers(model)]
    assert sorted(maps) == sorted(names) and len(tokens.source) == 10
    for name, m in maps.items():
        rows = 3 if name.startswith("decoder.") else 10
        assert m.shape[1:] == (rows, 10 if name.endswith("cross_attention") else rows), name
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    files = draw_module(names[0], maps[names[0]], [0, 1], tokens, tmp_path, window=4)
    assert len(files) == 9 and all(f.stat().st_size > 1000 for f in files)  # 10 tokens, windows of 4: 3 x 3
    if arch == "encoder_decoder":  # the decoder's causal self-attention: the upper windows hold no weight
        dec = next(n for n in names if n.startswith("decoder.") and not n.endswith("cross_attention"))
        steps = maps[dec].shape[1]
        assert steps == 3 and len(draw_module(dec, maps[dec], [0], tokens, tmp_path / "w", window=2)) == 3


def _batches(seed: int = 0, n: int = 2, length: int = 12) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(4, V, (4, length + 1), generator=g)
        out.append(((tokens[:, :-1],), {}, tokens[:, 1:], None))
    return out


def _zero_heads(model, heads: dict[int, list[int]]) -> None:
    with torch.no_grad():
        for i, hs in heads.items():
            attn = model.layers[str(i)].attention
            for h in hs:
                attn.o_proj.weight[:, h * attn.head_dim : (h + 1) * attn.head_dim] = 0


@pytest.mark.parametrize(
    "keys, zeroed, keep, per_layer",
    [
        (dict(), {0: [1, 3], 1: [0]}, {0: [0, 2], 1: [1, 2, 3]}, "2,3"),  # multi-head: a group is one head
        (dict(n_kv_heads=2), {0: [2, 3]}, {0: [0]}, "2,4"),  # GQA: heads 2-3 share KV head 1
        (dict(arch="encoder", sentinel_tokens=1, position={"kind": "learned"}), {1: [1]}, {1: [0, 2, 3]}, "4,3"),
        (
            dict(n_kv_heads=2, bias=True, attention={"qkv_bias": True, "qk_norm": True}),
            {0: [0, 1], 1: [2, 3]},
            {0: [1], 1: [0]},
            "",  # the same count everywhere: a plain config
        ),
    ],
)
def test_pruning_heads_with_zero_output_projection_keeps_the_loss(keys, zeroed, keep, per_layer):
    model = _model(**keys)
    _zero_heads(model, zeroed)
    batches = _batches()
    pruned = prune_model(model, keep)
    assert validation_loss(pruned, batches) == pytest.approx(validation_loss(model, batches), abs=1e-6)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())
    grads = head_importance(model, batches, "gradient")
    for i, heads in zeroed.items():
        assert grads[i][heads].abs().max().item() == 0.0  # Michel et al.: a head with no output has no importance
    assert pruned.cfg.attention.heads_per_layer == per_layer


def _copy_first_token_model() -> torch.nn.Module:
    """One layer, four heads; the label at every position is the sequence's first token. Head 0 attends to it
    (constant query, key = "is a content token") and writes its identity where the head reads it; heads 1-3
    have zero queries (uniform attention) and weak random values."""
    model = _model(n_layers=1, head_dim=8, vocab_size=16, position={"kind": "none"}, tie_embeddings=False)
    a = model.layers["0"].attention
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.zero_()
        emb = model.tok_embeddings.weight
        emb[:, 0] = 1.0
        emb[4:12, 1] = 1.0
        emb[torch.arange(16), 8 + torch.arange(16)] = 1.0
        a.q_proj.weight[0, 0], a.k_proj.weight[0, 1] = 3.0, 3.0
        a.v_proj.weight[torch.arange(8), 12 + torch.arange(8)] = 1.0
        a.o_proj.weight[24 + torch.arange(8), torch.arange(8)] = 1.0
        a.k_proj.weight[8:] = torch.randn(24, 32, generator=g)
        a.v_proj.weight[8:] = 0.1 * torch.randn(24, 32, generator=g)
        a.o_proj.weight[:, 8:] = 0.1 * torch.randn(32, 24, generator=g)
        model.output.weight[4 + torch.arange(8), 24 + torch.arange(8)] = 0.7
    return model


def test_the_head_that_matters_is_ranked_last_by_both_metrics():
    model = _copy_first_token_model()
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):
        first = torch.randint(4, 12, (8, 1), generator=g)
        batches.append(((torch.cat([first, torch.ones(8, 11, dtype=torch.long)], 1),), {}, first.expand(8, 12), None))
    loss = validation_loss(model, batches)
    without = [validation_loss(prune_model(model, {0: [j for j in range(4) if j != h]}), batches) for h in range(4)]
    assert without[0] > loss + 1.0 and max(without[1:]) < loss + 0.05  # head 0 is the one that matters
    for metric in ("entropy", "gradient"):
        scores = head_importance(model, batches, metric)[0]
        assert scores[0] > scores[1:].max(), (metric, scores)
        assert plan_global({0: scores}, 0.75, normalize=metric == "gradient") == {0: [1, 2, 3]}


def test_per_layer_head_counts_config_tp_and_hf_export(tmp_path):
    keys = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    validate_model(model_config(**keys, attention={"heads_per_layer": "4,2"}))
    for bad, words in [("4,3", "multiple of the GQA group size"), ("4", "2 comma-separated"), ("4,x", "comma")]:
        with pytest.raises(ConfigError, match=words):
            validate_model(model_config(**keys, attention={"heads_per_layer": bad}))
    with pytest.raises(ConfigError, match="position.kind='alibi'"):
        validate_model(model_config(**keys, attention={"heads_per_layer": "4,2"}, position={"kind": "alibi"}))
    with pytest.raises(ConfigError, match="layer 1 .* not divisible by parallel.tp=2"):
        load_config(None, ["model.n_layers=2", "model.n_kv_heads=2", "model.attention.heads_per_layer=4,2",
                           "parallel.tp=2", "parallel.dp_shard=1"])  # fmt: skip
    model = _model(n_kv_heads=2, attention={"heads_per_layer": "4,2"})
    assert [a.n_heads for _, a in attention_layers(model)] == [4, 2]
    assert [a.n_kv_heads for _, a in attention_layers(model)] == [2, 1]
    assert count_kv_bytes(model) == 2 * (2 + 1) * 8 * 4  # K and V, 3 KV heads of 8 channels, fp32
    with pytest.raises(HFConversionError, match="heads_per_layer='4,2'.*one head count for all layers"):
        save_hf(model, tmp_path / "hf")


def test_uniformly_pruned_model_exports_to_hf_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model(n_kv_heads=2)
    pruned = prune_model(model, {0: [1], 1: [0]})
    assert (pruned.cfg.n_heads, pruned.cfg.n_kv_heads, pruned.cfg.head_dim) == (2, 1, 8)
    assert pruned.cfg.attention.heads_per_layer == ""
    assert save_hf(pruned, tmp_path / "hf") == "llama"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert (hf(x).logits - pruned(x)).abs().max().item() < 1e-4


def test_kv_pooling_is_the_group_mean_and_exact_for_identical_heads():
    model = _model(n_kv_heads=4)
    with torch.no_grad():  # make KV heads 0 and 1 (and 2 and 3) identical in layer 0
        for proj in ("k_proj", "v_proj"):
            w = getattr(model.layers["0"].attention, proj).weight.view(4, 8, 32)
            w[1], w[3] = w[0], w[2]
    x = torch.randint(0, V, (2, 10))
    pooled = pool_kv_heads(model, 2)
    assert pooled.cfg.n_kv_heads == 2 and count_kv_bytes(pooled) * 2 == count_kv_bytes(model)
    with torch.no_grad():
        for proj in ("k_proj", "v_proj"):
            old = getattr(model.layers["1"].attention, proj).weight.view(2, 2, 8, 32)
            new = getattr(pooled.layers["1"].attention, proj).weight.view(2, 8, 32)
            torch.testing.assert_close(new, old.mean(1))
        # Layer 0's pooled heads were identical: its output is unchanged (layer 1's is an approximation).
        torch.testing.assert_close(_layer_out(pooled, x, 0), _layer_out(model, x, 0), atol=1e-6, rtol=1e-6)
        assert (_layer_out(pooled, x, 1) - _layer_out(model, x, 1)).abs().max().item() > 1e-4
    with pytest.raises(ConfigError, match="--kv-heads 3 must divide"):
        pool_kv_heads(model, 3)


def test_kv_pooling_of_an_encoder_decoder_pools_self_and_cross_attention():
    model = _model(arch="encoder_decoder", n_kv_heads=4, position={"kind": "t5_bias"})
    pooled = pool_kv_heads(model, 1)
    names = [n for n, _ in attention_layers(model)]
    assert any(n.endswith("cross_attention") for n in names)
    for (name, old), (_, new) in zip(attention_layers(model), attention_layers(pooled)):
        assert new.n_kv_heads == 1, name
        torch.testing.assert_close(new.v_proj.weight, old.v_proj.weight.view(4, 8, 32).mean(0), msg=name)
    assert count_kv_bytes(pooled) * 4 == count_kv_bytes(model)
    x = torch.randint(4, V, (2, 12))
    assert torch.isfinite(_call(pooled, x)).all()


def _layer_out(model, x, layer: int) -> torch.Tensor:
    out = {}
    hook = model.layers[str(layer)].register_forward_hook(lambda m, i, o: out.update(h=o))
    with torch.no_grad():
        model(x)
    hook.remove()
    return out["h"]


@pytest.mark.slow
def test_inspect_prune_and_convert_a_trained_run(tiny_config, tmp_path, capsys):
    """The three commands on a trained tiny run (GQA: 4 heads, 2 KV heads, 2 layers): pictures and tables; a
    pruned run that trains, resumes bitwise, generates and refuses an HF export in one line (or, pruned
    uniformly, exports); a pooled MQA run that up-trains."""
    from tessera.api import generate_text
    from tessera.cli import main
    from tessera.train.trainer import train

    def run_cli(*args: str):  # in-process: the CLI's parsing and one-line errors, without a new interpreter
        code = main([*args])
        out = capsys.readouterr()
        return type("Result", (), {"returncode": code, "stdout": out.out, "stderr": out.err})

    run = tmp_path / "run"
    train(tiny_config("train.steps=8", run_dir=run))
    res = run_cli("inspect", "attention", str(run), "--text", "def f(x):\n    return x", "--generate", "3",
                  "--heads", "0-2", "--out", str(tmp_path / "att"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "att").glob("*.png")) == ["layer00.png", "layer01.png"]
    assert "entropy  mean dist  first token  previous token" in res.stdout and "not proof" in res.stdout
    tokens = json.loads((tmp_path / "att" / "tokens.json").read_text())
    assert len(tokens["source"]) == tokens["prompt_rows"] + 3
    assert len((tmp_path / "att" / "heads.tsv").read_text().splitlines()) == 1 + 2 * 3
    res = run_cli("inspect", "attention", str(run), "--text", "x", "--layers", "5")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "matches no attention layer" in res.stderr

    pruned = tmp_path / "pruned"
    res = run_cli("prune", "heads", str(run), "--fraction", "0.25", "--out", str(pruned), "--uptrain-fraction", "0.5")
    assert res.returncode == 0, res.stderr
    record = json.loads((pruned / "derived.json").read_text())
    assert sorted(record["heads_per_layer"]) == [2, 4] and "global (gradient): removed heads" in res.stdout
    assert record["after"]["parameters"] < record["before"]["parameters"]
    config = load_config(pruned / "config.toml", ["checkpoint.every=2"])
    first = train(config)  # resumes the step-0 checkpoint: up-training
    assert first.val_losses[0] == pytest.approx(record["after"]["val_loss"], rel=1e-5)
    (pruned / "checkpoints" / "step_00000004").rename(tmp_path / "moved")
    again = train(config)  # resumes step 2
    assert again.losses == first.losses[2:]
    assert generate_text(pruned, "def ", 8)[0].startswith("def ")
    res = run_cli("convert", "hf-export", str(pruned), str(tmp_path / "hf"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "one head count for all layers" in res.stderr

    lines: list[str] = []
    uniform = prune_heads(str(run), str(tmp_path / "uniform"), "entropy", 0.5, layerwise=True, log=lines.append)
    assert uniform["heads_per_layer"] == [2, 2] and [line.split(" (")[0] for line in lines[1:3]] == [
        "layer 0",
        "layer 1",
    ]
    res = run_cli("convert", "hf-export", str(tmp_path / "uniform"), str(tmp_path / "hf"))
    assert res.returncode == 0 and "llama" in res.stdout, res.stderr
    res = run_cli("inspect", "attention", str(tmp_path / "hf"), "--text", "def f(x):", "--out", str(tmp_path / "hfa"))
    assert res.returncode == 0 and sorted(p.name for p in (tmp_path / "hfa").glob("*.png")) == [
        "layer00.png",
        "layer01.png",
    ], res.stderr

    _convert_to_mqa_and_uptrain(run_cli, run, tmp_path)


def _convert_to_mqa_and_uptrain(run_cli, run, tmp_path) -> None:
    """convert gqa: [model] overrides refused before anything is written, others shape the up-training recipe,
    an existing --out refused; the KV cache halves per pooling step and the new run up-trains from the pooled
    model's validation loss."""
    from tessera.train.trainer import train

    res = run_cli("convert", "gqa", str(run), "--kv-heads", "1", "--out", str(tmp_path / "mqa"), "model.dim=64")
    assert (
        res.returncode == 2 and "'model.dim' would change the model" in res.stderr and not (tmp_path / "mqa").exists()
    )
    res = run_cli("convert", "gqa", str(run), "--kv-heads", "1", "--out", str(tmp_path / "mqa"), "optim.lr=1e-4")
    assert res.returncode == 0, res.stderr
    assert load_config(tmp_path / "mqa" / "config.toml").optim.lr == 1e-4  # the up-training recipe's override
    res = run_cli("convert", "gqa", str(run), "--kv-heads", "1", "--out", str(tmp_path / "mqa"))
    assert res.returncode == 2 and "already holds a run" in res.stderr
    record = json.loads((tmp_path / "mqa" / "derived.json").read_text())
    assert record["kv_cache_bytes_per_token"] == [2 * 2 * 2 * 16 * 4, 2 * 2 * 1 * 16 * 4]
    uptrained = train(load_config(tmp_path / "mqa" / "config.toml"))
    assert uptrained.steps == 1 and uptrained.val_losses[0] == pytest.approx(record["after"]["val_loss"], rel=1e-5)
