#!/usr/bin/env bash
# One command for a CUDA machine: which GPU, the CUDA/Triton tests, then `shardfc bench --peers` at
# C = 250k and C = 1M (B = 1024, D = 512) — so scarce GPU minutes go to measuring, not setting up.
#
#   bash scripts/gpu_check.sh                  # from the repository root
#
# Nothing is installed and nothing is downloaded (such machines often have no network): shardfc runs
# from src/ (PYTHONPATH=src); torch, triton, pytest and matplotlib must already be there. The bench's
# rows are all of `shardfc bench --peers` (the head with impl torch / triton / gemm / auto, chunked,
# Partial FC, plain torch dense, torch's linear_cross_entropy, the peers): the peers Cut Cross-Entropy
# and Liger run only if importable, otherwise their rows say "not installed"; torch's
# linear_cross_entropy rows say "unavailable" on a torch without it. To
# bring them without a network, put their wheels in a folder and set WHEELS=that/folder: they are
# installed with --no-index --no-deps into a temporary folder (never into the machine's Python).
#
# Parts, each time-boxed with `timeout` (the whole fits well inside 10 minutes on an H100):
#   1. the GPU (nvidia-smi, torch, CUDA, triton)                              -> env.txt
#   2. the CUDA tests: pytest -q tests/head -k "cuda or triton or fused"       -> tests.log
#      (the tests whose ids mention cuda, triton or fused — the fused Triton kernels' tests live in
#      tests/head/fused/ — i.e. those that need CUDA or Triton, skipped or interpreted on a CPU
#      machine; exit 5, "no test matched", is reported but is no failure)
#   3. bench --peers at each C in CLASSES, --steps 10 --warmup 3               -> peers_c<C>.{log,json,png}
#      then, from the log, what impl="auto" chose: the head's own log (logger shardfc.head, its
#      lines prefixed [shardfc.head] in the log: the timing table of the candidates, or the cached
#      choice) and the shardfc-auto row
# At most 8 files, flat, under ${OUT:-gpu_check_out}. The tables are printed; a part that fails does not
# stop the next, and the script exits 1 at the end if any part failed (a failed row or a loss that
# disagrees with the reference makes its bench part fail), 0 otherwise.
#
# Environment (defaults): OUT (gpu_check_out), PYTHON (python3), DEVICE (cuda), BATCH (1024), DIM (512),
# CLASSES ("250000 1000000"), STEPS (10), WARMUP (3), TESTS_TIMEOUT (150), BENCH_TIMEOUT (150 s per C up
# to 250k, 200 s above), WHEELS (unset). DEVICE=cpu with tiny sizes checks the script itself on a CPU.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-1024}
DIM=${DIM:-512}
CLASSES=${CLASSES:-250000 1000000}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

failed=()
summary=()
note() { summary+=("$1"); }
fail() { failed+=("$1"); summary+=("FAILED: $1"); }

# ---------------------------------------------------------------- 0. optional peer wheels, offline
if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    if ls "$WHEELS"/*.whl >/dev/null 2>&1 &&
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$site"
        note "wheels from $WHEELS installed into $site"
    else
        fail "wheels: nothing installed from WHEELS=$WHEELS"
    fi
fi

# ---------------------------------------------------------------- 1. the GPU
echo "== 1. device"
{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    timeout 60 "$PY" - "$DEVICE" <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    import triton
    print(f"triton {triton.__version__}")
except Exception as e:
    print(f"triton: not importable ({type(e).__name__}: {e})")
for name in ("cut_cross_entropy", "liger_kernel", "pytest", "matplotlib"):
    try:
        __import__(name)
        print(f"{name}: importable")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
elif sys.argv[1] == "cuda":
    sys.exit("no CUDA device visible to torch: this script is for a CUDA machine (DEVICE=cpu checks the script)")
EOF
} 2>&1 | tee "$OUT/env.txt"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    fail "device: no usable $DEVICE device (see $OUT/env.txt)"
    printf '%s\n' "${summary[@]}"
    exit 1
fi
has_plot=0
grep -q "^matplotlib: importable" "$OUT/env.txt" && has_plot=1

# ---------------------------------------------------------------- 2. the CUDA tests
echo "== 2. pytest -q tests/head -k \"cuda or triton or fused\" (timeout ${TESTS_TIMEOUT}s)"
start=$SECONDS
timeout --kill-after=10 "$TESTS_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider tests/head -k "cuda or triton or fused" \
    >"$OUT/tests.log" 2>&1
rc=$?
tail -n 25 "$OUT/tests.log"
case $rc in
    0) note "tests: passed ($((SECONDS - start)) s)" ;;
    5) note "tests: no test matched -k \"cuda or triton or fused\" in tests/head (nothing CUDA-specific to run yet)" ;;
    124 | 137) fail "tests: timed out after ${TESTS_TIMEOUT}s (see $OUT/tests.log)" ;;
    *) fail "tests: exit $rc (see $OUT/tests.log)" ;;
esac

# ---------------------------------------------------------------- 3. bench --peers per C
n=3
for C in $CLASSES; do
    limit=${BENCH_TIMEOUT:-$([ "$C" -le 250000 ] && echo 150 || echo 200)}
    base="$OUT/peers_c$C"
    echo "== $n. bench --peers B=$BATCH D=$DIM C=$C on $DEVICE (timeout ${limit}s)"
    n=$((n + 1))
    plot=()
    [ "$has_plot" = 1 ] && plot=(--plot "$base.png")
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$PY" -m shardfc bench --peers --batch "$BATCH" --dim "$DIM" --classes "$C" \
        --steps "$STEPS" --warmup "$WARMUP" --device "$DEVICE" --json "$base.json" ${plot[@]+"${plot[@]}"} >"$base.log" 2>&1
    rc=$?
    grep -v -e '^\[peers\]' -e '^\[shardfc\.head\]' "$base.log"  # the table (progress and the head's log stay in the log)
    echo "-- impl=\"auto\" at C=$C (the head's log, then the row):"
    grep -e '^\[shardfc\.head\]' -e '^| shardfc, impl=auto ' "$base.log" || echo "(no line of the log mentions auto's choice)"
    case $rc in
        0) note "bench C=$C: every row ran or was unavailable, losses agree ($((SECONDS - start)) s)" ;;
        124 | 137) fail "bench C=$C: timed out after ${limit}s; rows done so far: $(grep -c ' per step' "$base.log") (see $base.log)" ;;
        *) fail "bench C=$C: exit $rc (see $base.log)" ;;
    esac
done

echo "== summary (files in $OUT/)"
printf '%s\n' ${summary[@]+"${summary[@]}"}
[ "$has_plot" = 1 ] || echo "note: matplotlib is not importable: no plots"
if [ "${#failed[@]}" -gt 0 ]; then
    exit 1
fi
exit 0
