#!/usr/bin/env bash
# mixprec on one H100-class GPU, in one command of at most 9 minutes:
#
#   PYTHONPATH=src bash benchmarks/gpu/run_h100.sh [--out DIR] [--pack DIR] [PART...]
#
# With the device tool (its folder $OUT comes back, at most 8 files), timeout_s 600:
#
#   bash benchmarks/gpu/run_h100.sh --pack "$OUT"
#
# Parts, in priority order (the default runs all six in this order; naming parts runs those):
#
#   cuda         python -m pytest -v -m cuda: every CUDA test (GradScaler and fused AdamW
#                parity, 16-true, TF32, device memory, DDP, the doctor, the bench's CUDA rows,
#                real float8 matmuls, compiled float8 casts equal to eager ones), stopped with
#                SIGINT at its budget so that pytest still prints which tests failed
#   blog256      mixprec bench --preset blog at batch 256: float32 TF32 off and on,
#                bf16-mixed, 16-mixed (10 timed steps after 3 warm-up)
#   blog32       the same at batch 32 (launch-bound: mixprec's overhead shows here)
#   transformer  benchmarks/gpu/transformer.py: the 217M decoder LM, bf16-mixed, eager and
#                compiled, mixprec against a hand-written loop
#   trainer      benchmarks/gpu/trainer_overhead.py: the Trainer against a hand-written
#                Precision loop on the blog CNN
#   float8       benchmarks/gpu/float8_mlp.py: 4 Linear layers (d=4096, hidden 16384, 8192
#                tokens), bf16-mixed against float8 tensorwise, eager and compiled
#
# and four more, only when named: `maxbatch` (the blog CNN under a 4.5 GiB memory limit with
# --max-batch), `states` (benchmarks/gpu/states_adamw.py: mixprec's AdamW8bit, AdamW4bit and
# AdamWFp8 against torch's fused AdamW and, where installed, torchao's and bitsandbytes'
# 8-bit AdamW, on a 4.2M and a 100M MLP; budget 120 s, most of it compiling), `activations`
# (benchmarks/gpu/activations.py: each activation option's largest batch under an 8 GiB
# limit and its step time against keep's, on a 160M decoder LM; budget 110 s) and `suite`
# (the tests not marked cuda).
#
# Budgets (seconds) come from the first H200 run (../shared/gpu-runs/h200-2026-11-28; about
# 10 s of each is a fresh Python process importing torch and starting CUDA): CUDA tests
# 92 s then, 150 here (the float8 cast tests compile Triton kernels); bench at batch 256,
# 4 rows, 40.5 s -> 60; batch 32, 4 rows of tiny steps, each its own process -> 55; two
# transformer rows ~47 s each on the earlier four-row run -> 80 (60 a configuration); the
# Trainer 33 s -> 50; float8 MLP (two compiled models, the rest quick) -> 120. Each variable
# <PART>_TIMEOUT (CUDA_TIMEOUT, BLOG256_TIMEOUT, ...) overrides one. The whole run stops at
# TOTAL_BUDGET (530 s): a part gets what is left if that is less than its budget, and is
# skipped (said so in the summary) when under 20 s are left.
#
# Results go to DIR as they come (default benchmarks/results/gpu/<UTC date>, a -<time>
# suffix if that folder is taken): <part>.log and <part>/ for each part, and summary.md
# (the GPU, torch, each part's exit code, seconds and budget, the CUDA tests' outcome and
# every result table so far), rewritten after each part. --pack DIR copies summary.md and
# results.tar.gz (all of DIR) there after each part.
#
# Every part runs "$PYTHON" (default: the `python` first on PATH): set PYTHON to an
# interpreter of a virtual environment that is not activated.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python}"

DIR=""
PACK=""
PARTS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --out) DIR="$2"; shift 2 ;;
        --pack) PACK="$2"; shift 2 ;;
        -h|--help) sed -n '2,45p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) PARTS+=("$1"); shift ;;
    esac
done
ALL=(cuda blog256 blog32 transformer trainer float8)
[ "${#PARTS[@]}" -eq 0 ] && PARTS=("${ALL[@]}")
for part in "${PARTS[@]}"; do
    case "$part" in
        cuda|blog256|blog32|transformer|trainer|float8|maxbatch|states|activations|suite) ;;
        *) echo "unknown part '$part': use ${ALL[*]}, maxbatch, states, activations or suite" >&2
            exit 2 ;;
    esac
done
if [ -z "$DIR" ]; then
    DIR="benchmarks/results/gpu/$(date -u +%Y-%m-%d)"
    [ -e "$DIR" ] && DIR="$DIR-$(date -u +%H%M%S)"
fi
mkdir -p "$DIR"
[ -n "$PACK" ] && mkdir -p "$PACK"
TOTAL_BUDGET="${TOTAL_BUDGET:-530}"
MEMORY_LIMIT="${MEMORY_LIMIT:-4.5GiB}"
ROWS="$DIR/.rows.md"
: > "$ROWS"

{
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
          'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" 2>&1
    echo '```'
} > "$DIR/.machine.md"

