#!/usr/bin/env bash
# Train the default pair's drafter on a borrowed NVIDIA GPU machine that has no network and takes files only in
# small loads per command: the target's GGUF, the MLX CUDA wheels and the training data arrive in pieces
# (benchmarks/carry.py) over several commands, then one background job answers prompts with the target, builds the
# feature cache, calibrates the step time, trains with `dflash-mlx train` on MLX's CUDA backend for a fixed time,
# quantizes the drafter to 8 bits and cuts it into pieces small enough to bring back.
#
# Run from the repository root, one stage per command:
#   bash benchmarks/gpu_train.sh receive DIR      # copy this command's pieces (a carried folder) into the work folder
#   bash benchmarks/gpu_train.sh setup-mlx        # join and install the wheels, smoke-test MLX on the GPU
#   bash benchmarks/gpu_train.sh setup            # join the target's GGUF, convert it, unpack the data
#   bash benchmarks/gpu_train.sh start            # start the background job (returns at once)
#   bash benchmarks/gpu_train.sh wait SECONDS     # follow the job's log for up to SECONDS (returns when it ends)
#   bash benchmarks/gpu_train.sh ship DEST [K]    # copy the K-th load (0, 1, ...) of pieces to bring back into DEST
# Settings (environment): ANSWER_MIN, ANSWER_TOKENS, TRAIN_MIN, TRAIN_FLAGS, TARGET_DIR (skip the GGUF), WORK.
set -euo pipefail

WORK=${WORK:-/tmp/dflash-gpu}
IN=$WORK/in
TARGET_DIR=${TARGET_DIR:-$WORK/target}
ANSWER_MIN=${ANSWER_MIN:-2.5}        # minutes the target spends answering prompts
ANSWER_TOKENS=${ANSWER_TOKENS:-320}  # longest answer
ANSWER_BATCH=${ANSWER_BATCH:-256}
TRAIN_MIN=${TRAIN_MIN:-10}           # minutes of optimizer steps (after calibration)
CALIB_STEPS=${CALIB_STEPS:-16}
# The drafter and recipe; the data, cache and step count are added below.
TRAIN_FLAGS=${TRAIN_FLAGS:---labels target --block-size 16 --num-layers 4 --intermediate-size 2432 \
--draft-vocab 32768 --anchors 128 --rows 4 --seq-len 512 --lr 6e-4 --eval-prompts 8 --eval-tokens 96 --seed 0}
PIECE_MIB=15
export DFLASH_MLX_NO_BLAS=${DFLASH_MLX_NO_BLAS-1} PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
DFLASH=("$PY" -m dflash_mlx.cli)

stamp() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

receive() {  # receive DIR: this command's pieces
    mkdir -p "$IN"
    cp -a "$1"/. "$IN/"
    stamp "in: $(ls "$IN" | wc -l) files, $(du -sh "$IN" | cut -f1)"
}

