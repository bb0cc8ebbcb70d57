#!/usr/bin/env bash
# Time the engine on a borrowed NVIDIA GPU machine through MLX's CUDA backend, in one 15-minute stay: no network,
# at most 64 MiB carried per command (the working tree included), files kept only while commands follow each other
# within seconds, at most 8 files of 16 MiB back from the last command. What travels: MLX's CUDA wheel (~86 MiB) with
# the mlx, mlx-lm and gguf wheels, the default pair's target as its GGUF (the exact source of our fp32 weights), the
# shipped drafter and the engine's own tokenizer files, cut by `benchmarks/carry.py pack` into command-sized loads.
# The first command starts, in the background, joining and installing MLX (and a CUDA smoke test) while the other
# loads arrive; the last one converts the target and runs, within its budget, what the figures are for:
#   tree_cost.py   one verify pass by rows, 1-17, as a chain and as a tree, in decode steps
#   bench          8 HumanEval prompts x 128 tokens, then 8 editing prompts: plain (mlx-lm), the drafter alone (chains,
#                  trees), the defaults (drafter + lookup, trees chosen by speed), lookup alone, fixed widths and trees
#
# Here, before the stay (the shipped drafter moved aside so the tree stays small; it travels in the loads):
#   bash benchmarks/gpu_engine.sh loads .gpu          # .gpu/00, 01, ...: one load per command (<= LOAD_MIB)
#   mv dflash_mlx/drafters/qwen2.5-coder-0.5b/model.safetensors /tmp/
# There, one command each, back to back (carry .gpu/NN):
#   bash benchmarks/gpu_engine.sh receive .gpu/00 --prepare   # + starts installing MLX in the background
#   bash benchmarks/gpu_engine.sh receive .gpu/NN             # the middle loads (a failed one: send it again)
#   BUDGET_S=S bash benchmarks/gpu_engine.sh main .gpu/LAST   # the last load, then everything, done S s after it
#                                                             # starts; logs and bench.json files land in $OUT
# Rehearse here first (CPU stand-in for the CUDA wheel, this machine's Python):
#   BACKEND_WHEEL=mlx-cpu PYVER=3.11 bash benchmarks/gpu_engine.sh loads /tmp/reh-loads
#   WORK=/tmp/reh OUT=/tmp/reh-out PY=python SMALL=1 ... receive/main as above
# Settings (environment): BACKEND_WHEEL, PYVER, LOAD_MIB, PROMPTS_N, MAX_TOKENS, SMALL, WORK, OUT, PY.
set -euo pipefail

WORK=${WORK:-/tmp/dflash-engine}
IN=$WORK/in
OUT=${OUT:-$WORK/out}
BACKEND_WHEEL=${BACKEND_WHEEL:-mlx-cuda-13}  # mlx-cpu: the CPU stand-in for a rehearsal
PYVER=${PYVER:-3.12}                         # the GPU machine's Python
MLX_VERSION=${MLX_VERSION:-0.32.4}
MLX_LM_VERSION=${MLX_LM_VERSION:-0.32.2}
LOAD_MIB=${LOAD_MIB:-56}                     # one command's pieces (the tree, ~6 MiB without the drafter, too)
PROMPTS_N=${PROMPTS_N:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
SMALL=${SMALL:-}                             # a rehearsal: 1 prompt x 16 tokens, 3 row counts
MODEL=qwen2.5-coder-0.5b
GGUF=${GGUF:-$HOME/.cache/dflash-mlx/gguf/$MODEL.gguf}
TARGET_DIR=${TARGET_DIR:-$HOME/.cache/dflash-mlx/models/$MODEL}  # the engine's target, here
export PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH} DFLASH_MLX_HOME=$WORK/home
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SELF=$HERE/benchmarks/$(basename "$0")  # absolute: the background job starts after the cd below
DRAFTER=$HERE/dflash_mlx/drafters/$MODEL

