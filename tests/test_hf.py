"""HF interop: each family imported from a random-weight HF model reproduces its logits (fp32, 1e-4)
and greedy generations, and exports back to a checkpoint ``from_pretrained`` reads identically."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import tessera
from tessera.config import model_config
from tessera.model import build_model, generate, generate_seq2seq
from tessera.model.hf import HFConversionError, save_hf

from conftest import run_cli

TOL = 1e-4
V = 320  # vocabulary of the tiny HF models
_LLAMA_LIKE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_model(family: str) -> transformers.PreTrainedModel:
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE))
    if family == "llama_yarn":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}))
    if family == "llama_linear":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE, rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}, tie_word_embeddings=True))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=8))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_LLAMA_LIKE))
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2))
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2))
    if family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128))
    proj = "relu" if family == "t5" else "gated-gelu"
    return transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, feed_forward_proj=proj))


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that logits differ clearly between tokens (HF's init is nearly flat)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = p.ndim == 1 and any(s in name.lower() for s in ("norm", "ln_"))
            p.copy_(1 + 0.1 * noise if is_norm and name.endswith("weight") else 0.15 * noise)
    return model.eval()


def _logits(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        if hasattr(model, "decoder") and (hf and model.config.is_encoder_decoder or not hf):
            return model(input_ids=x, decoder_input_ids=y).logits if hf else model(x, y)
        return model(x).logits if hf else model(x)


FAMILIES = ["llama", "llama_yarn", "llama_linear", "mistral", "qwen2", "mixtral", "gpt2", "bert", "t5", "t5_gated"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_parity_and_roundtrip(family, tmp_path):
    torch.manual_seed(0)
    hf = _randomize(_hf_model(family), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model = tessera.load(tmp_path / "hf")
    assert not model.training
    x = torch.randint(4, V, (2, 24), generator=torch.Generator().manual_seed(2))
    y = torch.randint(4, V, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = _logits(hf, x, y, hf=True)
    diff = (_logits(model, x, y, hf=False) - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logits diff| {diff:.2e}"
    assert ref.std() > 0.1  # the comparison is not between near-constant logits

    if family.startswith("t5"):
        hf.generation_config.update(eos_token_id=None, decoder_start_token_id=0)
        want = hf.generate(x, max_new_tokens=20, do_sample=False, use_cache=False)[:, 1:]
        got = generate_seq2seq(model, x, 20, start_id=0)
        assert torch.equal(got, want)
    elif family != "bert":
        hf.generation_config.eos_token_id = None
        want = hf.generate(x[:, :8], max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)[:, 8:]
        assert torch.equal(generate(model, x[:, :8], 20, temperature=0), want)

    save_hf(model, tmp_path / "out")
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForSeq2SeqLM if family.startswith("t5") else transformers.AutoModelForCausalLM
    back = auto.from_pretrained(tmp_path / "out").eval()
    assert (_logits(back, x, y, hf=True) - ref).abs().max().item() <= TOL


def test_cli_import_export(tmp_path):
    hf = _randomize(_hf_model("qwen2"), seed=4)
    hf.save_pretrained(tmp_path / "hf")
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    res = run_cli("convert", "hf-export", str(tmp_path / "run"), str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert "qwen2" in res.stdout
    x = torch.randint(0, V, (1, 16))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() <= TOL
        assert (tessera.load(tmp_path / "run")(x) - hf(x).logits).abs().max().item() <= TOL


def test_cli_unsupported_option_is_a_clear_error(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, scale_attn_by_inverse_layer_idx=True)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert "scale_attn_by_inverse_layer_idx" in res.stderr and "Traceback" not in res.stderr


def test_unsupported_rope_type_and_family(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_LIKE)).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match="rope_type"):
        tessera.load(tmp_path / "hf")
    config["model_type"] = "falcon"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match="falcon"):
        tessera.load(tmp_path / "hf")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(attention="performer"), "model.attention"),
        (dict(position="alibi"), "model.position"),
        (dict(qk_norm=True), "model.attention.qk_norm"),
        (dict(rotary_fraction=0.5), "model.position.rotary_fraction"),
        (dict(norm_position="post"), "model.norm_position"),
    ],
)
def test_export_refuses_what_hf_cannot_express(overrides, key, tmp_path):
    model = build_model(model_config(vocab_size=V, dim=32, n_layers=1, n_heads=4, max_seq_len=64, **overrides))
    with pytest.raises(HFConversionError, match=key):
        save_hf(model, tmp_path / "out")
