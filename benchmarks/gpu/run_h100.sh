#!/usr/bin/env bash
# Everything mixprec has never run on a GPU, on one H100, in two device-tool commands
# (each at most 10 minutes; the budgets below keep each under 9):
#
#   1. PYTHONPATH=src bash benchmarks/gpu/run_h100.sh               # cuda blog maxbatch suite
#   2. PYTHONPATH=src bash benchmarks/gpu/run_h100.sh transformer trainer
#
# The device tool runs the command in the repository root and brings $OUT back. Parts can be
# named one by one (`run_h100.sh blog maxbatch`); `all` runs every part in one go (up to
# 17 minutes: only where a command may run that long). If the suite part of command 1 times
# out, `SUITE_TIMEOUT=540 bash benchmarks/gpu/run_h100.sh suite` runs it alone. Parts:
#
#   cuda         python -m pytest -m cuda: tests/test_cuda.py and the CUDA tests of the bench
#                and the doctor (float16 bit-parity with GradScaler, fused AdamW, 16-true,
#                TF32, device memory, gloo DDP on one GPU, doctor CPU vs CUDA)
#   suite        python -m pytest: the whole suite on a machine that has CUDA (the tests not
#                marked cuda when the cuda part ran first in the same command)
#   blog         mixprec bench --preset blog: the blog's CNN at 256x256, batch 32..512,
#                float32 TF32 off and on, 16-mixed, auto (bf16-mixed on an H100), 20 timed
#                steps after 5 warm-up, each configuration in a fresh process
#   maxbatch     the same CNN at batch 256 under a 4.5 GiB memory limit, plus the largest
#                batch that fits per precision: float32 runs out of memory where bf16-mixed
#                fits (see benchmarks/gpu/README.md for why 4.5 GiB)
#   transformer  benchmarks/gpu/transformer.py: a 217M-parameter decoder LM in five
#                precisions, eager and torch.compile, mixprec against hand-written torch
#   trainer      benchmarks/gpu/trainer_overhead.py: the Trainer against a hand-written
#                Precision loop on the blog CNN (128x128, batch 128), bf16-mixed and 16-mixed
#
# Each part runs under `timeout` (seconds: CUDA_TIMEOUT, SUITE_TIMEOUT, BLOG_TIMEOUT,
# MAXBATCH_TIMEOUT, TRANSFORMER_TIMEOUT, TRAINER_TIMEOUT; MEMORY_LIMIT overrides 4.5GiB;
# SUITE_ARGS adds pytest options to the suite part, e.g. "-n 8" with pytest-xdist),
# which also ends the part's child processes. What comes back in $OUT (default
# $TMPDIR/mixprec-h100-out), flat, at most 8 files: one log per part, summary.md (what ran,
# exit codes, durations, the GPU, and the result tables), and results.tar.gz holding every
# output folder (bench_blog_h100/, bench_maxbatch_h100/, transformer_h100/, trainer_h100/)
# and the logs.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-${TMPDIR:-/tmp}/mixprec-h100-out}"
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mixprec-h100.XXXXXX")"
SUMMARY="$OUT/summary.md"
MEMORY_LIMIT="${MEMORY_LIMIT:-4.5GiB}"

if [ "$#" -eq 0 ]; then
    set -- cuda blog maxbatch suite
elif [ "$1" = all ]; then
    set -- cuda blog maxbatch suite transformer trainer
fi

{
    echo "# mixprec on $(hostname): $*"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
          'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    echo '```'
    echo
    echo "| part | exit code | seconds | budget |"
    echo "|---|---:|---:|---:|"
} > "$SUMMARY"

# run NAME BUDGET COMMAND...: log to $OUT/NAME.log, one row in the summary
run() {
    local name="$1" budget="$2"
    shift 2
    local start=$SECONDS
    echo "== $name: $* (budget ${budget}s)"
    timeout -k 15 "$budget" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    local note=""
    [ "$code" -eq 124 ] && note=" (timed out)"
    echo "| $name | $code$note | $((SECONDS - start)) | $budget |" >> "$SUMMARY"
    tail -n 3 "$OUT/$name.log"
}

BENCH=(python -m mixprec.cli bench)
SUITE=(python -m pytest -q -p no:cacheprovider --durations=20 ${SUITE_ARGS:-})
for part in "$@"; do
    case "$part" in
        cuda)
            run cuda "${CUDA_TIMEOUT:-90}" python -m pytest -q -m cuda -p no:cacheprovider \
                --durations=10
            SUITE+=(-m "not cuda") ;;
        suite)
            run suite "${SUITE_TIMEOUT:-140}" "${SUITE[@]}" ;;
        blog)
            run blog "${BLOG_TIMEOUT:-150}" "${BENCH[@]}" --preset blog --device cuda \
                --out "$WORK/bench_blog_h100" ;;
        maxbatch)
            run maxbatch "${MAXBATCH_TIMEOUT:-130}" "${BENCH[@]}" --preset blog --device cuda \
                --batch-sizes 256 --precision 32-true bf16-mixed --tf32 off \
                --max-batch --memory-limit "$MEMORY_LIMIT" --out "$WORK/bench_maxbatch_h100" ;;
        transformer)
            run transformer "${TRANSFORMER_TIMEOUT:-420}" python benchmarks/gpu/transformer.py \
                --device cuda --timeout 150 --out "$WORK/transformer_h100" ;;
        trainer)
            run trainer "${TRAINER_TIMEOUT:-100}" python benchmarks/gpu/trainer_overhead.py \
                --device cuda --out "$WORK/trainer_h100/results.md" ;;
        *)
            echo "unknown part '$part': use cuda, suite, blog, maxbatch, transformer, trainer" \
                "or all" >&2
            exit 2 ;;
    esac
done

for report in bench_blog_h100/report.md bench_maxbatch_h100/report.md \
    transformer_h100/results.md trainer_h100/results.md; do
    if [ -f "$WORK/$report" ]; then
        { echo; echo "## $report"; echo; cat "$WORK/$report"; } >> "$SUMMARY"
    fi
done
cp "$OUT"/*.log "$WORK"/ 2> /dev/null
tar -czf "$OUT/results.tar.gz" -C "$WORK" .
rm -rf "$WORK"
echo "== done: $(ls "$OUT")"
