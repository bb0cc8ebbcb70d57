#!/usr/bin/env bash
# Train the default pair's drafter on a borrowed NVIDIA GPU machine that has no network, takes files only in small
# loads per command and forgets them a few seconds after the last one. Two routes, chosen by measuring both in the
# first minutes (`measure`):
#   (a) `dflash-mlx train` on MLX's CUDA backend (the MLX wheels travel in pieces);
#   (b) `python -m dflash_mlx.torch_train` in PyTorch (the machine's own torch and transformers), writing a
#       z-lab-layout drafter that `dflash-mlx convert` turns into ours back here.
# The target's GGUF (the exact source of our fp32 weights) and the training prompts travel in pieces too
# (benchmarks/carry.py); the trained drafter comes back the same way.
#
# Here, before the GPU session:
#   bash benchmarks/gpu_train.sh loads DEST       # DEST/00, 01, ...: each one command's load (<= LOAD_MIB)
#   mv dflash_mlx/drafters/qwen2.5-coder-0.5b/model.safetensors /tmp/   # the tree travels with every command
# On the GPU machine, from the repository root, one stage per command (carry DEST/NN with the receive commands):
#   bash benchmarks/gpu_train.sh receive DEST/NN    # once per load
#   bash benchmarks/gpu_train.sh setup              # install, join the GGUF, convert it, unpack the data
#   bash benchmarks/gpu_train.sh measure            # both routes (torch eager and compiled) on one small run: slots/s
#   ROUTE=torch bash benchmarks/gpu_train.sh start  # the background job: answers, training, packing
#   bash benchmarks/gpu_train.sh wait SECONDS       # follow it (returns when it ends)
#   bash benchmarks/gpu_train.sh ship DEST [K]      # the K-th load (0, 1, ...) of pieces to bring back
#   bash benchmarks/gpu_train.sh bench              # if MLX runs on the GPU: `dflash-mlx bench` there, oracle too
# Settings (environment): ROUTE (torch|mlx), ANSWER_MIN, ANSWER_TOKENS, ANSWER_BATCH, TRAIN_MIN, TRAIN_FLAGS,
# TORCH_FLAGS, DATA_TOKENS, MEASURE_TOKENS, WORK, LOAD_MIB, PIECE_MIB.
set -euo pipefail

WORK=${WORK:-/tmp/dflash-gpu}
IN=$WORK/in
ROUTE=${ROUTE:-torch}
ANSWER_MIN=${ANSWER_MIN:-2.5}        # minutes the target spends answering prompts
ANSWER_TOKENS=${ANSWER_TOKENS:-320}  # longest answer
ANSWER_BATCH=${ANSWER_BATCH:-256}
TRAIN_MIN=${TRAIN_MIN:-10}           # minutes of optimizer steps
CALIB_STEPS=${CALIB_STEPS:-16}
# The drafter and recipe (both routes); the data, cache and step count are added below.
SHAPE="--block-size 16 --num-layers 4 --intermediate-size 2432 --draft-vocab 32768 --anchors 128 --rows 4 \
--seq-len 512 --lr 6e-4 --seed 0"
TRAIN_FLAGS=${TRAIN_FLAGS:---labels target $SHAPE --eval-prompts 8 --eval-tokens 96}
TORCH_FLAGS=${TORCH_FLAGS:---labels target $SHAPE --eval-prompts 8 --eval-rows 8 --eval-every 250}
DATA_TOKENS=${DATA_TOKENS:-}        # cap on the training tokens read (empty: all)
MEASURE_TOKENS=${MEASURE_TOKENS:-400000}
PIECE_MIB=${PIECE_MIB:-13}   # pieces carried in either direction
LOAD_MIB=${LOAD_MIB:-52}     # pieces per command (the tree, ~4 MiB without the shipped drafter, travels as well)
GGUF=${GGUF:-$HOME/.cache/dflash-mlx/gguf/qwen2.5-coder-0.5b.gguf}
export DFLASH_MLX_NO_BLAS=${DFLASH_MLX_NO_BLAS-1} PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
DFLASH=("$PY" -m dflash_mlx.cli)
HERE=$(cd "$(dirname "$0")/.." && pwd)

