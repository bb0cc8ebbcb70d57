#!/usr/bin/env bash
# Train the default pair's drafter in one 15-minute stay on a borrowed NVIDIA GPU machine: no network, at most
# 64 MiB carried in per command (the working tree included), files kept only while commands follow each other
# within seconds, at most 8 files of 16 MiB back from the last command. The trainer is PyTorch
# (`python -m dflash_mlx.torch_train`, the machine's own torch and transformers); the target travels as its GGUF
# (the exact source of our fp32 weights) in command-sized pieces; the training data is made there, from the
# machine's own Python packages, while the pieces arrive.
#
# Here, before the stay (the shipped drafter moved aside so the tree stays small):
#   bash benchmarks/gpu_train.sh loads .gpu          # .gpu/00, 01, ...: each command's load (<= LOAD_MIB); with
#                                                    # INIT_FROM (default: the shipped drafter) one more to continue
#   mv dflash_mlx/drafters/qwen2.5-coder-0.5b/model.safetensors /tmp/
# There, one command each, back to back (carry .gpu/NN):
#   bash benchmarks/gpu_train.sh receive .gpu/00 --prepare   # + starts installing and making the data
#   bash benchmarks/gpu_train.sh receive .gpu/NN             # the middle loads
#   BUDGET_S=S bash benchmarks/gpu_train.sh main .gpu/LAST  # the last load, then everything, done S s after it
#                                                            # starts; the drafter's files land in $OUT
# Here, after:
#   bash benchmarks/gpu_train.sh back FILES_DIR OUT          # the z-lab-layout drafter (head rows from the target)
# Settings (environment): INIT_FROM, INIT_LR, ANSWER_MAX_S, ANSWER_SHARE, ANSWER_TOKENS, ANSWER_BATCH, TORCH_FLAGS,
# CODE_BYTES, PROMPTS, REQUESTS, WORK, LOAD_MIB, PY.
set -euo pipefail

WORK=${WORK:-/tmp/dflash-gpu}
IN=$WORK/in
OUT=${OUT:-$WORK/out}
# Data first: the answers users ask for (chat-style coding requests answered as the chat template writes them) are
# what moves held-out τ on HumanEval; more steps on the same data barely did (the second stay: 1.69 -> 1.75).
ANSWER_MAX_S=${ANSWER_MAX_S:-300}    # seconds the target spends answering prompts (at most; half the time left)
ANSWER_SHARE=${ANSWER_SHARE:-50}     # percent of the time left, once the target is converted, spent answering
ANSWER_TOKENS=${ANSWER_TOKENS:-320}  # longest answer
ANSWER_BATCH=${ANSWER_BATCH:-512}
PROMPTS=${PROMPTS:-3000}             # documented functions as "complete this" prompts
REQUESTS=${REQUESTS:-12000}          # the same functions as chat requests: write, explain, type, test, refactor
CODE_BYTES=${CODE_BYTES:-4000000}    # whole modules (a minority), labelled by the target's own greedy choices
PACK_S=${PACK_S:-25}                 # kept for packing the result after the last step
TORCH_FLAGS=${TORCH_FLAGS:---labels target --block-size 16 --num-layers 3 --intermediate-size 2432 \
--draft-vocab 32768 --anchors 128 --rows 4 --seq-len 512 --lr 6e-4 --seed 0 --eval-prompts 8 --eval-rows 32 \
--eval-every 250 --checkpoint-every 1000}
LOAD_MIB=${LOAD_MIB:-59}             # one command's pieces (the tree, ~4.3 MiB without the shipped drafter, too)
GGUF=${GGUF:-$HOME/.cache/dflash-mlx/gguf/qwen2.5-coder-0.5b.gguf}
TARGET_DIR=${TARGET_DIR:-$HOME/.cache/dflash-mlx/models/qwen2.5-coder-0.5b}  # the engine's target, here
INIT_FROM=${INIT_FROM-dflash_mlx/drafters/qwen2.5-coder-0.5b}  # continue from this drafter ('' : a fresh one)
INIT_LR=${INIT_LR:-3e-4}             # peak learning rate of a continued run's new schedule
export DFLASH_MLX_NO_BLAS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SELF=$HERE/benchmarks/$(basename "$0")  # absolute: the background job starts after the cd below

