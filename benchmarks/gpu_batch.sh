#!/usr/bin/env bash
# The GPU measurements the open issues (31, 32, 35) need, in three parts that each fit one
# 10-minute device command with the set-up, writing into OUT (the device tool's $OUT). Assumes
# the project and its GPU wheels are installed and two checkpoints exist:
#   L1B  (default /tmp/l1b):  splitserve make-model --preset llama-3.2-1b /tmp/l1b
#   L1B3 (default /tmp/l1b3): python benchmarks/llama3_checkpoint.py /tmp/l1b TOKENIZER /tmp/l1b3
# (Llama 3's tiktoken file; benchmarks/bench_vocab.py says where to get it).
#
#   bash benchmarks/gpu_batch.sh a   # GPU tests of the prefill graphs, issue 31's prefill table
#   bash benchmarks/gpu_batch.sh b   # the dense 512 A/B (both in one run), issue 35, issue 32
#   bash benchmarks/gpu_batch.sh c   # where the first prompt's extra goes (thread stacks)
# Each step has its own time limit and logs to OUT/<step>.log; a step that fails does not stop
# the next. Compare timings only within one part's run (one machine).
set -u
part=${1:?usage: gpu_batch.sh a|b|c}
out=${OUT:?set OUT to a folder}
l1b=${L1B:-/tmp/l1b}
l1b3=${L1B3:-/tmp/l1b3}
start=$(date +%s)

step() {  # step NAME SECONDS CMD... : runs CMD with a limit, says how it ended and when
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? at $(($(date +%s) - start)) s"
}

nvidia-smi --query-gpu=name --format=csv,noheader
case $part in
a)
    step gpu_tests 150 python3 -m pytest -q -m gpu -x tests/test_prefill_graphs_gpu.py \
        tests/kernels/test_triton_gpu.py tests/prefill_worker/test_prefill_warmup_gpu.py \
        tests/decode_worker/test_colocated_warmup_gpu.py
    tail -3 "$out/gpu_tests.log"
    step prefill 400 python3 benchmarks/prefill.py --model-dir "$l1b" --lengths 128,1024,8192 \
        --out "$out/prefill.json" --fast-out "$out/prefill_fast.json"
    grep -E "^fast|first" "$out/prefill.log" | tail -8
    ;;
b)
    step prefill_dense512 200 python3 benchmarks/prefill.py --model-dir "$l1b" --lengths 1024 \
        --mixed "" --no-transformers --fast-cases 1x512,1x1024 --dense-min-tokens 512 \
        --first-prompt-len 0 --fast-out "$out/prefill_fast_dense512.json"
    grep -E "^fast" "$out/prefill_dense512.log"
    step structured 110 python3 benchmarks/decode.py --model-dir "$l1b3" --constrained \
        --batch-sizes 2,64 --out "$out/structured.json"
    step kv_streaming 140 python3 benchmarks/kv_streaming.py --model-dir "$l1b" --iters 5 \
        --out "$out/kv_handover.json"
    step kvtransfer 90 python3 benchmarks/kvtransfer.py --out "$out/kv_handover.json"
    ;;
c)
    step first_stacks 200 python3 benchmarks/prefill_first_prompt_stacks.py --model-dir "$l1b" \
        --length 3072
    cat "$out/first_stacks.log"
    ;;
*)
    echo "unknown part $part: a, b or c" >&2
    exit 2
    ;;
esac
