#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo; no MPI, TensorFlow or MXNet) into the active python.
#
# Why this script exists: the registry's horovod 0.28.1 sdist asks for C++14, and torch >= 2.1
# headers need C++17, so a plain `pip install horovod` fails against torch 2.13. We build the
# pinned sdist (checked by sha256) with the two `set(CMAKE_CXX_STANDARD 14)` lines raised to 17,
# and cache the wheel so the build (4 minutes on 2 idle cores, 10 on a busy machine) happens once
# per (python, torch) pair. The build compiles with -mavx -mfma -mf16c (horovod's CMakeLists), so do
# not share the cache with x86 machines that lack AVX/FMA.
#
#   python -m pip install -c constraints.txt torch==2.13.0   # torch first: the build links against it
#   scripts/install_horovod.sh
#   horovodrun -np 2 --gloo python script.py
#
# Environment:
#   PYTHON                 python to install into (default: `python`, i.e. the active venv)
#   SHARDFC_WHEEL_CACHE    wheel cache (default: $HOME/.cache/shardfc/wheels); the wheel lies in
#                          $SHARDFC_WHEEL_CACHE/torch-<torch version>/ because it links against
#                          that torch's C++ ABI and is useless with any other torch
#   SHARDFC_BUILD_JOBS     parallel compile jobs (default: nproc; setup.py's own default is -j8)
#
# Any HOROVOD_* variable in the caller's environment is ignored (unset): they change what the sdist
# builds (HOROVOD_GPU_*, HOROVOD_WITH_*) or even its version (HOROVOD_LOCAL_VERSION).
#
# Idempotent: if horovod's torch extension already loads with gloo built in, it does nothing; if the
# cache holds the wheel it only installs it. (A bare `import horovod.torch` is no test: when the
# extension is missing it only prints a warning and the import succeeds.)
set -euo pipefail

HOROVOD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz on PyPI; a different file means a different build.
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0

PYTHON=${PYTHON:-python}
CACHE_ROOT=${SHARDFC_WHEEL_CACHE:-$HOME/.cache/shardfc/wheels}

log() { printf '[install_horovod] %s\n' "$*" >&2; }
die() { printf '[install_horovod] ERROR: %s\n' "$*" >&2; exit 1; }

# Only the flags set for the build below decide what gets built.
while read -r v; do
    log "ignoring $v=${!v} from the environment"
    unset "$v"
done < <(compgen -e | grep '^HOROVOD_' || true)

command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH; activate a venv (or set PYTHON=/path/to/python)"
PY_EXE=$("$PYTHON" -c 'import sys; print(sys.executable)')
log "python: $PY_EXE ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

# torch must be importable in this python: the build runs without isolation and links against it.
if ! TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    die "torch is not installed in $PY_EXE. Install it first, e.g.
    $PYTHON -m pip install -c constraints.txt torch==2.13.0
(an unpinned torch pulls a multi-GB CUDA build)."
fi
log "torch: $TORCH_VERSION"

# Prints the horovod version when its torch extension loads and gloo is built in; fails otherwise.
HVD_CHECK='import horovod, horovod.torch as hvd
from horovod.torch import mpi_lib_v2  # the compiled extension; horovod.torch alone imports without it
assert hvd.gloo_built(), "horovod is built without gloo"
print(horovod.__version__)'

# Already usable? Then there is nothing to do.
if HVD_INSTALLED=$("$PYTHON" -c "$HVD_CHECK" 2>/dev/null); then
    log "horovod $HVD_INSTALLED already imports with torch support and gloo; nothing to do."
    [[ $HVD_INSTALLED == "$HOROVOD_VERSION" ]] || log "note: that is not $HOROVOD_VERSION; uninstall it to let this script install $HOROVOD_VERSION."
    exit 0
fi