stamp() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# -- here: the loads ----------------------------------------------------------------------------------------------
loads() {  # loads DEST: the GGUF, the wheels (Python 3.12 on the GPU machine) and the data, in command-sized loads
    local dest=$1 stage
    stage=$(mktemp -d)
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF: run 'dflash-mlx models install qwen2.5-coder-0.5b' first" >&2; exit 2; }
    "$PY" benchmarks/carry.py split "$GGUF" "$stage/gguf" --piece-mib "$PIECE_MIB"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
        --platform manylinux_2_17_x86_64 -d "$stage/whl" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 \
        gguf==0.19.0 typer click rich shellingham markdown-it-py mdurl pygments jinja2 markupsafe
    local big
    for big in "$stage"/whl/*.whl; do
        if [ "$(stat -c %s "$big")" -gt $((PIECE_MIB << 20)) ]; then
            "$PY" benchmarks/carry.py split "$big" "$stage/whl" --piece-mib "$PIECE_MIB" && rm "$big"
        fi
    done
    # Training prompts (documented functions of the standard library and of site-packages, benchmark packages
    # left out) and whole modules for --labels target; a disjoint held-out prompt set for τ.
    mkdir -p "$stage/data"
    "$PY" examples/default_drafter_data.py --out "$stage/data/prompts.jsonl" --code 6000 --chat 0 \
        --code-root "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        --code-files "$stage/data/code" --code-bytes 24000000
    "$PY" examples/default_drafter_data.py --out "$stage/heldout.jsonl" --code 400 --chat 0 --offset 6000 \
        --code-root "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # Held out means unseen: drop any prompt whose text occurs in a training module or prompt; keep 32.
    "$PY" - "$stage" <<'PY'
import json, sys
from pathlib import Path
stage = Path(sys.argv[1])
seen = "\n".join(p.read_text(errors="replace") for p in (stage / "data/code").iterdir())
seen += (stage / "data/prompts.jsonl").read_text()
kept = [line for line in (stage / "heldout.jsonl").read_text().splitlines()
        if json.loads(line)["prompt"].strip() not in seen and json.dumps(json.loads(line)["prompt"])[1:-1] not in seen]
(stage / "heldout.jsonl").unlink()
(stage.parent / (stage.name + "-heldout_prompts.jsonl")).write_text("\n".join(kept[:32]) + "\n")
print(f"held-out prompts: {len(kept[:32])} (of {len(kept)} unseen in the training data)")
PY
    tar -czf "$stage/data.tar.gz" -C "$stage/data" .
    rm -rf "$stage/data"
    "$PY" - "$stage" "$dest" "$LOAD_MIB" <<'PY'
import shutil, sys
from pathlib import Path
stage, dest, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) << 20
files = sorted((p for p in stage.rglob("*") if p.is_file()), key=lambda p: (p.suffix == ".json", str(p)))
loads, size = [[]], 0
for f in files:  # in order: manifests last, so a load never holds a manifest before its pieces arrive
    n = f.stat().st_size
    if loads[-1] and size + n > limit:
        loads.append([]); size = 0
    loads[-1].append(f); size += n
for k, group in enumerate(loads):
    folder = dest / f"{k:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    for f in group:
        shutil.copy2(f, folder / f.name)
    print(f"{folder}: {len(group)} files, {sum(f.stat().st_size for f in group) / 2**20:.1f} MiB")
PY
    mv "$stage-heldout_prompts.jsonl" "$dest/heldout_prompts.jsonl"  # stays here: the τ measurement's prompts
    rm -rf "$stage"
}

# -- there: receiving and setting up ------------------------------------------------------------------------------
receive() {  # receive DIR: this command's pieces
    mkdir -p "$IN"
    cp -a "$1"/. "$IN/"
    stamp "in: $(ls "$IN" | wc -l) files, $(du -sh "$IN" | cut -f1)"
}

missing_module() {  # is the module for this wheel importable already? (the machine's own packages win)
    local name
    name=$(basename "$1" | cut -d- -f1 | tr 'A-Z' 'a-z')
    case "$name" in markdown_it_py) name=markdown_it ;; mlx_cuda_13) return 0 ;; esac
    ! "$PY" -c "import $name" 2>/dev/null
}

setup() {  # install what is missing, join and convert the GGUF, unpack the data, smoke-test the GPU
    mkdir -p "$WORK/whl" "$WORK/site" "$WORK/data"
    local manifest w
    for manifest in "$IN"/*.whl.manifest.json; do
        [ -e "$manifest" ] || continue
        "$PY" benchmarks/carry.py join "$manifest" --out "$WORK/whl/$(basename "${manifest%.manifest.json}")"
    done
    cp "$IN"/*.whl "$WORK/whl/" 2>/dev/null || true
    for w in "$WORK"/whl/*.whl; do
        if missing_module "$w"; then "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$w"; fi
    done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$WORK/site" .
    # MLX's CUDA library finds cuBLAS, cuDNN, NCCL... at ../../nvidia/*/lib from itself: the copies torch brought.
    local nv
    nv=$("$PY" -c "import nvidia, os; print([p for p in nvidia.__path__ if os.path.isdir(p)][0])" 2>/dev/null || true)
    [ -n "$nv" ] && [ ! -e "$WORK/site/nvidia" ] && ln -s "$nv" "$WORK/site/nvidia"
    if [ ! -f "$WORK/target.hf/config.json" ]; then
        "$PY" benchmarks/carry.py join "$IN"/*.gguf.manifest.json --out "$WORK/target.gguf"
        "$PY" -c "from dflash_mlx.convert.gguf import convert_gguf_to_hf as c; c('$WORK/target.gguf', '$WORK/target.hf')"
    fi
    [ -f "$IN/data.tar.gz" ] && tar -xzf "$IN/data.tar.gz" -C "$WORK/data"
    stamp "setup done: target $(du -sh "$WORK/target.hf" | cut -f1), data $(ls "$WORK/data" | tr '\n' ' ')"
    smoke_test
}

smoke_test() {
    "$PY" - <<'PY'
import time
import torch
gpu = torch.cuda.is_available()
n = 8192 if gpu else 1024
x = torch.randn(n, n, device="cuda" if gpu else "cpu", dtype=torch.bfloat16)
sync = torch.cuda.synchronize if gpu else (lambda: None)
sync(); tic = time.perf_counter()
for _ in range(20):
    y = x @ x
sync()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if gpu else 'cpu'}: bf16 matmul "
      f"{20 * 2 * n ** 3 / (time.perf_counter() - tic) / 1e12:.1f} TFLOP/s")
try:
    import mlx.core as mx
    n = 4096 if mx.default_device().type == mx.gpu else 512
    a = mx.random.normal((n, n))
    f = mx.compile(lambda x: (x @ x).sum())
    mx.eval(f(a)); tic = time.perf_counter()
    for _ in range(10):
        mx.eval(f(a))
    print(f"mlx {mx.__version__} on {mx.default_device()}: fp32 matmul "
          f"{10 * 2 * n ** 3 / (time.perf_counter() - tic) / 1e12:.3f} TFLOP/s")
except Exception as e:  # route (a) unavailable: say why in one line
    print(f"mlx unavailable: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
PY
}

# -- measuring both routes ----------------------------------------------------------------------------------------
measure() {  # the same drafter on the same small data for a few steps, each route: slots per second
    local small=$WORK/measure
    mkdir -p "$small"
    local compile
    for compile in "" --compile; do
        stamp "route (b), PyTorch ${compile:-(eager)}"
        rm -rf "$small/torch"
        # shellcheck disable=SC2086
        "$PY" -m dflash_mlx.torch_train --target "$WORK/target.hf" --data "$WORK/data/code" --out "$small/torch" \
            $TORCH_FLAGS --max-data-tokens "$MEASURE_TOKENS" --steps 12 --eval-every 0 --checkpoint-every 0 \
            $compile 2>&1 | tail -3
    done
    stamp "route (a), MLX on CUDA"
    rm -rf "$small/mlx" "$small/mlx-cache"
    [ -f "$WORK/target.mlx/config.json" ] || "${DFLASH[@]}" convert --gguf "$WORK/target.gguf" "$WORK/target.mlx" --dtype fp32
    # shellcheck disable=SC2086
    "${DFLASH[@]}" train --target "$WORK/target.mlx" --data "$WORK/data/code" --cache "$small/mlx-cache" \
        --out "$small/mlx" $TRAIN_FLAGS --max-data-tokens "$MEASURE_TOKENS" --steps 12 --eval-every 0 --checkpoint-every 0 \
        --eval-tokens 4 2>&1 | tr '\r' '\n' | grep -E "s/step|slots|device|rror" | tail -4
}

# -- the job ------------------------------------------------------------------------------------------------------
pipeline_torch() {
    local t0
    t0=$(date +%s)
    stamp "answers: ${ANSWER_MIN} min, at most ${ANSWER_TOKENS} tokens each"
    "$PY" -m dflash_mlx.torch_train.answer --target "$WORK/target.hf" --prompts "$WORK/data/prompts.jsonl" \
        --out "$WORK/data/answers.jsonl" --max-tokens "$ANSWER_TOKENS" --batch "$ANSWER_BATCH" --minutes "$ANSWER_MIN"
    stamp "training: $TRAIN_MIN min"
    # shellcheck disable=SC2086
    "$PY" -m dflash_mlx.torch_train --target "$WORK/target.hf" --data "$WORK/data/answers.jsonl" \
        --data "$WORK/data/code" --out "$WORK/run" $TORCH_FLAGS --minutes "$TRAIN_MIN" --checkpoint-every 500 \
        ${DATA_TOKENS:+--max-data-tokens "$DATA_TOKENS"}
    pack
    stamp "pipeline done in $(( $(date +%s) - t0 )) s"
}

pipeline_mlx() {
    local t0 calib_log seconds steps flags
    t0=$(date +%s)
    [ -f "$WORK/target.mlx/config.json" ] || "${DFLASH[@]}" convert --gguf "$WORK/target.gguf" "$WORK/target.mlx" --dtype fp32
    stamp "answers: ${ANSWER_MIN} min, at most ${ANSWER_TOKENS} tokens each"
    "$PY" examples/answer_prompts.py --target "$WORK/target.mlx" --prompts "$WORK/data/prompts.jsonl" \
        --out "$WORK/data/answers.jsonl" --max-tokens "$ANSWER_TOKENS" --batch "$ANSWER_BATCH" --minutes "$ANSWER_MIN"
    stamp "calibration: $CALIB_STEPS steps (features are built first and kept for the real run)"
    calib_log=$WORK/calibration.log
    flags=""
    # shellcheck disable=SC2046,SC2086
    if ! "${DFLASH[@]}" train --target "$WORK/target.mlx" --data "$WORK/data/answers.jsonl" --data "$WORK/data/code" \
            --cache "$WORK/features" $TRAIN_FLAGS --out "$WORK/calib" --steps "$CALIB_STEPS" --eval-every 0 \
            --checkpoint-every 0 --eval-tokens 4 2>&1 | tee "$calib_log"; then
        stamp "calibration failed with the compiled step: trying --no-compile"
        flags="--no-compile"
        rm -rf "$WORK/calib"
        # shellcheck disable=SC2086
        "${DFLASH[@]}" train --target "$WORK/target.mlx" --data "$WORK/data/answers.jsonl" --data "$WORK/data/code" \
            --cache "$WORK/features" $TRAIN_FLAGS --out "$WORK/calib" --steps "$CALIB_STEPS" --eval-every 0 \
            --checkpoint-every 0 --eval-tokens 4 $flags 2>&1 | tee "$calib_log"
    fi
    # Evaluations (every quarter) and checkpoints cost ~5% on top of the steps.
    seconds=$(grep -oE "[0-9.]+ s/step after the first" "$calib_log" | tail -1 | awk '{print $1}')
    steps=$(awk -v s="$seconds" -v m="$TRAIN_MIN" 'BEGIN{print int(0.95 * m * 60 / s)}')
    stamp "calibration: $seconds s/step -> $steps steps for $TRAIN_MIN min"
    # shellcheck disable=SC2086
    "${DFLASH[@]}" train --target "$WORK/target.mlx" --data "$WORK/data/answers.jsonl" --data "$WORK/data/code" \
        --cache "$WORK/features" $TRAIN_FLAGS --out "$WORK/run" --steps "$steps" \
        --eval-every $((steps / 4 > 0 ? steps / 4 : 1)) --checkpoint-every $((steps / 2 > 0 ? steps / 2 : 1)) \
        --max-minutes "$(awk -v m="$TRAIN_MIN" 'BEGIN{print m + 2}')" --dtype bf16 $flags
    pack
    stamp "pipeline done in $(( $(date +%s) - t0 )) s"
}

bench_gpu() {  # MLX on CUDA: the default pair's bench there (oracle and the new drafter) with the pass costs
    [ -f "$WORK/target.mlx/config.json" ] || "${DFLASH[@]}" convert --gguf "$WORK/target.gguf" "$WORK/target.mlx" --dtype fp32
    "${DFLASH[@]}" bench --model "$WORK/target.mlx" --draft "$WORK/run" --num-prompts 20 --max-tokens 128 --oracle \
        --profile-prompts 3 --verify-prompts 3 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -40
}

pack() {  # loads to bring back: load 0 = metadata + the first pieces of the drafter (bf16), then the rest
    local ship=$WORK/ship
    rm -rf "$ship" && mkdir -p "$ship/bf16"
    "$PY" benchmarks/carry.py split "$WORK/run/model.safetensors" "$ship/bf16" --piece-mib "$PIECE_MIB"
    tar -czf "$ship/meta.tar.gz" -C "$WORK" \
        $(cd "$WORK" && ls run/config.json run/README.md run/tau_curve.png run/log.jsonl run/train_args.json \
          run/eval_prompts.json run/train_state/*/trainer.json calibration.log job.log 2>/dev/null) \
        -C "$ship" bf16/model.safetensors.manifest.json
}

