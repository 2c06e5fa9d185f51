"""``tessera <command>``: parse, validate, delegate. No logic lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tessera.config import ConfigError, load_config



def _user_errors() -> tuple[type[Exception], ...]:
    from tessera.data.sources import DataError
    from tessera.launcher.common import LaunchError
    from tessera.train.checkpoint import CheckpointError

    return (ConfigError, DataError, CheckpointError, LaunchError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Pretrain transformer language models, from one CPU to a GPU cluster.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert_parser(sub)
    _add_parity(sub)

    train = sub.add_parser("train", help="train a model from a TOML recipe", allow_abbrev=False)
    train.add_argument("config", help="TOML recipe, e.g. configs/smoke.toml")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    tok = sub.add_parser("tokenizer", help="tokenizer tools", allow_abbrev=False)
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    tok_train = tok_sub.add_parser("train", help="train (or reuse from the cache) the recipe's SentencePiece tokenizer", allow_abbrev=False)
    tok_train.add_argument("config", nargs="?", default=None, help="TOML recipe (its data and model.vocab_size sections); defaults if omitted")
    tok_train.add_argument("--kind", choices=("sentencepiece", "bpe"), default=None, help="train SentencePiece BPE (.model) or an HF byte-level BPE (tokenizer.json); default: data.tokenizer")

    gen = sub.add_parser("generate", help="sample text from a run directory or checkpoint", allow_abbrev=False)
    gen.add_argument("path", help="run directory (newest checkpoint) or checkpoint directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    gen.add_argument("--seed", type=int, default=0)

    launch = sub.add_parser("launch", help="train on several processes/nodes with torchrun (or accelerate launch)", allow_abbrev=False)
    launch.add_argument("config", help="TOML recipe; overrides follow as for train")
    launch.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    launch.add_argument("--nproc-per-node", type=int, default=0, help="processes per node (default: the GPU count, or up to 4 on CPU)")
    launch.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the first node; needed with --nnodes > 1")
    launch.add_argument("--rdzv-backend", default="c10d", help="c10d (elastic, default) or static (fixed node ranks)")
    launch.add_argument("--rdzv-id", default="", help="job id shared by all nodes (default: from train.run_dir)")
    launch.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous only)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group after a failure")
    launch.add_argument("--via", choices=("torchrun", "accelerate"), default="torchrun", help="launcher (accelerate: also writes RUN_DIR/accelerate.yaml)")
    launch.add_argument("--dry-run", action="store_true", help="print the command instead of running it")

    sl = sub.add_parser("slurm", help="write (and submit) a SLURM sbatch script that trains on N nodes", allow_abbrev=False)
    sl.add_argument("config", help="TOML recipe; overrides follow as for train")
    sl.add_argument("--nodes", type=int, default=1, help="number of nodes")
    sl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node; on a CPU job, processes per node")
    sl.add_argument("--device", default="auto", help="gpu, cpu, or auto (train.device, else whether this machine sees a GPU)")
    sl.add_argument("--partition", default="")
    sl.add_argument("--time", default="", help="time limit, e.g. 04:00:00 or 2-00:00:00")
    sl.add_argument("--account", default="")
    sl.add_argument("--qos", default="")
    sl.add_argument("--exclusive", action="store_true", help="whole nodes only")
    sl.add_argument("--job-name", default="", help="default: the run directory's name")
    sl.add_argument("--cpus-per-task", type=int, default=0, help="cores per node task (default: SLURM's on GPU jobs, one per process on CPU)")
    sl.add_argument("--mem", default="", help="memory per node, e.g. 0 (all) or 480G")
    sl.add_argument("--signal-seconds", type=int, default=300, help="send SIGUSR1 this long before the time limit: checkpoint and requeue")
    sl.add_argument("--rdzv-port", type=int, default=0, help="rendezvous port on the first node (default 29500 + job id % 1000)")
    sl.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of a failed worker group")
    sl.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="extra sbatch option, e.g. --sbatch=--constraint=h100 (repeatable)")
    sl.add_argument("--setup", action="append", default=[], metavar="LINE", help="shell line run before srun, e.g. 'source .venv/bin/activate' (repeatable)")
    sl.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    sl.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")

    prep = sub.add_parser("prepare", help="tokenize a corpus into a megatron-core indexed dataset (PREFIX.bin/.idx)", allow_abbrev=False)
    prep.add_argument("source", help="'default' (this Python's stdlib), a text/JSON/JSONL/Parquet/Arrow file or folder, or hf:NAME")
    prep.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    prep.add_argument("--tokenizer", default="default", help="SentencePiece .model, HF tokenizer.json or HF tokenizer directory; 'default' trains SentencePiece on the source, kept as PREFIX.tokenizer.model")
    prep.add_argument("--vocab-size", type=int, default=2048, help="vocabulary of the trained tokenizer")
    prep.add_argument("--text-field", default="text", help="field of JSON/Parquet/Arrow rows that holds the text")
    prep.add_argument("--num-proc", type=int, default=1, help="tokenization worker processes")
    prep.add_argument("--max-chars", type=int, default=0, help="stop after this many characters (0 = all)")
    prep.add_argument("--tokenizer-chars", type=int, default=10_000_000, help="characters the default tokenizer trains on")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")

    data = sub.add_parser("data", help="dataset tools", allow_abbrev=False)
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    inspect = data_sub.add_parser("inspect", help="documents, tokens, length histogram and decoded samples of an indexed dataset", allow_abbrev=False)
    inspect.add_argument("path", help="dataset prefix (PREFIX.bin/.idx), or either file")
    inspect.add_argument("--tokenizer", default="", help=".model, tokenizer.json or HF tokenizer directory to decode with (default: PREFIX.tokenizer.model if present)")
    inspect.add_argument("--samples", type=int, default=3, help="decoded documents to show")
    return parser


def _add_parity(sub: argparse._SubParsersAction) -> None:
    par = sub.add_parser("parity", help="compare per-step losses of one recipe under several parallel layouts", allow_abbrev=False)
    par.add_argument("config", help="TOML recipe")
    par.add_argument("--layouts", nargs="+", required=True, help='layouts such as single "dp_shard=2" "tp=2" "dp_shard=2,tp=2"; the first is the reference')
    par.add_argument("--steps", type=int, default=5)
    par.add_argument("--rtol", type=float, default=1e-5)
    par.add_argument("--work-dir", default=None, help="where the runs write (default: a temporary directory)")


def _cmd_parity(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.parity import parity

    table, ok = parity(args.config, args.layouts, overrides, args.steps, args.rtol, args.work_dir)
    print(table)
    return 0 if ok else 1


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_config(args.config, overrides)
    if args.print_config:
        print(config.to_toml())
        return 0
    from tessera.train.preemption import PREEMPTED_EXIT_CODE
    from tessera.train.trainer import train_and_exit

    return PREEMPTED_EXIT_CODE if train_and_exit(config).preempted else 0


def _cmd_tokenizer(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.data.pipeline import build_tokenizer
    from tessera.data.sources import load_corpus

    config = load_config(args.config, overrides)
    docs, corpus_hash = load_corpus(config.data.source, config.data.max_chars, config.data.text_field)
    tokenizer, cached = build_tokenizer(config, docs, corpus_hash, {"sentencepiece": "default", "bpe": "bpe", None: ""}[args.kind])
    print(f"{'reused cached' if cached else 'trained'} tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens)")
    return 0


def _add_convert_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="convert between HF transformers checkpoints and tessera", allow_abbrev=False)
    conv_sub = conv.add_subparsers(dest="convert_command", required=True, metavar="ACTION")
    imp = conv_sub.add_parser("hf-import", help="HF model directory (config.json + safetensors) -> tessera run directory", allow_abbrev=False)
    imp.add_argument("hf_dir", help="HF model directory: llama, mistral, qwen2, gpt2, mixtral, bert or t5")
    imp.add_argument("out_dir", help="tessera run directory to write (one checkpoint, step 0)")
    exp = conv_sub.add_parser("hf-export", help="tessera run or checkpoint directory -> HF model directory", allow_abbrev=False)
    exp.add_argument("checkpoint", help="run directory (newest checkpoint) or checkpoint directory")
    exp.add_argument("out_dir", help="HF model directory to write (config.json + model.safetensors)")
    exp.add_argument("--family", default=None, help="HF family to write (default: detected from the model config)")
    cons = conv_sub.add_parser("consolidate", help="tessera run or checkpoint (any layout) -> one model.safetensors", allow_abbrev=False)
    cons.add_argument("checkpoint", help="run directory (newest checkpoint) or checkpoint directory")
    cons.add_argument("out_dir", help="directory to write model.safetensors (and config.toml) into")


def _cmd_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"tessera convert takes no config overrides, got {' '.join(overrides)}")
    from tessera.convert import consolidate, hf_export, hf_import

    if args.convert_command == "hf-import":
        print(f"imported {args.hf_dir} -> {hf_import(args.hf_dir, args.out_dir)}")
    elif args.convert_command == "consolidate":
        print(f"consolidated {args.checkpoint} -> {consolidate(args.checkpoint, args.out_dir)}")
    else:
        print(f"exported {args.checkpoint} -> {args.out_dir} ({hf_export(args.checkpoint, args.out_dir, args.family)})")
    return 0


def _cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"tessera generate takes no config overrides, got {' '.join(overrides)}")
    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    import torch

    from tessera.api import load_with_tokenizer
    from tessera.model import generate

    model, tokenizer = load_with_tokenizer(args.path)
    ids = torch.tensor([tokenizer.prompt_ids(args.prompt)])
    temperature = 0.0 if args.greedy else args.temperature
    gen = torch.Generator().manual_seed(args.seed)
    out = generate(model, ids, args.max_new_tokens, temperature, args.top_k, args.top_p, tokenizer.eos_id, gen)
    print(args.prompt + tokenizer.decode(out[0].tolist()))
    return 0


def _cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"tessera prepare takes no config overrides, got {' '.join(overrides)}")
    for flag, value, low in (("--vocab-size", args.vocab_size, 260), ("--num-proc", args.num_proc, 1), ("--max-chars", args.max_chars, 0), ("--tokenizer-chars", args.tokenizer_chars, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    from tessera.data.pipeline import cache_dir
    from tessera.data.prepare import prepare_corpus

    summary, tokenizer = prepare_corpus(
        args.source, args.output, args.tokenizer, args.vocab_size, args.text_field, args.max_chars, args.tokenizer_chars, args.num_proc, cache_dir(), not args.no_progress
    )
    print(f"prepared {summary.line()}; tokenizer {tokenizer.path} ({tokenizer.vocab_size} tokens)")
    return 0


def _cmd_data(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"tessera data {args.data_command} takes no config overrides, got {' '.join(overrides)}")
    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {args.samples}")
    from tessera.data.inspect import inspect_dataset

    print(inspect_dataset(args.path, args.tokenizer, args.samples))
    return 0


def _cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.launcher.torchrun import launch

    return launch(
        args.config, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id, node_rank=args.node_rank, max_restarts=args.max_restarts, via=args.via, dry_run=args.dry_run,
    )


def _cmd_slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.launcher.slurm import SlurmSpec, slurm

    spec = SlurmSpec(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, device=args.device, partition=args.partition, time=args.time, account=args.account,
        qos=args.qos, exclusive=args.exclusive, job_name=args.job_name, cpus_per_task=args.cpus_per_task, mem=args.mem,
        signal_seconds=args.signal_seconds, rdzv_port=args.rdzv_port, max_restarts=args.max_restarts, sbatch_options=args.sbatch, setup=args.setup,
    )
    return slurm(args.config, overrides, spec, args.argv, args.submit, args.dry_run)


COMMANDS = {"launch": _cmd_launch, "slurm": _cmd_slurm, "train": _cmd_train, "tokenizer": _cmd_tokenizer, "generate": _cmd_generate, "prepare": _cmd_prepare, "data": _cmd_data}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit code (2 for user errors)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args, extra)
    except _user_errors() as err:
        print(f"tessera: error: {err}", file=sys.stderr)
        return 2


COMMANDS["convert"] = _cmd_convert
COMMANDS["parity"] = _cmd_parity
