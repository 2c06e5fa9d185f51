"""[data]: where the tokens come from and how the tokenizer is made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """Where the tokens come from and how the tokenizer is made."""

    source: str = "default"  # "default" (this Python's stdlib), a text/JSON(L)/Parquet/Arrow file or folder, or hf:NAME
    tokenizer: str = "default"  # "default"/"bpe" train SentencePiece/byte-level BPE; or .model, tokenizer.json, HF dir
    max_chars: int = 0  # cap on corpus characters read (0 = all)
    tokenizer_chars: int = 10_000_000  # characters of the corpus the default tokenizer trains on
    val_fraction: float = 0.05  # held-out share of documents when data.split is empty
    cache_dir: str = ""  # "" = $TESSERA_CACHE or ~/.cache/tessera
    blend: str = (
        ""  # prepared datasets instead of source: "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (Megatron --data-path)
    )
    blend_schedule: str = ""  # blend weights by step ranges: "0: 0.7 data/web 0.3 data/code; 90%: 1 data/hq"
    split: str = ""  # "train,valid,test" document weights, e.g. "98,1,1"; "" = from val_fraction
    text_field: str = "text"  # the field holding the text in JSON/Parquet/Arrow rows
    num_proc: int = 1  # tokenization worker processes when preparing data.source
    document_mask: bool = False  # positions restart and attention stops at document boundaries
    mask_eod_loss: bool = False  # no loss where the input token is EOD (the cross-document prediction)
    prefetch: int = 2  # batches prepared ahead by a background thread (0 = none)