setup_mlx() {  # the wheels (MLX, its CUDA backend, mlx-lm, gguf) and this package, then a smoke test
    mkdir -p "$WORK/whl" "$WORK/site"
    for manifest in "$IN"/*.whl.manifest.json; do
        [ -e "$manifest" ] || continue
        "$PY" benchmarks/carry.py join "$manifest" --out "$WORK/whl/$(basename "${manifest%.manifest.json}")"
    done
    cp "$IN"/*.whl "$WORK/whl/" 2>/dev/null || true
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/whl/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$WORK/site" .
    smoke_test
}

setup() {  # the target (GGUF -> fp32 mlx-lm folder) and the data
    if [ ! -f "$TARGET_DIR/config.json" ]; then
        "$PY" benchmarks/carry.py join "$IN"/*.gguf.manifest.json --out "$WORK/target.gguf"
        "${DFLASH[@]}" convert --gguf "$WORK/target.gguf" "$TARGET_DIR" --dtype fp32
    fi
    mkdir -p "$WORK/data"
    if [ -f "$IN/data.tar.gz" ]; then tar -xzf "$IN/data.tar.gz" -C "$WORK/data"; fi
    stamp "setup done: target $(du -sh "$TARGET_DIR" | cut -f1), data $(ls "$WORK/data" | tr '\n' ' ')"
}

smoke_test() {
    "$PY" - <<'PY'
import time
import mlx.core as mx
print("mlx", mx.__version__, "default device", mx.default_device(), mx.device_info(mx.default_device()))
a = mx.random.normal((4096, 4096))
f = mx.compile(lambda x: (x @ x).sum())
mx.eval(f(a))
tic = time.perf_counter()
for _ in range(10):
    mx.eval(f(a))
dt = (time.perf_counter() - tic) / 10
print(f"fp32 4096^3 matmul: {2 * 4096 ** 3 / dt / 1e12:.1f} TFLOP/s")
PY
}

train_cmd() {  # the common part of every `dflash-mlx train` call
    # shellcheck disable=SC2086
    echo "${DFLASH[@]}" train --target "$TARGET_DIR" --data "$WORK/data/answers.jsonl" --data "$WORK/data/code" \
        --cache "$WORK/features" $TRAIN_FLAGS
}

pipeline() {
    local t0 answers calib_log seconds steps flags
    t0=$(date +%s)
    stamp "answers: ${ANSWER_MIN} min, at most ${ANSWER_TOKENS} tokens each"
    "$PY" examples/answer_prompts.py --target "$TARGET_DIR" --prompts "$WORK/data/prompts.jsonl" \
        --out "$WORK/data/answers.jsonl" --max-tokens "$ANSWER_TOKENS" --batch "$ANSWER_BATCH" \
        --minutes "$ANSWER_MIN"
    stamp "calibration: $CALIB_STEPS steps (features are built first and kept for the real run)"
    calib_log=$WORK/calibration.log
    flags=""
    # shellcheck disable=SC2046
    if ! $(train_cmd) --out "$WORK/calib" --steps "$CALIB_STEPS" --eval-every 0 --checkpoint-every 0 \
            --eval-tokens 4 2>&1 | tee "$calib_log"; then
        stamp "calibration failed with the compiled step: trying --no-compile"
        flags="--no-compile"
        rm -rf "$WORK/calib"
        # shellcheck disable=SC2046
        $(train_cmd) --out "$WORK/calib" --steps "$CALIB_STEPS" --eval-every 0 --checkpoint-every 0 \
            --eval-tokens 4 $flags 2>&1 | tee "$calib_log"
    fi
    # Evaluations (every quarter) and checkpoints cost ~5% on top of the steps.
    seconds=$(grep -oE "[0-9.]+ s/step after the first" "$calib_log" | tail -1 | awk '{print $1}')
    steps=$(awk -v s="$seconds" -v m="$TRAIN_MIN" 'BEGIN{print int(0.95 * m * 60 / s)}')
    stamp "calibration: $seconds s/step -> $steps steps for $TRAIN_MIN min"
    # shellcheck disable=SC2046
    $(train_cmd) --out "$WORK/run" --steps "$steps" --eval-every $((steps / 4 > 0 ? steps / 4 : 1)) \
        --checkpoint-every $((steps / 2 > 0 ? steps / 2 : 1)) --max-minutes "$(awk -v m="$TRAIN_MIN" 'BEGIN{print m + 2}')" \
        --dtype bf16 $flags
    stamp "quantizing to 8 bits"
    "${DFLASH[@]}" convert "$WORK/run" "$WORK/drafter8" --dtype bf16 --quantize --q-bits 8
    cp "$WORK/run/README.md" "$WORK/drafter8/"
    [ -f "$WORK/run/tau_curve.png" ] && cp "$WORK/run/tau_curve.png" "$WORK/drafter8/"
    pack
    stamp "pipeline done in $(( $(date +%s) - t0 )) s"
}

pack() {  # loads to bring back: 0 = metadata + first pieces of the 8-bit drafter, then the rest, then bf16
    local ship=$WORK/ship
    rm -rf "$ship" && mkdir -p "$ship/q8" "$ship/bf16"
    "$PY" benchmarks/carry.py split "$WORK/drafter8/model.safetensors" "$ship/q8" --piece-mib "$PIECE_MIB"
    "$PY" benchmarks/carry.py split "$WORK/run/model.safetensors" "$ship/bf16" --piece-mib "$PIECE_MIB"
    tar -czf "$ship/meta.tar.gz" -C "$WORK" drafter8/config.json drafter8/README.md run/config.json \
        $(cd "$WORK" && ls drafter8/tau_curve.png run/train_state/*/trainer.json 2>/dev/null) \
        calibration.log $(cd "$WORK" && ls job.log 2>/dev/null) -C "$ship" q8/model.safetensors.manifest.json bf16/model.safetensors.manifest.json
}

ship() {  # ship DEST K: the K-th load of at most 4 pieces (load 0 also carries meta.tar.gz)
    local dest=$1 k=${2:-0} pieces
    pieces=$(ls "$WORK"/ship/q8/*.part* "$WORK"/ship/bf16/*.part* | sed -n "$((k * 4 + 1)),$((k * 4 + 4))p")
    mkdir -p "$dest"
    [ "$k" = 0 ] && cp "$WORK/ship/meta.tar.gz" "$dest/"
    for p in $pieces; do cp "$p" "$dest/$(basename "$(dirname "$p")")-$(basename "$p")"; done
    stamp "load $k: $(ls "$dest" | tr '\n' ' ')"
}

case "${1:-}" in
    receive) receive "$2" ;;
    setup-mlx) setup_mlx ;;
    setup) setup ;;
    start)
        setsid nohup bash "$0" pipeline >"$WORK/job.log" 2>&1 </dev/null &
        stamp "started the job (log: $WORK/job.log)" ;;
    pipeline) pipeline ;;
    pack) pack ;;
    wait)
        end=$(( $(date +%s) + ${2:-60} ))
        while [ "$(date +%s)" -lt "$end" ] && ! grep -q "pipeline done\|Error\|Traceback" "$WORK/job.log"; do sleep 5; done
        tail -c 3000 "$WORK/job.log" | tr '\r' '\n' | tail -25 ;;
    ship) ship "$2" "${3:-0}" ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
esac
