"""Text <-> token ids and readable token strings for a tessera run (its SentencePiece model) or an HF directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessera.data.sources import DataError
from tessera.data.tokenizer import Tokenizer


@dataclass
class Codec:
    """How one model reads text: ids with the special tokens it expects, a display string per id, decoding."""

    encode: Callable[[str], list[int]]
    piece: Callable[[int], str]
    decode: Callable[[list[int]], str]
    eos_id: int | None


def sentencepiece_codec(path: Path, arch: str) -> Codec:
    """A tessera tokenizer: BOS in front for decoders and encoders (as ``tessera generate``), EOS after an
    encoder-decoder's input (T5)."""
    tok = Tokenizer(path)

    def encode(text: str) -> list[int]:
        ids = tok.encode(text)
        return ids + [tok.eos_id] if arch == "encoder_decoder" else [tok.bos_id] + ids

    return Codec(encode, tok.piece, tok.decode, tok.eos_id)


def hf_tokenizer_codec(path: Path) -> Codec:
    """An HF ``tokenizer.json`` (its post-processor adds the model's special tokens)."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    eos = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "[SEP]") if tok.token_to_id(t) is not None), None)
    return Codec(
        lambda text: tok.encode(text).ids,
        lambda i: tok.id_to_token(i) or f"<{i}>",
        lambda ids: tok.decode(ids),
        eos,
    )


def load_codec(model_dir: Path, arch: str) -> Codec:
    """The tokenizer kept with a model: ``tokenizer.model`` (tessera runs, exports) or ``tokenizer.json``."""
    if (model_dir / "tokenizer.model").is_file():
        return sentencepiece_codec(model_dir / "tokenizer.model", arch)
    if (model_dir / "tokenizer.json").is_file():
        return hf_tokenizer_codec(model_dir / "tokenizer.json")
    raise DataError(f"'{model_dir}' has no tokenizer.model or tokenizer.json; copy the model's tokenizer there")
