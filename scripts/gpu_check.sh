#!/usr/bin/env bash
# One command for a CUDA machine: everything the GPU path needs checked and measured, in one call, so
# that scarce GPU minutes go to measuring, not setting up (issue 30; docs/gpu.md has the figures).
#
#   bash scripts/gpu_check.sh                        # from the repository root, about 4 minutes on an H200
#   PARTS="step peers" bash scripts/gpu_check.sh     # a rerun of some parts only
#
# Nothing is installed system-wide and nothing is downloaded (such machines often have no network):
# shardfc runs from src/ (PYTHONPATH=src); torch, triton and pytest must already be there. Peers
# (Cut Cross-Entropy, Liger) come as wheels from WHEELS (default .whl/ when it holds any), installed
# with --no-index --no-deps into a temporary folder, never into the machine's Python. Fetch them here
# first (the device tool carries .whl/, which .gitignore keeps out of git; pure-Python wheels):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl cut-cross-entropy==25.1.1 liger-kernel==0.8.5
# Rehearse on a CPU under the GPU machine's torch and Triton first (docs/testing.md, "Before a GPU run").
#
# Parts (PARTS, in this order; each time-boxed with `timeout`, a part that fails does not stop the next):
#   env      the GPU, torch, CUDA, Triton, what is importable                       -> env.txt
#   step     scripts/gpu_step.py: first torch's mm/addmm with out_dtype=float32 and bf16
#            operands (does this build take them; which path addmm_f32 chose); each impl
#            against float64 at C_CHECK (fp32, bf16); the head step at C = CLASSES_STEP
#            (bench and trainer variants, Partial FC r=0.1 bf16 sparse, each chunk scale,
#            no next operand, the CUDA graph replay; GPU ms and host issue ms) beside the
#            matmul floor, its headline rows again at C = CLASSES_STEP2; the graph replay
#            against eager over a learning-rate schedule;
#            one step profiled (kernels,
#            the slowest ten, host syncs), and a step (plain and Partial FC) under
#            torch.cuda.set_sync_debug_mode("error"), which must pass: no host sync
#            (issue 31); shardfc plan beside the measured peak, and its chunk
#            candidates (launches, bytes, host issue on paper per scale)                -> gpu_step.json
#   peers    shardfc bench --peers at each C of CLASSES (B, D, bf16)                    -> peers_c<C>.json
#   tests    pytest on the CUDA-capable tests (tests/head -k "cuda or triton or fused",
#            the CUDA-only tests elsewhere), kernels compiled for the real card         -> tests.log
#   trainer  shardfc bench --trainer (iresnet50, 112x112, batch 128, bf16, channels_last),
#            then a short `shardfc train --device cuda` on a packed .rec that saves,
#            resumes and evaluates, and `shardfc eval` of its checkpoint               -> trainer.json, train.log
# Everything printed also goes to all.log. At most 8 files, flat, under ${OUT:-gpu_check_out}; the
# plots are drawn afterwards from the JSON on any machine (shardfc.tools.bench.peers_report.plot).
# Exit 1 if any part failed (a correctness row, a step that synchronised the host, a failed bench row or a loss that disagrees, a test,
# a trainer command), else 0.
#
# Environment (defaults): OUT (gpu_check_out), PYTHON (python3), DEVICE (cuda), PARTS (all), BATCH (1024),
# DIM (512), CLASSES ("1000000 250000"), CLASSES_STEP (1000000), CLASSES_STEP2 (250000), C_CHECK (250000), STEPS (10), WARMUP (3),
# STEP_TIMEOUT (140), PEERS_TIMEOUT (90 s for the first C, 50 for the others), TESTS_TIMEOUT (80),
# TRAINER_TIMEOUT (90: at most 50 of it for bench --trainer, the rest for the short run), WHEELS,
# TRAIN_BACKBONE (iresnet50), TRAIN_BATCH (128), TRAIN_WORKERS (4, the bench's loader workers; 12 did not
# finish in 55 s on an H200 machine's 16 cores), TRAINER_BENCH_TIMEOUT (55),
# TRAIN_CHECK_BACKBONE (iresnet18, the short run's), TRAIN_RUN (1; 0 skips the short run), IMAGE (112), TESTS ("-n 12" when pytest-xdist is there).
# DEVICE=cpu with tiny sizes checks the script itself on a CPU (TRITON_INTERPRET=1 for the fused paths).
# The limits add up to 8 minutes (env 30 s, step 140, peers 90 + 50, tests 80, trainer 90), so one call of
# the device tool with timeout_s 540 leaves room for its start.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PARTS=${PARTS:-env step peers tests trainer}
BATCH=${BATCH:-1024}
DIM=${DIM:-512}
CLASSES=${CLASSES:-1000000 250000}
CLASSES_STEP=${CLASSES_STEP:-1000000}
CLASSES_STEP2=${CLASSES_STEP2:-250000}
C_CHECK=${C_CHECK:-250000}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
TRAIN_BACKBONE=${TRAIN_BACKBONE:-iresnet50}
TRAIN_BATCH=${TRAIN_BATCH:-128}
TRAIN_CHECK_BACKBONE=${TRAIN_CHECK_BACKBONE:-iresnet18}
TRAIN_WORKERS=${TRAIN_WORKERS:-4}
TRAIN_RUN=${TRAIN_RUN:-1}
IMAGE=${IMAGE:-112}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
exec > >(tee -a "$OUT/all.log") 2>&1

