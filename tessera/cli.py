"""``tessera <command>``: parse, validate, delegate. No logic lives here.

Each command is one ``_add_<command>`` function that registers its sub-parser and points it at
its handler ``_cmd_<command>(args, overrides) -> exit code``.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from tessera.errors import ConfigError, UserError
from tessera.launcher.workers import peer_failed, record_worker_error
from tessera.validate import load_config

Handler = Callable[[argparse.Namespace, list[str]], int]
Subparsers = argparse._SubParsersAction

OVERRIDES_HELP = (
    "Overrides follow the recipe as dotted keys, in either form: model.n_layers=4 or --model.n_layers 4. "
    "`tessera config keys [SECTION]` lists every key with its type, default, allowed values and meaning."
)

UPTRAIN_HELP = (
    "The new run's recipe is the source's with --uptrain-fraction of its steps (warmup: a tenth of them); dotted "
    "overrides after the flags change it (optim.lr=1e-3 train.steps=40), [model] excepted. Then: tessera train "
    "OUT/config.toml."
)


def _command(sub: Subparsers, name: str, handler: Handler, help: str, **kwargs) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help, description=help, allow_abbrev=False, **kwargs)
    parser.set_defaults(handler=handler)
    return parser


def _no_overrides(command: str, overrides: list[str]) -> None:
    if overrides:
        raise ConfigError(f"tessera {command} takes no config overrides, got {' '.join(overrides)}")


# ---------------------------------------------------------------- train


def _add_train(sub: Subparsers) -> None:
    train = _command(
        sub,
        "train",
        _cmd_train,
        "train a model from a TOML recipe (resumes from the newest checkpoint)",
        epilog=OVERRIDES_HELP,
    )
    train.add_argument("config", help="TOML recipe, e.g. configs/smoke.toml")
    train.add_argument(
        "--print-config", action="store_true", help="print the resolved config, with each key's comment, and exit"
    )


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_config(args.config, overrides)
    if args.print_config:
        from tessera.config.docs import commented_toml

        print(commented_toml(config), end="")
        return 0
    from tessera.data.pipeline import cache_dir
    from tessera.evaluate.loop import check_eval
    from tessera.train.distill import open_teacher
    from tessera.train.init_from import check_init_from
    from tessera.train.rundir import claim_run
    from tessera.train.metrics import check_sinks
    from tessera.train.preemption import stop_exit_code
    from tessera.train.trainer import train_and_exit

    check_sinks(config.log)
    check_eval(config, cache_dir(config.data.cache_dir))  # [eval] tasks known, their rows well formed
    check_init_from(config)  # train.init_from: source and recipe checked before anything is written
    open_teacher(config)  # train.distill.teacher: likewise
    with claim_run(config.train.run_dir):  # before anything is built: the run is busy from now on
        return stop_exit_code(train_and_exit(config).preempted)


# ---------------------------------------------------------------- config


def _add_config(sub: Subparsers) -> None:
    config = _command(sub, "config", _cmd_config, "recipe keys: documentation generated from tessera's config classes")
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    keys = actions.add_parser("keys", help="every key: type, default, allowed values and meaning", allow_abbrev=False)
    keys.add_argument(
        "section",
        nargs="?",
        default="",
        help="a section (model), a sub-section (model.attention) or a key (train.steps)",
    )


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("config", overrides)
    from tessera.config.docs import keys_table

    print(keys_table(args.section))
    return 0


# ---------------------------------------------------------------- status


def _add_status(sub: Subparsers) -> None:
    status = _command(
        sub, "status", _cmd_status, "a run at a glance: step, losses, tokens, checkpoint, whether it is running, ETA"
    )
    status.add_argument("run_dir", help="the run directory (train.run_dir), e.g. runs/smoke")


def _cmd_status(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("status", overrides)
    from tessera.train.status import run_status

    print(run_status(args.run_dir))
    return 0


# ---------------------------------------------------------------- launch, slurm, parity


def _add_launch(sub: Subparsers) -> None:
    launch = _command(
        sub,
        "launch",
        _cmd_launch,
        "train on several processes/nodes with torchrun (or accelerate launch)",
        epilog=OVERRIDES_HELP,
    )
    launch.add_argument("config", help="TOML recipe; overrides follow as for train")
    launch.add_argument(
        "--nnodes",
        default="1",
        help="number of nodes (default 1), or MIN:MAX for an elastic job that continues on fewer nodes "
        "(grad_accum rises to keep the global batch)",
    )
    launch.add_argument(
        "--nproc-per-node", type=int, default=0, help="processes per node (default: the GPU count, or up to 4 on CPU)"
    )
    launch.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the first node; needed with --nnodes > 1")
    launch.add_argument("--rdzv-backend", default="c10d", help="c10d (elastic, default) or static (fixed node ranks)")
    launch.add_argument("--rdzv-id", default="", help="job id shared by all nodes (default: from train.run_dir)")
    launch.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous only)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group after a failure")
    launch.add_argument(
        "--via",
        choices=("torchrun", "accelerate"),
        default="torchrun",
        help="launcher, run by this Python (accelerate: also writes RUN_DIR/accelerate.yaml)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    launch.add_argument(
        "--gpu",
        default="",
        help="GPU kind of `tessera plan`'s catalog, e.g. h100-80gb: warn if the layout will not fit",
    )
    launch.add_argument(
        "--ft-replicas",
        type=int,
        default=0,
        help="torchft: start a lighthouse and N replica groups (one process each) that train on when one dies; "
        "--max-restarts starts a dead group again, which rejoins with its peers' live state",
    )
    launch.add_argument(
        "--ft-lighthouse", default="", help="with --ft-replicas: HOST:PORT of a running lighthouse instead of a new one"
    )


def _cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.launcher.ft import launch_replicas
    from tessera.launcher.torchrun import launch

    if args.ft_replicas or args.ft_lighthouse:
        return launch_replicas(
            args.config, overrides, args.ft_replicas, args.max_restarts, args.ft_lighthouse, args.dry_run
        )
    return launch(
        args.config,
        overrides,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        node_rank=args.node_rank,
        max_restarts=args.max_restarts,
        via=args.via,
        dry_run=args.dry_run,
        gpu=args.gpu,
    )


def _add_slurm_allocation(sl: argparse.ArgumentParser) -> None:
    sl.add_argument("--nodes", type=int, default=1, help="number of nodes")
    sl.add_argument(
        "--nnodes",
        default="",
        metavar="MIN:MAX",
        help="elastic instead of --nodes: between MIN and MAX nodes; on fewer than MAX, grad_accum rises to keep "
        "the global batch (with --max-restarts, a lost node's job continues on the rest)",
    )
    sl.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs (processes) per node; on a CPU job, processes per node"
    )
    sl.add_argument(
        "--device",
        default="auto",
        help="gpu, cpu, or auto: cpu when train.device=cpu, else gpu (what the job needs, not what this node has)",
    )
    sl.add_argument("--partition", default="", help="#SBATCH --partition")
    sl.add_argument("--time", default="", help="time limit, e.g. 04:00:00 or 2-00:00:00")
    sl.add_argument("--account", default="", help="#SBATCH --account")
    sl.add_argument("--qos", default="", help="#SBATCH --qos")
    sl.add_argument("--exclusive", action="store_true", help="whole nodes only")
    sl.add_argument("--job-name", default="", help="default: the run directory's name")
    sl.add_argument(
        "--cpus-per-task",
        type=int,
        default=0,
        help="cores per node task (default: SLURM's on GPU jobs, one per process on CPU)",
    )
    sl.add_argument("--mem", default="", help="memory per node, e.g. 0 (all) or 480G")
    sl.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra sbatch option, e.g. --sbatch=--constraint=h100 (repeatable)",
    )


def _add_slurm(sub: Subparsers) -> None:
    sl = _command(
        sub,
        "slurm",
        _cmd_slurm,
        "write (and submit) a SLURM sbatch script that trains on N nodes",
        epilog=OVERRIDES_HELP,
    )
    sl.add_argument("config", help="TOML recipe; overrides follow as for train")
    _add_slurm_allocation(sl)
    sl.add_argument(
        "--signal-seconds",
        type=int,
        default=300,
        help="send SIGUSR1 this long before the time limit: checkpoint and requeue",
    )
    sl.add_argument(
        "--rdzv-port", type=int, default=0, help="rendezvous port on the first node (default 29500 + job id %% 1000)"
    )
    sl.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of a failed worker group")
    sl.add_argument(
        "--python",
        default="",
        help="the Python the job runs (default: the one running this command, as sys.executable names it)",
    )
    sl.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="shell line run before srun, e.g. 'module load cuda' (repeatable)",
    )
    sl.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    sl.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    sl.add_argument(
        "--gpu",
        default="",
        help="GPU kind of `tessera plan`'s catalog, e.g. h100-80gb: warn if the layout will not fit",
    )


def _cmd_slurm(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.launcher.slurm import SlurmSpec, slurm
    from tessera.launcher.torchrun import parse_nnodes

    low, high = parse_nnodes(args.nnodes) if args.nnodes else (0, args.nodes)
    spec = SlurmSpec(
        nodes=high,
        min_nodes=low,
        gpus_per_node=args.gpus_per_node,
        device=args.device,
        partition=args.partition,
        time=args.time,
        account=args.account,
        qos=args.qos,
        exclusive=args.exclusive,
        job_name=args.job_name,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        signal_seconds=args.signal_seconds,
        rdzv_port=args.rdzv_port,
        max_restarts=args.max_restarts,
        sbatch_options=args.sbatch,
        setup=args.setup,
        python=args.python or sys.executable,
        gpu=args.gpu,
    )
    return slurm(args.config, overrides, spec, args.argv, args.submit, args.dry_run)


def _add_parity(sub: Subparsers) -> None:
    par = _command(
        sub,
        "parity",
        _cmd_parity,
        "compare per-step losses of one recipe under several parallel layouts",
        epilog=OVERRIDES_HELP,
    )
    par.add_argument("config", help="TOML recipe")
    par.add_argument(
        "--layouts",
        nargs="+",
        required=True,
        help='layouts such as single "dp_shard=2" "tp=2" "dp_shard=2,tp=2"; the first is the reference',
    )
    par.add_argument("--steps", type=int, default=5, help="optimizer steps each layout trains")
    par.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance on losses and grad norms")
    par.add_argument("--work-dir", default=None, help="where the runs write (default: a temporary directory)")


def _cmd_parity(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.parity import parity

    table, ok = parity(args.config, args.layouts, overrides, args.steps, args.rtol, args.work_dir)
    print(table)
    return 0 if ok else 1


# ---------------------------------------------------------------- data and tokenizers


def _add_prepare(sub: Subparsers) -> None:
    prep = _command(
        sub, "prepare", _cmd_prepare, "tokenize a corpus into a megatron-core indexed dataset (PREFIX.bin/.idx)"
    )
    prep.add_argument(
        "source", help="'default' (this Python's stdlib), a text/JSON/JSONL/Parquet/Arrow file or folder, or hf:NAME"
    )
    prep.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    prep.add_argument(
        "--tokenizer",
        default="default",
        help="SentencePiece .model, HF tokenizer.json or HF tokenizer directory; 'default' trains SentencePiece on the "
        "source. Either is kept as PREFIX.tokenizer.model",
    )
    prep.add_argument("--vocab-size", type=int, default=2048, help="vocabulary of the trained tokenizer")
    prep.add_argument("--text-field", default="text", help="field of JSON/Parquet/Arrow rows that holds the text")
    prep.add_argument("--num-proc", type=int, default=1, help="tokenization worker processes")
    prep.add_argument("--max-chars", type=int, default=0, help="stop after this many characters (0 = all)")
    prep.add_argument(
        "--tokenizer-chars", type=int, default=10_000_000, help="characters the default tokenizer trains on"
    )
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("prepare", overrides)
    limits = (
        ("--vocab-size", args.vocab_size, 260),
        ("--num-proc", args.num_proc, 1),
        ("--max-chars", args.max_chars, 0),
        ("--tokenizer-chars", args.tokenizer_chars, 1),
    )
    for flag, value, low in limits:
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    from tessera.data.pipeline import cache_dir
    from tessera.data.prepare import prepare_corpus

    summary, tokenizer = prepare_corpus(
        args.source,
        args.output,
        args.tokenizer,
        args.vocab_size,
        args.text_field,
        args.max_chars,
        args.tokenizer_chars,
        args.num_proc,
        cache_dir(),
        not args.no_progress,
    )
    print(f"prepared {summary.line()}; tokenizer {tokenizer.path} ({tokenizer.vocab_size} tokens)")
    return 0


def _add_data(sub: Subparsers) -> None:
    data = _command(sub, "data", _cmd_data, "dataset tools")
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    inspect = actions.add_parser(
        "inspect",
        help="documents, tokens, length histogram and decoded samples of an indexed dataset",
        allow_abbrev=False,
    )
    inspect.add_argument("path", help="dataset prefix (PREFIX.bin/.idx), or either file")
    inspect.add_argument(
        "--tokenizer",
        default="",
        help=".model, tokenizer.json or HF tokenizer directory to decode with "
        "(default: the one tessera prepare recorded)",
    )
    inspect.add_argument("--samples", type=int, default=3, help="decoded documents to show")


def _cmd_data(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides(f"data {args.data_command}", overrides)
    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {args.samples}")
    from tessera.data.inspect import inspect_dataset

    print(inspect_dataset(args.path, args.tokenizer, args.samples))
    return 0


def _add_tokenizer(sub: Subparsers) -> None:
    tok = _command(sub, "tokenizer", _cmd_tokenizer, "tokenizer tools")
    actions = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = actions.add_parser(
        "train",
        help="train (or reuse from the cache) the recipe's tokenizer: SentencePiece, or --kind bpe",
        allow_abbrev=False,
        epilog=OVERRIDES_HELP,
    )
    train.add_argument(
        "config",
        nargs="?",
        default=None,
        help="TOML recipe (its data and model.vocab_size sections); defaults if omitted",
    )
    train.add_argument(
        "--kind",
        choices=("sentencepiece", "bpe"),
        default=None,
        help="SentencePiece BPE (.model) or an HF byte-level BPE (tokenizer.json); "
        "default: the recipe's data.tokenizer",
    )


def _cmd_tokenizer(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.data.pipeline import build_tokenizer
    from tessera.data.sources import load_corpus

    config = load_config(args.config, overrides)
    docs, corpus_hash = load_corpus(config.data.source, config.data.max_chars, config.data.text_field)
    spec = {"sentencepiece": "default", "bpe": "bpe", None: ""}[args.kind]
    tokenizer, cached = build_tokenizer(config, docs, corpus_hash, spec)
    print(f"{'reused cached' if cached else 'trained'} tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens)")
    return 0


# ---------------------------------------------------------------- evaluation: eval, compare, lm-eval


def _add_eval(sub: Subparsers) -> None:
    ev = _command(sub, "eval", _cmd_eval, "perplexity at multiples of the training length, RoPE scaling switchable")
    ev.add_argument("path", help="run directory, checkpoint directory or HF model directory")
    ev.add_argument("--lengths", default="1x,2x,4x", help="multiples of the training length or token counts")
    ev.add_argument(
        "--rope-scaling",
        default="model",
        help="comma-separated: model (as trained), none, linear, ntk, yarn, llama3; factor = length / training length",
    )
    ev.add_argument("--data", default="", help="indexed dataset PREFIX to score (default: the run's validation split)")
    ev.add_argument("--tokens", type=int, default=32768, help="tokens scored at each length (default 32768)")
    ev.add_argument("--seq-len", type=int, default=0, help="the training length (default: the run's train.seq_len)")
    ev.add_argument("--out", default="", help="PNG to write (default: PATH/length_eval.png, or ./ for HF dirs)")


def _cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("eval", overrides)
    if args.tokens <= 0 or args.seq_len < 0:
        raise ConfigError(f"--tokens must be positive and --seq-len >= 0, got {args.tokens}, {args.seq_len}")
    from pathlib import Path

    from tessera.api import evaluate_lengths
    from tessera.evaluate.lengths import format_table, plot_lengths

    rows, base = evaluate_lengths(args.path, args.lengths, args.rope_scaling, args.data, args.tokens, args.seq_len)
    print(format_table(rows, f"perplexity (trained at {base})"))
    out = Path(args.out) if args.out else Path(args.path) / "length_eval.png"
    print(f"plot: {plot_lengths(rows, Path(args.path).name, out)}")
    return 0


def _add_compare(sub: Subparsers) -> None:
    cmp = _command(sub, "compare", _cmd_compare, "overlay several runs' loss, validation and eval curves")
    cmp.add_argument("runs", nargs="+", help="run directories (train.run_dir); runs still training are fine")
    cmp.add_argument("--x", default="step", choices=["step", "tokens"], help="x axis (default step)")
    cmp.add_argument("--out", default="compare.png", help="PNG to write (default compare.png)")


def _cmd_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("compare", overrides)
    from pathlib import Path

    from tessera.evaluate.compare import compare_runs

    table, out = compare_runs(args.runs, Path(args.out), args.x)
    print(table)
    print(f"plot: {out}")
    return 0


def _add_lm_eval(sub: Subparsers) -> None:
    lm = _command(
        sub,
        "lm-eval",
        _cmd_lm_eval,
        "lm-eval-harness with the 'tessera' model registered and the built-in stdlib tasks on --include_path",
    )
    lm.add_argument(
        "lm_eval_args",
        nargs=argparse.REMAINDER,
        help="lm_eval's own arguments, e.g. run --model tessera --model_args path=runs/smoke --tasks stdlib_next_line",
    )
    lm.set_defaults(passthrough=True)


def _cmd_lm_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.data.pipeline import cache_dir
    from tessera.evaluate.harness import require_lm_eval

    require_lm_eval()
    from tessera.lm_eval_model import run_lm_eval

    raw = args.argv[args.argv.index("lm-eval") + 1 :]  # in the user's order (argparse splits them)
    if not raw:
        raise ConfigError(
            "tessera lm-eval needs lm_eval's arguments, e.g. tessera lm-eval run --model tessera "
            "--model_args path=runs/smoke --tasks stdlib_next_line"
        )
    return run_lm_eval(raw, cache_dir())


# ---------------------------------------------------------------- models: generate, convert


def _add_generate(sub: Subparsers) -> None:
    gen = _command(sub, "generate", _cmd_generate, "sample text from a run directory or checkpoint")
    gen.add_argument("path", help="run directory (newest checkpoint) or checkpoint directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument(
        "--kv-cache",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16", "int8"),
        help="how keys and values are stored: the model's dtype (auto), a float dtype, or int8 with a scale per "
        "token and head",
    )
    gen.add_argument(
        "--draft",
        default="",
        metavar="DRAFT_RUN_OR_HF_DIR|mtp",
        help="speculative decoding: a smaller model with the same tokenizer proposes tokens (its run, checkpoint "
        "or HF directory), or 'mtp' for the model's own multi-token-prediction modules",
    )
    gen.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per round (default 4)")


def _cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides("generate", overrides)
    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or args.top_k < 0:
        raise ConfigError(
            f"--temperature must be a finite number >= 0 and --top-k >= 0, got {args.temperature}, {args.top_k}"
        )
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    from tessera.api import generate_text

    temperature = 0.0 if args.greedy else args.temperature
    text, info = generate_text(
        args.path,
        args.prompt,
        args.max_new_tokens,
        temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.kv_cache,
        args.draft,
        args.draft_tokens,
    )
    print(text)
    print(info, file=sys.stderr)
    return 0


def _add_convert(sub: Subparsers) -> None:
    conv = _command(
        sub, "convert", _cmd_convert, "convert between HF transformers or DeepSpeed checkpoints and tessera"
    )
    actions = conv.add_subparsers(dest="convert_command", required=True, metavar="ACTION")
    imp = actions.add_parser(
        "hf-import", help="HF model directory (config.json + safetensors) -> tessera run directory", allow_abbrev=False
    )
    imp.add_argument(
        "hf_dir",
        help="HF model directory: llama, mistral, qwen2, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, "
        "gpt2, bert, t5, mamba, mamba2 or jamba",
    )
    imp.add_argument("out_dir", help="tessera run directory to write (one checkpoint, step 0)")
    imp.add_argument("--overwrite", action="store_true", help="replace what an earlier run wrote into OUT_DIR")
    exp = actions.add_parser(
        "hf-export", help="tessera run or checkpoint directory -> HF model directory", allow_abbrev=False
    )
    exp.add_argument("checkpoint", help="run directory (newest checkpoint) or checkpoint directory")
    exp.add_argument(
        "out_dir", help="HF model directory to write (config, safetensors, tokenizer, generation config, model card)"
    )
    exp.add_argument("--family", default=None, help="HF family to write (default: detected from the model config)")
    cons = actions.add_parser(
        "consolidate", help="tessera run or checkpoint (any layout) -> one model.safetensors", allow_abbrev=False
    )
    cons.add_argument("checkpoint", help="run directory (newest checkpoint) or checkpoint directory")
    cons.add_argument("out_dir", help="directory to write model.safetensors (and config.toml) into")
    _add_deepspeed_import(actions)
    _add_quantize(actions)
    gqa = actions.add_parser(
        "gqa",
        help="pool KV heads (MHA -> GQA/MQA, Ainslie et al. 2023) into a new run to up-train",
        allow_abbrev=False,
        epilog=UPTRAIN_HELP,
    )
    gqa.add_argument("run", help="run directory (newest checkpoint) or checkpoint directory")
    gqa.add_argument("--kv-heads", type=int, required=True, help="KV heads after pooling (1 = multi-query)")
    gqa.add_argument("--out", required=True, help="new run directory to write")
    gqa.add_argument("--batches", type=int, default=0, help="validation batches (default: train.eval_batches)")
    gqa.add_argument(
        "--uptrain-fraction", type=float, default=0.05, help="the new run's train.steps as a share of the source's"
    )


def _add_quantize(actions: argparse._SubParsersAction) -> None:
    """`tessera convert quantize`: its arguments."""
    qnt = actions.add_parser(
        "quantize",
        help="tessera run -> torchao weight-quantized HF directory (transformers TorchAoConfig; tessera loads it)",
        allow_abbrev=False,
    )
    qnt.add_argument("run", help="run directory (newest checkpoint) or checkpoint directory")
    qnt.add_argument("out_dir", help="HF model directory to write (quantized safetensors, config, tokenizer)")
    qnt.add_argument(
        "--scheme",
        default=None,
        choices=("int8-weight", "int4-weight", "fp8"),
        help="int8 per-row, int4 per-group (torchao IntxWeightOnlyConfig, runs on CPU) or fp8 e4m3 per-row weights "
        "(default: the run's train.qat scheme)",
    )
    qnt.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="int4-weight: input columns per scale (default: the run's train.qat_group_size, else 32)",
    )


def _add_deepspeed_import(actions: argparse._SubParsersAction) -> None:
    """`tessera convert deepspeed-import`: its arguments."""
    dsi = actions.add_parser(
        "deepspeed-import",
        help="DeepSpeed ZeRO-1/2/3 or universal checkpoint -> tessera run directory (weights and Adam state)",
        allow_abbrev=False,
    )
    dsi.add_argument("ds_checkpoint", help="DeepSpeed checkpoint folder (global_stepN, or its parent with 'latest')")
    dsi.add_argument("out_dir", help="tessera run directory to write (one checkpoint at the DeepSpeed step)")
    dsi.add_argument(
        "--config",
        default=None,
        help="tessera recipe of the model when the names are tessera's (default: an HF config.json beside the "
        "checkpoint)",
    )


def _cmd_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.convert_command == "gqa":  # overrides: the new run's up-training recipe
        from tessera.analysis.gqa import convert_gqa

        convert_gqa(args.run, args.kv_heads, args.out, args.uptrain_fraction, args.batches, overrides, print)
        return 0
    _no_overrides("convert", overrides)
    if args.convert_command == "quantize":
        from tessera.quantize.convert import quantize_run, run_scheme

        scheme, group_size = run_scheme(args.run, args.scheme, args.group_size)
        out = quantize_run(args.run, args.out_dir, scheme, group_size)
        print(f"quantized {args.run} -> {out} ({scheme})")
        return 0
    from tessera.hf.convert import consolidate, deepspeed_import, hf_export, hf_import, init_from_command

    if args.convert_command == "deepspeed-import":
        print(f"imported {args.ds_checkpoint} -> {deepspeed_import(args.ds_checkpoint, args.out_dir, args.config)}")
    elif args.convert_command == "hf-import":
        print(f"imported {args.hf_dir} -> {hf_import(args.hf_dir, args.out_dir, args.overwrite)}")
        print(f"next step (continued pretraining): {init_from_command(args.hf_dir, args.out_dir)}")
    elif args.convert_command == "consolidate":
        print(f"consolidated {args.checkpoint} -> {consolidate(args.checkpoint, args.out_dir)}")
    else:
        print(f"exported {args.checkpoint} -> {args.out_dir} ({hf_export(args.checkpoint, args.out_dir, args.family)})")
    return 0


# ---------------------------------------------------------------- looking inside: inspect, prune


def _add_inspect(sub: Subparsers) -> None:
    ins = _command(sub, "inspect", _cmd_inspect, "look inside a model")
    actions = ins.add_subparsers(dest="inspect_command", required=True, metavar="ACTION")
    att = actions.add_parser(
        "attention",
        help="attention heatmaps (PNG, one grid per layer) and per-head entropy, distance, first/previous-token "
        "shares; weights recomputed with an exact eager pass whatever kernel trained the model",
        allow_abbrev=False,
    )
    att.add_argument("path", help="run directory, checkpoint directory or HF model directory")
    att.add_argument("--text", required=True, help="the text to attend over")
    att.add_argument("--layers", default="", help="block indices, e.g. 0,3 or 0-2 (default: all)")
    att.add_argument("--heads", default="", help="head indices, e.g. 0-7 (default: all)")
    att.add_argument("--generate", type=int, default=0, help="also record N greedy decoding steps")
    att.add_argument("--out", default=None, help="output directory (default: PATH/attention)")
    att.add_argument("--window", type=int, default=128, help="longer inputs are drawn in windows of this many tokens")


def _cmd_inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    _no_overrides(f"inspect {args.inspect_command}", overrides)
    from tessera.analysis.inspect import inspect_attention

    print(inspect_attention(args.path, args.text, args.layers, args.heads, args.generate, args.out, args.window))
    return 0


def _add_prune(sub: Subparsers) -> None:
    pr = _command(sub, "prune", _cmd_prune, "make a model smaller")
    actions = pr.add_subparsers(dest="prune_command", required=True, metavar="ACTION")
    heads = actions.add_parser(
        "heads",
        help="remove the least important attention heads (whole KV groups) and write the smaller model as a new run",
        allow_abbrev=False,
        epilog=UPTRAIN_HELP,
    )
    heads.add_argument("run", help="run directory (newest checkpoint) or checkpoint directory")
    heads.add_argument("--metric", choices=("entropy", "gradient"), default="gradient", help="head importance")
    heads.add_argument("--fraction", type=float, default=0.25, help="share of the heads to remove")
    heads.add_argument(
        "--layerwise", action="store_true", help="prune layer by layer, re-measuring after each (default: global)"
    )
    heads.add_argument("--out", required=True, help="new run directory to write")
    heads.add_argument("--batches", type=int, default=0, help="validation batches (default: train.eval_batches)")
    heads.add_argument(
        "--uptrain-fraction", type=float, default=0.05, help="the new run's train.steps as a share of the source's"
    )


def _cmd_prune(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.analysis.prune import prune_heads

    prune_heads(
        args.run,
        args.out,
        args.metric,
        args.fraction,
        args.layerwise,
        args.uptrain_fraction,
        args.batches,
        overrides,  # the new run's up-training recipe
        print,
    )
    return 0


# ---------------------------------------------------------------- plan


def _add_plan(sub: Subparsers) -> None:
    plan = _command(
        sub,
        "plan",
        _cmd_plan,
        "rank the layouts of N GPUs by predicted speed, with memory per GPU and what does not fit",
        epilog=OVERRIDES_HELP,
    )
    plan.add_argument("config", help="TOML recipe; overrides follow as for train")
    plan.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    plan.add_argument("--gpu", required=True, help="GPU kind: a100-40gb, a100-80gb, h100-80gb, h200-141gb, b200")
    plan.add_argument("--nodes-of", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    plan.add_argument(
        "--measure",
        action="store_true",
        help="also measure the best measurable layout on fake ranks (real parallelize)",
    )
    plan.add_argument(
        "--max-layouts",
        type=int,
        default=200_000,
        help="stop the search after this many layouts (the report says so); a progress line every 5 s",
    )


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from tessera.plan.cli import run_plan

    print(
        run_plan(args.config, overrides, args.gpus, args.gpu, args.nodes_of, args.top, args.measure, args.max_layouts)
    )
    return 0


# ---------------------------------------------------------------- entry point

COMMANDS = (
    _add_train,
    _add_launch,
    _add_slurm,
    _add_parity,
    _add_plan,
    _add_status,
    _add_config,
    _add_prepare,
    _add_data,
    _add_tokenizer,
    _add_generate,
    _add_eval,
    _add_compare,
    _add_lm_eval,
    _add_convert,
    _add_inspect,
    _add_prune,
)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose own errors (unknown flag, missing argument) are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``tessera: error: <command>: <message> (see --help)`` on one line and exit with code 2."""
        command = self.prog.removeprefix("tessera").strip()
        where = f"{command}: " if command else ""
        text = " ".join(message.split())
        help_hint = f"tessera {command} --help" if command else "tessera --help"
        self.exit(2, f"tessera: error: {where}{text} (see {help_hint})\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``tessera`` argument parser with every command registered."""
    parser = OneLineParser(
        prog="tessera",
        description="Pretrain transformer language models, from one CPU to a GPU cluster.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    for each in _all_parsers(parser):
        each.formatter_class = DefaultsHelpFormatter
    return parser


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (on/off flags and helps that already name it are left alone)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction)):
            return text
        if action.default in (None, "") and action.option_strings:
            return f"{text} (default: none)"
        return super()._get_help_string(action)


