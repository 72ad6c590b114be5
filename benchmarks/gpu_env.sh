# What benchmarks/smol_gpu.sh and benchmarks/gpu_session.sh share, sourced by both: where they work on
# the GPU machine, the folder of files they carry there (each script its own names in it), SmolLM2's
# GGUF and its import.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=${KLSTUDY_GPU_WORK:-/tmp/klstudy-gpu}
CARRY=results/gpu-carry
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL=$WORK/SmolLM2-135M-Instruct
OUT=${OUT:-$WORK/out}
export PYTHONPATH="$PWD:$WORK/site"

import_smollm2() {  # import_smollm2 GGUF_FILE: checked against its SHA-256, imported into $MODEL once
    echo "$SHA256  $1" | sha256sum -c || return 1
    [ -d "$MODEL" ] || $PY -m trainer import-gguf "$1" --out "$MODEL"
}