failed=()
summary=()
note() { summary+=("$1"); }
fail() { failed+=("$1"); summary+=("FAILED: $1"); }
want() { [[ " $PARTS " == *" $1 "* ]]; }
# run NAME LIMIT CMD...: the command under `timeout`, its status in the summary
run() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    case $rc in
        0) note "$name: ok ($((SECONDS - start)) s)" ;;
        124 | 137) fail "$name: timed out after ${limit}s" ;;
        *) fail "$name: exit $rc ($((SECONDS - start)) s)" ;;
    esac
    echo "-- ${summary[-1]}"
    return $rc
}

# ---------------------------------------------------------------- peers' wheels, offline
WHEELS=${WHEELS:-$([ -n "$(ls .whl/*.whl 2>/dev/null)" ] && echo .whl)}
if [ -n "$WHEELS" ]; then
    site=$(mktemp -d)
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$site"
        note "wheels from $WHEELS installed into $site: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
    else
        fail "wheels: nothing installed from WHEELS=$WHEELS"
    fi
fi

# ---------------------------------------------------------------- env
if want env; then
    echo "== env"
    {
        date -u +"%Y-%m-%d %H:%M:%S UTC"
        git log -1 --format='commit %H %s' 2>/dev/null
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
        timeout 30 "$PY" - "$DEVICE" <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("triton", "cut_cross_entropy", "liger_kernel", "pytest", "xdist", "pytest_timeout", "matplotlib", "nvidia.dali"):
    try:
        m = __import__(name, fromlist=["_"])
        print(f"{name}: importable {getattr(m, '__version__', '')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
elif sys.argv[1] == "cuda":
    sys.exit("no CUDA device visible to torch: this script is for a CUDA machine (DEVICE=cpu checks the script)")
EOF
    } 2>&1 | tee "$OUT/env.txt"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        fail "env: no usable $DEVICE device (see env.txt)"
        printf '%s\n' "${summary[@]}"
        exit 1
    fi
fi

# ---------------------------------------------------------------- step: correctness, step, profile, plan
if want step; then
    run "step (scripts/gpu_step.py)" "${STEP_TIMEOUT:-140}" "$PY" scripts/gpu_step.py --device "$DEVICE" \
        --batch "$BATCH" --dim "$DIM" --classes "$CLASSES_STEP" --check-classes "$C_CHECK" --second-classes "$CLASSES_STEP2" \
        --steps "$STEPS" --warmup "$WARMUP" --json "$OUT/gpu_step.json"
fi

# ---------------------------------------------------------------- peers
if want peers; then
    first=1
    for C in $CLASSES; do
        # every row at the first C; the later ones leave out torch.compile's dense head (its compile
        # alone takes most of a part's time, and the first C has its figure)
        systems=()
        [ "$first" = 1 ] || systems=(--systems "$("$PY" -c "from shardfc.tools.bench.peers import SYSTEMS
print(','.join(s for s in SYSTEMS if s != 'dense-compile'))")")
        run "bench --peers C=$C" "${PEERS_TIMEOUT:-$([ "$first" = 1 ] && echo 90 || echo 50)}" "$PY" -m shardfc bench \
            --peers --batch "$BATCH" --dim "$DIM" --classes "$C" --steps "$STEPS" --warmup "$WARMUP" --device "$DEVICE" \
            ${systems[@]+"${systems[@]}"} --json "$OUT/peers_c$C.json"
        first=0
    done
fi

# ---------------------------------------------------------------- tests
if want tests; then
    xdist=()
    if [ -z "${TESTS+x}" ]; then
        "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 12)
    else
        read -r -a xdist <<<"$TESTS"
    fi
    per_test=()  # `-o addopts=`: the repository's own ask for pytest-xdist, which that machine may lack
    "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
    run "tests" "${TESTS_TIMEOUT:-80}" "$PY" -m pytest -q -rs -o addopts= -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} \
        ${per_test[@]+"${per_test[@]}"} tests/head tests/parallel/test_model_split.py -k "cuda or triton or fused" \
        >"$OUT/tests.log" 2>&1
    tail -n 30 "$OUT/tests.log"