def _unknown_flags(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """A ``--flag`` that is neither an option nor a ``--section.key`` override is a typo: say so (with a guess)."""
    for i, arg in enumerate(extra):
        name = arg.split("=", 1)[0]
        is_value = i > 0 and extra[i - 1].startswith("--") and "." in extra[i - 1] and "=" not in extra[i - 1]
        if name.startswith("--") and "." not in name and not is_value:
            options = [o for p in _all_parsers(parser) for o in p._option_string_actions if o.startswith("--")]
            close = difflib.get_close_matches(name, options, n=1)
            guess = f" (did you mean '{close[0]}'?)" if close and close[0] != name else ""
            guess = " (an option of another command)" if name in options else guess
            raise ConfigError(
                f"unknown option '{name}'{guess}; config overrides are written --section.key VALUE or section.key=VALUE"
            )


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser] + [q for action in subs for p in action.choices.values() for q in _all_parsers(p)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit code (2 for user errors)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not getattr(args, "passthrough", False):  # tessera lm-eval hands its flags to lm-eval untouched
            _unknown_flags(parser, extra)
        return args.handler(args, extra)
    except UserError as err:
        if not record_worker_error(str(err)):  # a worker under `tessera launch`: the launcher prints it once
            print(f"tessera: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tessera config keys | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail again
        return 0
    except OSError as err:  # the machine's refusal (disk full, permissions), not a tessera bug: one line
        where = f": '{err.filename}'" if err.filename else ""
        print(f"tessera: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        from tessera.train.preemption import exit_interrupted

        return exit_interrupted()
    except Exception:
        if peer_failed():  # another worker stopped on a user error: this one's crash is its echo, not news
            return 1
        raise