ship() {  # ship DEST K: the K-th load of at most LOAD_MIB / PIECE_MIB pieces (load 0 also carries meta.tar.gz)
    local dest=$1 k=${2:-0} per pieces
    per=$((LOAD_MIB / PIECE_MIB))
    pieces=$(ls "$WORK"/ship/bf16/*.part* | sed -n "$((k * per + 1)),$((k * per + per))p")
    mkdir -p "$dest"
    [ "$k" = 0 ] && cp "$WORK/ship/meta.tar.gz" "$dest/"
    for p in $pieces; do cp "$p" "$dest/"; done
    stamp "load $k: $(ls "$dest" | tr '\n' ' ')"
}

cd "$HERE"
case "${1:-}" in
    loads) loads "$2" ;;
    receive) receive "$2" ;;
    setup) setup ;;
    measure) measure ;;
    start)
        setsid nohup bash "$0" "pipeline-$ROUTE" >"$WORK/job.log" 2>&1 </dev/null &
        stamp "started the $ROUTE job (log: $WORK/job.log)" ;;
    pipeline-torch) pipeline_torch ;;
    pipeline-mlx) pipeline_mlx ;;
    pack) pack ;;
    bench) bench_gpu ;;
    wait)
        end=$(( $(date +%s) + ${2:-60} ))
        while [ "$(date +%s)" -lt "$end" ] && ! grep -q "pipeline done\|Error\|Traceback\|^error" "$WORK/job.log"; do
            sleep 5
        done
        tail -c 3000 "$WORK/job.log" | tr '\r' '\n' | tail -25 ;;
    ship) ship "$2" "${3:-0}" ;;
    *) sed -n '2,23p' "$0"; exit 2 ;;
esac