fi

# ---------------------------------------------------------------- trainer
if want trainer; then
    tstart=$SECONDS
    tlimit=${TRAINER_TIMEOUT:-90}
    left() { echo $((tlimit - (SECONDS - tstart) > 5 ? tlimit - (SECONDS - tstart) : 5)); }
    work=$(mktemp -d)
    amp=$([ "$DEVICE" = cuda ] && echo bf16 || echo none)
    cap=${TRAINER_BENCH_TIMEOUT:-50}
    run "bench --trainer" "$(($(left) < cap ? $(left) : cap))" "$PY" -m shardfc bench --trainer --device "$DEVICE" --backbone "$TRAIN_BACKBONE" \
        --image-size "$IMAGE" "$IMAGE" --embedding-dim "$DIM" --batch-size "$TRAIN_BATCH" --amp "$amp" --channels-last \
        --num-workers "$TRAIN_WORKERS" --steps "$STEPS" --warmup "$WARMUP" --json "$OUT/trainer.json" --quiet
    # a short real run from a packed .rec: train, save, resume, evaluate, `shardfc eval`
    [ "$TRAIN_RUN" = 1 ] && {
        run "train: synthetic JPEGs" "$(left)" "$PY" scripts/synthetic_jpegs.py "$work/faces" --identities 100 --images 8 --size "$IMAGE" &&
        run "train: pack" "$(left)" "$PY" -m shardfc data pack "$work/faces" "$work/rec" &&
        run "train: lfw.bin" "$(left)" "$PY" - "$work/rec/lfw.bin" "$IMAGE" <<'EOF' &&
import io, pickle, sys
import torch
from PIL import Image
from shardfc.data import SyntheticIdentities
torch.set_num_threads(1)
size = int(sys.argv[2])
data = SyntheticIdentities(40, 2, (size, size), seed=99)  # identities the run never sees
def png(i):
    x = data[i][0]
    buf = io.BytesIO()
    Image.fromarray(((x.clamp(-1, 1) * 0.5 + 0.5) * 255).round().byte().permute(1, 2, 0).numpy()).save(buf, "PNG")
    return buf.getvalue()
pairs, same = [], []
for k in range(40):
    a, b = 2 * k, (2 * k + 1) if k % 2 == 0 else (2 * ((k + 7) % 40) + 1)
    pairs += [png(a), png(b)]
    same.append(k % 2 == 0)
open(sys.argv[1], "wb").write(pickle.dumps((pairs, same)))
EOF
        common=(--data-root "$work/rec" --val-bins lfw.bin --backbone "$TRAIN_CHECK_BACKBONE" --image-size "$IMAGE" "$IMAGE"
                --embedding-dim "$DIM" --batch-size 64 --nproc 1 --device "$DEVICE" --output-dir "$work/run" --no-progress
                --ckpt-every 6)
        run "train: 8 steps, saving" "$(left)" "$PY" -m shardfc train "${common[@]}" --max-steps 8 &&
        run "train: resumed to 12 steps" "$(left)" "$PY" -m shardfc train "${common[@]}" --max-steps 12 --resume auto &&
        run "train: shardfc eval" "$(left)" "$PY" -m shardfc eval --checkpoint "$work/run" --bin "$work/rec/lfw.bin"
    } 2>&1 | tee "$OUT/train.log.tmp"
    if [ "$TRAIN_RUN" = 1 ]; then
        cat "$work/run/train.log" >>"$OUT/train.log.tmp" 2>/dev/null
        mv "$OUT/train.log.tmp" "$OUT/train.log"
        grep -q "^-- FAILED" "$OUT/train.log" && fail "trainer: a train/resume/eval command failed (train.log)"
    fi
    rm -f "$OUT/train.log.tmp"
fi

echo "== summary (files in $OUT/)"
printf '%s\n' ${summary[@]+"${summary[@]}"}
[ "${#failed[@]}" -eq 0 ]