# the summary from what is on disk: the machine, one row per part, the CUDA tests' outcome,
# each finished result table; then the copies for --pack
summarize() {
    {
        echo "# mixprec on $(hostname): ${PARTS[*]}"
        echo
        echo "Command: \`bash benchmarks/gpu/run_h100.sh ${PARTS[*]}\` (results in $DIR)"
        echo
        cat "$DIR/.machine.md"
        echo
        echo "| part | exit code | seconds | budget |"
        echo "|---|---:|---:|---:|"
        cat "$ROWS"
        if [ -f "$DIR/cuda.log" ]; then
            echo
            echo "## CUDA tests"
            echo
            echo '```'
            grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed|error|skipped|deselected)" \
                "$DIR/cuda.log" | tail -n 40
            echo '```'
        fi
        for report in blog256/report.md blog32/report.md transformer/results.md \
            trainer/results.md float8/float8_mlp.md maxbatch/report.md \
            states/states_adamw.md activations/results.md; do
            if [ -f "$DIR/$report" ]; then
                echo
                echo "## $report"
                echo
                cat "$DIR/$report"
            fi
        done
    } > "$DIR/summary.md"
    if [ -n "$PACK" ]; then
        cp "$DIR/summary.md" "$PACK/summary.md"
        tar -czf "$PACK/results.tar.gz" -C "$DIR" .
    fi
}

# run NAME BUDGET [SIGNAL] -- COMMAND...: under `timeout` (SIGNAL, TERM by default; then KILL
# 10 s later), the log in $DIR/NAME.log; a summary row; skipped when the total is spent
run() {
    local name="$1" budget="$2" signal=TERM
    shift 2
    if [ "$1" != "--" ]; then signal="$1"; shift; fi
    shift
    local left=$((TOTAL_BUDGET - SECONDS - 15))
    if [ "$left" -lt 20 ]; then
        [ "$left" -lt 0 ] && left=0
        echo "| $name | skipped: ${left}s of TOTAL_BUDGET left | - | $budget |" >> "$ROWS"
        echo "== $name: skipped, ${left}s of TOTAL_BUDGET left"
        return
    fi
    [ "$left" -lt "$budget" ] && budget=$left
    local start=$SECONDS
    echo "== $name (budget ${budget}s): $*"
    timeout -s "$signal" -k 10 "$budget" "$@" > "$DIR/$name.log" 2>&1
    local code=$?
    local note=""
    [ "$code" -eq 124 ] && note=" (timed out)"
    [ "$signal" = INT ] && [ $((SECONDS - start)) -ge "$budget" ] && note=" (stopped at budget)"
    echo "| $name | $code$note | $((SECONDS - start)) | $budget |" >> "$ROWS"
    tail -n 4 "$DIR/$name.log"
    summarize
}

BENCH=("$PYTHON" -m mixprec.cli bench --preset blog --device cuda --precision 32-true bf16-mixed
    16-mixed)
for part in "${PARTS[@]}"; do
    case "$part" in
        cuda)
            run cuda "${CUDA_TIMEOUT:-150}" INT -- "$PYTHON" -m pytest -v -m cuda \
                -p no:cacheprovider --durations=10 ;;
        blog256)
            run blog256 "${BLOG256_TIMEOUT:-60}" -- "${BENCH[@]}" --batch-sizes 256 \
                --steps 10 --warmup 3 --out "$DIR/blog256" ;;
        blog32)
            run blog32 "${BLOG32_TIMEOUT:-55}" -- "${BENCH[@]}" --batch-sizes 32 \
                --out "$DIR/blog32" ;;
        transformer)
            run transformer "${TRANSFORMER_TIMEOUT:-80}" -- \
                "$PYTHON" benchmarks/gpu/transformer.py \
                --device cuda --precision bf16-mixed --compile both --timeout 60 \
                --out "$DIR/transformer" ;;
        trainer)
            run trainer "${TRAINER_TIMEOUT:-50}" -- "$PYTHON" benchmarks/gpu/trainer_overhead.py \
                --device cuda --out "$DIR/trainer/results.md" ;;
        float8)
            run float8 "${FLOAT8_TIMEOUT:-120}" -- "$PYTHON" benchmarks/gpu/float8_mlp.py \
                --device cuda --out "$DIR/float8" ;;
        maxbatch)
            run maxbatch "${MAXBATCH_TIMEOUT:-130}" -- \
                "$PYTHON" -m mixprec.cli bench --preset blog \
                --device cuda --batch-sizes 256 --precision 32-true bf16-mixed --tf32 off \
                --max-batch --memory-limit "$MEMORY_LIMIT" --out "$DIR/maxbatch" ;;
        states)
            run states "${STATES_TIMEOUT:-120}" -- "$PYTHON" benchmarks/gpu/states_adamw.py \
                --device cuda --out "$DIR/states" ;;
        activations)
            run activations "${ACTIVATIONS_TIMEOUT:-110}" -- \
                "$PYTHON" benchmarks/gpu/activations.py --device cuda --budget 95 \
                --out "$DIR/activations" ;;
        suite)
            run suite "${SUITE_TIMEOUT:-300}" INT -- "$PYTHON" -m pytest -q -m "not cuda" \
                -p no:cacheprovider --durations=20 ;;
    esac
done
summarize
echo "== done in ${SECONDS}s: $DIR"