stamp() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# -- here ---------------------------------------------------------------------------------------------------------
loads() {  # loads DEST: the GGUF in LOAD_MIB pieces, one per command; the gguf wheel with the first; the
    # engine's own tokenizer files with the last (a GGUF's tokenizer rebuilt by another transformers can differ)
    local dest=$1 stage
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF: run 'dflash-mlx models install qwen2.5-coder-0.5b' first" >&2; exit 2; }
    stage=$(mktemp -d)
    "$PY" benchmarks/carry.py split "$GGUF" "$stage" --piece-mib "$LOAD_MIB"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d "$stage" gguf==0.19.0
    local parts k=0 p
    mapfile -t parts < <(ls "$stage"/*.part*)
    rm -rf "$dest"
    for p in "${parts[@]}"; do
        mkdir -p "$dest/$(printf %02d $k)"
        mv "$p" "$dest/$(printf %02d $k)/"
        k=$((k + 1))
    done
    mv "$stage"/*.whl "$dest/00/"
    if [ -n "$INIT_FROM" ]; then  # the drafter to continue from gets the load before the last
        mv "$dest/$(printf %02d $((k - 1)))" "$dest/$(printf %02d $k)"
        "$PY" benchmarks/gpu_drafter.py init "$INIT_FROM" "$TARGET_DIR" "$dest/$(printf %02d $((k - 1)))/init"
        k=$((k + 1))
    fi
    mv "$stage"/*.manifest.json "$dest/$(printf %02d $((k - 1)))/"  # with the last piece: join once all are there
    tar -cJf "$dest/$(printf %02d $((k - 1)))/tokenizer.tar.xz" -C "$TARGET_DIR" tokenizer.json \
        tokenizer_config.json $(cd "$TARGET_DIR" && ls chat_template.jinja 2>/dev/null)
    rm -rf "$stage"
    du -sh "$dest"/* | sed 's/^/load /'
}

back() {  # back FILES_DIR OUT: the drafter, whole, from the files the last command returned
    "$PY" benchmarks/gpu_drafter.py restore "$1" "$TARGET_DIR" "$2"
}

# -- there --------------------------------------------------------------------------------------------------------
receive() {  # receive DIR: this command's pieces
    mkdir -p "$IN"
    cp -a "$1"/. "$IN/"
    stamp "in: $(ls "$IN" | wc -l) files, $(du -sh "$IN" | cut -f1)"
}

prepare() {  # install dflash-mlx and gguf, make the training data (both from the machine's own packages)
    mkdir -p "$WORK/site" "$WORK/data"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$IN"/gguf-*.whl
    # dflash-mlx itself as its wheel would lay it out (convert/ inside the package), without building one: the
    # machine's setuptools may be older than our pyproject.
    rm -rf "$WORK/site/dflash_mlx"
    cp -r "$HERE/dflash_mlx" "$WORK/site/dflash_mlx"
    cp -r "$HERE/convert" "$WORK/site/dflash_mlx/convert"
    stamp "installed"
    # Documented, widely read libraries (reading every package there would take minutes), and the standard library.
    local purelib roots=() name
    purelib=$(cd "$WORK" && "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for name in ${CODE_PACKAGES:-transformers torch jax sklearn scipy pandas networkx sympy matplotlib requests rich click \
            jinja2 werkzeug numpy}; do
        [ -d "$purelib/$name" ] && roots+=(--code-root "$purelib/$name")
    done
    "$PY" "$HERE/examples/default_drafter_data.py" --out "$WORK/data/prompts.jsonl" --code "$PROMPTS" --chat 0 \
        --requests "$REQUESTS" \
        "${roots[@]}" --code-files "$WORK/data/code" --code-bytes "$CODE_BYTES"
    stamp "data ready"
    touch "$WORK/prepared"
}

main_job() {  # main: join and convert the target, answer, train until the budget's end, pack into $OUT
    local t0=$1 end=$(($1 + BUDGET_S)) now answer_s
    while [ ! -f "$WORK/prepared" ]; do
        [ "$(date +%s)" -lt $((t0 + 240)) ] || { stamp "prepare did not finish:"; cat "$WORK/prepare.log"; exit 1; }
        sleep 1
    done
    if [ ! -f "$WORK/target.hf/config.json" ]; then
        "$PY" "$HERE/benchmarks/carry.py" join "$IN"/*.gguf.manifest.json --out "$WORK/target.gguf"
        (cd "$WORK" && "$PY" -c "from dflash_mlx.convert.gguf import convert_gguf_to_hf as c; \
c('target.gguf', 'target.hf', progress=False)")
        tar -xJf "$IN/tokenizer.tar.xz" -C "$WORK/target.hf"
    fi
    stamp "target converted: $(du -sh "$WORK/target.hf" | cut -f1)"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
    now=$(date +%s)
    answer_s=$(( (end - now) * ANSWER_SHARE / 100 < ANSWER_MAX_S ? (end - now) * ANSWER_SHARE / 100 : ANSWER_MAX_S ))
    stamp "answers: ${answer_s} s, at most ${ANSWER_TOKENS} tokens each, batch ${ANSWER_BATCH}"
    (cd "$WORK" && "$PY" -m dflash_mlx.torch_train.answer --target target.hf --prompts data/prompts.jsonl \
        --out data/answers.jsonl --max-tokens "$ANSWER_TOKENS" --batch "$ANSWER_BATCH" \
        --minutes "$(awk -v s="$answer_s" 'BEGIN{print s / 60}')") || stamp "answers failed: training on code alone"
    local data=(--data data/code) init=()
    if [ -d "$IN/init" ]; then  # continue from the drafter carried in: its layers, head rows from the target
        "$PY" "$HERE/benchmarks/gpu_drafter.py" restore "$IN/init" "$WORK/target.hf" "$WORK/init"
        init=(--init init --lr "$INIT_LR")
    fi
    [ -s "$WORK/data/answers.jsonl" ] && data=(--data data/answers.jsonl "${data[@]}")
    stamp "training until $(date -d @$((end - PACK_S)) +%H:%M:%S)"
    # shellcheck disable=SC2086
    (cd "$WORK" && timeout -k 5 $((end - PACK_S + 10 - $(date +%s))) "$PY" -m dflash_mlx.torch_train \
        --target target.hf "${data[@]}" --out run $TORCH_FLAGS "${init[@]}" --until $((end - PACK_S))) \
        || stamp "training stopped early (status $?): packing its last checkpoint"
    "$PY" "$HERE/benchmarks/gpu_drafter.py" pack "$WORK/run" "$OUT" --extra "$WORK/prepare.log"
    stamp "main done, $(( $(date +%s) - t0 )) s"
}

cd "$HERE"
case "${1:-}" in
    loads) loads "$2" ;;
    back) back "$2" "$3" ;;
    receive)
        receive "$2"
        if [ "${3:-}" = --prepare ]; then
            setsid nohup bash "$SELF" prepare >"$WORK/prepare.log" 2>&1 </dev/null &
            stamp "preparing in the background (log: $WORK/prepare.log)"
        fi
        [ -f "$WORK/prepare.log" ] && tail -n 3 "$WORK/prepare.log" ;;
    prepare) prepare ;;
    main)
        t0=$(date +%s)
        : "${BUDGET_S:?set BUDGET_S: the seconds this command may take}"
        mkdir -p "$OUT"
        receive "$2"
        set -o pipefail
        main_job "$t0" 2>&1 | tee "$OUT/job.log" ;;
    *) sed -n '2,21p' "$SELF"; exit 2 ;;
esac