stamp() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# -- here ---------------------------------------------------------------------------------------------------------
loads() {  # loads DEST: the wheels first (installed while the rest arrives), then the GGUF, the drafter, tokenizer
    local dest=$1 stage weights
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF: run 'dflash-mlx models install $MODEL' first" >&2; exit 2; }
    weights=$DRAFTER/model.safetensors
    [ -f "$weights" ] || weights=${DRAFTER_WEIGHTS:-/tmp/model.safetensors}
    [ -f "$weights" ] || { echo "no drafter weights at $DRAFTER or \$DRAFTER_WEIGHTS" >&2; exit 2; }
    stage=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 -d "$stage" \
        "$BACKEND_WHEEL==$MLX_VERSION" "mlx==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION" gguf==0.19.0
    tar -cJf "$stage/tokenizer.tar.xz" -C "$TARGET_DIR" tokenizer.json tokenizer_config.json \
        $(cd "$TARGET_DIR" && ls chat_template.jinja 2>/dev/null)
    cp "$weights" "$stage/drafter.safetensors"
    rm -rf "$dest"
    "$PY" benchmarks/carry.py pack "$dest" "$stage"/*.whl "$GGUF" "$stage/drafter.safetensors" \
        "$stage/tokenizer.tar.xz" --load-mib "$LOAD_MIB"
    rm -rf "$stage"
}

# -- there --------------------------------------------------------------------------------------------------------
receive() {  # receive DIR: this command's pieces (sending a load again overwrites what arrived of it)
    mkdir -p "$IN"
    cp -a "$1"/. "$IN/"
    stamp "in: $(ls "$IN" | wc -l) files, $(du -sh "$IN" | cut -f1)"
}

joined() {  # joined NAME: join IN/NAME from its pieces once they are all there (0), else 1
    [ -f "$IN/$1" ] && return 0
    [ -f "$IN/$1.manifest.json" ] || return 1
    "$PY" "$HERE/benchmarks/carry.py" join "$IN/$1.manifest.json" >/dev/null
}

prepare() {  # install MLX from the carried wheels as soon as they have all arrived; dflash-mlx beside them
    local t0 wheel
    t0=$(date +%s)
    until wheel=$(ls "$IN" | grep -E "^${BACKEND_WHEEL//-/_}-.*\.whl" | sed 's/\.manifest\.json$//; s/\.part[0-9]*$//' \
            | head -1) && [ -n "$wheel" ] && joined "$wheel"; do
        [ "$(date +%s)" -lt $((t0 + 600)) ] || { stamp "the $BACKEND_WHEEL wheel never arrived whole"; exit 1; }
        sleep 2
    done
    mkdir -p "$WORK/site" "$WORK/home/gguf"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$IN/$wheel" "$IN"/mlx-*.whl \
        "$IN"/mlx_lm-*.whl "$IN"/gguf-*.whl
    # dflash-mlx as its wheel would lay it out (convert/ and metal/ inside the package), without building one.
    rm -rf "$WORK/site/dflash_mlx"
    cp -r "$HERE/dflash_mlx" "$WORK/site/dflash_mlx"
    cp -r "$HERE/convert" "$WORK/site/dflash_mlx/convert"
    cp -r "$HERE/metal" "$WORK/site/dflash_mlx/metal"
    stamp "installed in $(( $(date +%s) - t0 )) s"
    : >"$WORK/env.sh"
    if ! smoke; then  # the CUDA libraries may sit in the nvidia packages' folders, off the loader's path
        local libs
        libs=$("$PY" -c 'import glob, os, site; print(":".join(sorted(d for p in site.getsitepackages()
for d in glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
        echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" >"$WORK/env.sh"
        stamp "retrying with the nvidia packages' libraries on LD_LIBRARY_PATH"
        # shellcheck disable=SC1091
        . "$WORK/env.sh"
        smoke || { stamp "MLX does not start here"; exit 1; }
    fi
    touch "$WORK/prepared"
}

smoke() {  # MLX starts and multiplies on its default device
    (cd "$WORK" && "$PY" -c "import mlx.core as mx; a = mx.random.normal((2048, 2048)); mx.eval(a @ a); \
print('mlx', mx.__version__, 'device', mx.default_device())")
}

left() { echo $(( END - $(date +%s) )); }

step() {  # step NAME SHARE CMD...: CMD with at most SHARE percent of the time left (and no more than is left)
    local name=$1 share=$2 limit
    shift 2
    limit=$(( $(left) * share / 100 ))
    [ "$limit" -ge 20 ] || { stamp "skipped $name: ${limit} s would be too little"; return 0; }
    stamp "$name (at most ${limit} s): $*"
    (cd "$WORK" && timeout -k 5 "$limit" "$@") || stamp "$name stopped (status $?)"
}

main_job() {  # main: convert the target, place the drafter, then the figures, each within its share of the budget
    while [ ! -f "$WORK/prepared" ]; do
        [ "$(left)" -gt 60 ] || { stamp "prepare did not finish:"; cat "$WORK/prepare.log"; exit 1; }
        sleep 1
    done
    # shellcheck disable=SC1091
    [ -f "$WORK/env.sh" ] && . "$WORK/env.sh"  # what made MLX start in `prepare`, if anything
    joined "$MODEL.gguf" && joined drafter.safetensors
    mv -f "$IN/$MODEL.gguf" "$WORK/home/gguf/$MODEL.gguf"
    local target
    target=$(cd "$WORK" && "$PY" -c "from dflash_mlx.models.offline import ensure_offline_model as e; \
print(e('$MODEL', progress=False, quiet=True))")
    tar -xJf "$IN/tokenizer.tar.xz" -C "$target"  # the engine's own token ids, whatever transformers is there
    cp "$IN/drafter.safetensors" "$WORK/site/dflash_mlx/drafters/$MODEL/model.safetensors"
    stamp "target converted: $(du -sh "$target" | cut -f1); $(left) s left"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
    local n=$PROMPTS_N tokens=$MAX_TOKENS rows=2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 reps=9
    [ -z "$SMALL" ] || { n=1; tokens=16; rows=2,8,16; reps=2; }
    local methods=(--tree-budget auto,7,15 --widths 4,8,16 --no-profile --verify-prompts 0)
    step tree_cost 15 "$PY" "$HERE/benchmarks/tree_cost.py" --rows "$rows" --reps "$reps"
    step humaneval 60 "$PY" -m dflash_mlx.cli bench --prompts humaneval --num-prompts "$n" --max-tokens "$tokens" \
        "${methods[@]}" --out "$OUT/humaneval"
    step editing 90 "$PY" -m dflash_mlx.cli bench --prompts editing --num-prompts "$n" --max-tokens "$tokens" \
        "${methods[@]}" --out "$OUT/editing"
    stamp "main done, $(( $(date +%s) - END + BUDGET_S )) s"
}

cd "$HERE"
case "${1:-}" in
    loads) loads "$2" ;;
    receive)
        receive "$2"
        if [ "${3:-}" = --prepare ]; then
            mkdir -p "$WORK"
            setsid nohup bash "$SELF" prepare >"$WORK/prepare.log" 2>&1 </dev/null &
            stamp "preparing in the background (log: $WORK/prepare.log)"
        fi
        [ -f "$WORK/prepare.log" ] && tail -n 3 "$WORK/prepare.log" ;;
    prepare) prepare ;;
    main)
        : "${BUDGET_S:?set BUDGET_S: the seconds this command may take (device time left, less 2 minutes)}"
        END=$(( $(date +%s) + BUDGET_S ))
        mkdir -p "$OUT"
        receive "$2"
        set -o pipefail
        main_job 2>&1 | tee "$OUT/engine.log"
        cp "$WORK/prepare.log" "$OUT/prepare.log" 2>/dev/null || true ;;
    *) sed -n '2,27p' "$SELF"; exit 2 ;;
esac
