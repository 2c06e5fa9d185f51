#!/usr/bin/env bash
# The checks only a CUDA machine can settle, in one script (under 8 minutes on one H100/H200; never run yet).
# Run from the repository root with tessera installed:  bash benchmarks/gpu_check.sh
# Each check prints one summary line "CHECK <name>: ok|FAIL|skip <detail>"; full logs go to
# $OUT (default /tmp/tessera-gpu-check). The exit code is the number of failed checks.
set -uo pipefail
OUT=${OUT:-/tmp/tessera-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failures=0
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")

summary() {  # summary NAME STATUS DETAIL
    echo "CHECK $1: $2 $3"
    [ "$2" = "FAIL" ] && failures=$((failures + 1))
    return 0
}

run_check() {  # run_check NAME TIMEOUT_S COMMAND... ; the command's last line is the detail
    local name=$1 limit=$2
    shift 2
    if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
        summary "$name" ok "$(tail -n 1 "$OUT/$name.log")"
    else
        summary "$name" FAIL "(exit $?, see $OUT/$name.log) $(tail -n 1 "$OUT/$name.log")"
    fi
}

if [ "$GPUS" = "0" ]; then
    echo "no CUDA device visible: nothing to check"; exit 1
fi
echo "tessera GPU check: $GPUS GPU(s), $(python -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

# 1. Throughput of the Trainer step against a bare loop, HF LlamaForCausalLM and HF Trainer, bf16 (ratios printed).
run_check throughput 180 python benchmarks/throughput.py --device cuda --dtype bf16 --threads 4 --steps 5 --rounds 3

# 1b. Issue 18: a 1B-parameter Llama (Llama-3.2-1B shape, untied head: 1.24B in matmuls), seq 4096, bf16, one GPU:
#     tokens/s and MFU of the Trainer step eager vs compiled (parallel.compile), compile time and break-even.
#     --peak-tflops 989: H100/H200 SXM dense bf16. The last line is the compiled run's MFU.
run_check llama1b_mfu 300 python benchmarks/throughput.py --device cuda --dtype bf16 --threads 4 \
    --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 4096 --batch 4 \
    --contenders trainer,trainer-compiled --compile false --warmup 2 --steps 5 --rounds 3 --peak-tflops 989
grep -E "tok/s|MFU|compile:" "$OUT/llama1b_mfu.log"

# 2. The smoke recipe on cuda, end to end (tokenizer, data, train, checkpoint, sample).
run_check smoke_cuda 240 python -m tessera train configs/smoke.toml train.device=cuda \
    "train.run_dir=$OUT/smoke" train.resume=none log.progress=lines

# 3. bf16 vs fp32 parity on one GPU, and FSDP x TP in bf16 on NCCL when there are >= 4 GPUs.
RECIPE="$OUT/parity.toml"
python -m tessera train configs/smoke.toml --print-config train.steps=5 optim.warmup_steps=1 \
    model.n_layers=4 train.batch_size=8 train.device=cuda > "$RECIPE"
if [ "$GPUS" -ge 4 ]; then
    run_check fsdp_tp_bf16 300 python -m tessera parity "$RECIPE" --layouts "dp_shard=1" "dp_shard=2,tp=2" \
        train.dtype=bf16 --steps 5 --rtol 1e-2
else
    run_check bf16_vs_fp32_cuda 300 python - "$OUT" <<'PY'
import json, subprocess, sys
out = sys.argv[1]
runs = {}
for dtype in ("fp32", "bf16"):
    subprocess.run([sys.executable, "-m", "tessera", "train", f"{out}/parity.toml", f"train.dtype={dtype}",
                    f"train.run_dir={out}/prec_{dtype}", "train.resume=none", "log.progress=none"], check=True)
    runs[dtype] = [json.loads(line) for line in open(f"{out}/prec_{dtype}/metrics.jsonl") if '"loss"' in line]
rel = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(runs["bf16"], runs["fp32"]))
print(f"bf16 vs fp32 on cuda: max rel loss diff {rel:.2e} over {len(runs['fp32'])} steps (bound 5e-3)")
sys.exit(0 if 0 < rel < 5e-3 else 1)
PY
fi

# 4. FSDP with CPU offload (FSDP2's CPUOffloadPolicy needs CUDA and >= 2 ranks).
if [ "$GPUS" -ge 2 ]; then
    run_check fsdp_cpu_offload 240 python -m tessera parity "$RECIPE" --layouts "dp_shard=2" \
        "dp_shard=2,cpu_offload=true" --steps 5 --rtol 1e-5
else
    summary fsdp_cpu_offload skip "needs >= 2 GPUs (FSDP shards over ranks; one GPU cannot host two NCCL ranks)"
fi

# 5. The pipeline bubble benchmark (schedules timed with sleep stages; gloo on CPU processes).
run_check pipeline_bubble 240 python benchmarks/pipeline.py --cost-ms 20 --steps 2

echo "gpu_check: $failures failed check(s); logs in $OUT"
exit "$failures"