# Wheel tags for this interpreter: cpXY and the platform (e.g. linux_x86_64, what bdist_wheel writes).
read -r PY_TAG PLAT_TAG < <("$PYTHON" -c 'import sys, sysconfig
print("cp%d%d" % sys.version_info[:2], sysconfig.get_platform().replace("-", "_").replace(".", "_"))')
[[ -n ${PLAT_TAG:-} ]] || die "could not read the wheel tags of $PY_EXE"
CACHE_DIR="$CACHE_ROOT/torch-$TORCH_VERSION"
WHEEL_GLOB="horovod-$HOROVOD_VERSION-$PY_TAG-*-$PLAT_TAG.whl"

find_cached_wheel() {
    local w
    for w in "$CACHE_DIR"/$WHEEL_GLOB; do
        [[ -f $w ]] && { printf '%s\n' "$w"; return 0; }
    done
    return 1
}

ensure_module() {  # ensure_module <import name> <pip requirement>
    if ! "$PYTHON" -c "import $1" 2>/dev/null; then
        log "installing build requirement: $2"
        "$PYTHON" -m pip install "$2"
    fi
}

build_wheel() {
    command -v cmake >/dev/null 2>&1 || die "cmake (>= 3.13) is not on PATH; install it (apt-get install cmake, or pip install cmake)"
    command -v "${CXX:-c++}" >/dev/null 2>&1 || die "no C++ compiler '${CXX:-c++}' on PATH; install g++"

    # setup.py imports setuptools and packaging, bdist_wheel may need `wheel`, and setup.py's
    # setup_requires (= install_requires) would otherwise be fetched as eggs mid-build.
    ensure_module setuptools setuptools
    ensure_module wheel wheel
    ensure_module packaging packaging
    ensure_module cloudpickle cloudpickle
    ensure_module psutil psutil
    ensure_module yaml pyyaml
    ensure_module cffi 'cffi>=1.4.0'

    local tmp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/shardfc-horovod-build.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT

    log "downloading the horovod==$HOROVOD_VERSION sdist"
    "$PYTHON" -m pip download --no-deps --no-binary :all: --dest "$tmp/sdist" "horovod==$HOROVOD_VERSION" \
        || die "could not download the horovod==$HOROVOD_VERSION sdist (see above)"
    local sdist="$tmp/sdist/horovod-$HOROVOD_VERSION.tar.gz"
    [[ -f $sdist ]] || die "pip download did not produce $sdist (got: $(ls "$tmp/sdist"))"
    local sha
    sha=$("$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$sdist")
    [[ $sha == "$HOROVOD_SDIST_SHA256" ]] || die "sha256 of $sdist is $sha, expected $HOROVOD_SDIST_SHA256"

    tar -xzf "$sdist" -C "$tmp"
    local src="$tmp/horovod-$HOROVOD_VERSION"

    # C++14 -> C++17 (torch headers need 17). Exactly one such line per file, or we stop: a changed
    # sdist must be looked at, not patched blindly.
    local f n
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        n=$(grep -c '^[[:space:]]*set(CMAKE_CXX_STANDARD 14)[[:space:]]*$' "$src/$f" || true)
        [[ $n == 1 ]] || die "expected exactly one 'set(CMAKE_CXX_STANDARD 14)' line in $f, found $n; the sdist changed, review the patch"
        sed -i 's/^\([[:space:]]*\)set(CMAKE_CXX_STANDARD 14)[[:space:]]*$/\1set(CMAKE_CXX_STANDARD 17)/' "$src/$f"
        grep -q '^[[:space:]]*set(CMAKE_CXX_STANDARD 17)[[:space:]]*$' "$src/$f" || die "patching $f failed"
        log "patched $f: CMAKE_CXX_STANDARD 14 -> 17"
    done

    local jobs=${SHARDFC_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}
    log "building the wheel with $jobs jobs (4-10 minutes on 2 cores; verbose build output follows)"
    local start=$SECONDS
    (
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
               HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
        export MAKEFLAGS="-j$jobs"
        "$PYTHON" -m pip wheel -v --no-build-isolation --no-deps --wheel-dir "$tmp/wheelhouse" "$src"
    ) || die "the horovod build failed (see the output above)"
    log "build took $((SECONDS - start)) s"

    local built
    built=$(ls "$tmp"/wheelhouse/$WHEEL_GLOB 2>/dev/null | head -n1 || true)
    [[ -n $built ]] || die "no wheel matching $WHEEL_GLOB in $tmp/wheelhouse (got: $(ls "$tmp/wheelhouse"))"

    # Atomic publish: copy next to the final name, then rename (same filesystem).
    mkdir -p "$CACHE_DIR"
    local dest="$CACHE_DIR/$(basename "$built")"
    cp "$built" "$dest.partial.$$"
    mv -f "$dest.partial.$$" "$dest"
    log "cached $dest"
}

if WHEEL=$(find_cached_wheel); then
    log "using cached wheel $WHEEL"
else
    log "no cached wheel $CACHE_DIR/$WHEEL_GLOB; building one"
    build_wheel
    WHEEL=$(find_cached_wheel) || die "the built wheel is not in $CACHE_DIR"
fi

log "installing $(basename "$WHEEL") and its runtime requirements"
"$PYTHON" -m pip install "$WHEEL"
# A same-version horovod that does not work (built against another torch, without gloo, or damaged)
# is left alone by the line above; replace it with this wheel.
if ! "$PYTHON" -c "$HVD_CHECK" >/dev/null 2>&1; then
    log "the installed horovod does not work; reinstalling it from the wheel"
    "$PYTHON" -m pip install --force-reinstall --no-deps "$WHEEL"
fi
# Not in the wheel's Requires-Dist, but hvd.broadcast_object, hvd.allgather_object and
# hvd.broadcast_optimizer_state call Tensor.numpy() and fail with "Numpy is not available" without it.
if ! "$PYTHON" -c 'import numpy' 2>/dev/null; then
    log "installing numpy (used by hvd.broadcast_object / allgather_object / broadcast_optimizer_state)"
    "$PYTHON" -m pip install numpy
fi

HVD_INSTALLED=$("$PYTHON" -c "$HVD_CHECK") || die "horovod is installed but its torch extension does not load (see above)"
log "ok: horovod $HVD_INSTALLED installed in $PY_EXE; torch extension loads, gloo built"
log "run with: horovodrun -np 2 --gloo python your_script.py"
