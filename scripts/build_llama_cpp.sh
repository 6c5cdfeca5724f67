#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-batched-bench and llama-bench: the CPU peer that
# scripts/bench_serve.py and scripts/bench_single.py measure chunk-llama against.
#
# The sources are the ones the llama-cpp-python sdist on PyPI vendors (vendor/llama.cpp), so
# the build needs only PyPI and cmake, and a given sdist version always means the same
# llama.cpp commit. The build is what a user of this CPU would make: Release, CPU only
# (no CUDA even where nvcc exists), GGML_NATIVE on (tuned to this CPU's ISA), static binaries.
#
# The binaries live outside the repository, in
#   ${CHUNK_LLAMA_PEERS_DIR:-$HOME/.cache/chunk_llama/peers}/llama.cpp-<sdist version>/bin
# beside build-info.txt (sdist version, llama.cpp commit, ggml version, flags, compiler, CPU).
# An existing build is reused. The last line on stdout is the bin folder; everything else goes
# to stderr.
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build (default below; "latest" asks PyPI)
#   LLAMA_CPP_SDIST           a local llama_cpp_python-*.tar.gz to use instead of downloading
#   CHUNK_LLAMA_PEERS_DIR     where builds are cached
#   LLAMA_CPP_ISA             native (default: -march=native) or avx2 (AVX2, FMA, F16C and no
#                             AVX-512: what an AVX2-only CPU runs, to compare with chunk-llama's
#                             AVX2 variant on an AVX-512 host); an avx2 build is cached as
#                             llama.cpp-<version>-avx2
#   JOBS                      parallel compile jobs (default 2)
#   PYTHON                    the python whose pip downloads the sdist (default python3)
set -euo pipefail

# Pinned so that two machines (and two runs months apart) build the same llama.cpp.
DEFAULT_VERSION=0.3.36
VERSION=${LLAMA_CPP_PYTHON_VERSION:-$DEFAULT_VERSION}
PEERS_DIR=${CHUNK_LLAMA_PEERS_DIR:-$HOME/.cache/chunk_llama/peers}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}

log() { echo "build_llama_cpp: $*" >&2; }
die() { log "$*"; exit 2; }

ISA=${LLAMA_CPP_ISA:-native}
case "$ISA" in
    native) isa_flags=(-DGGML_NATIVE=ON); suffix="" ;;  # -march=native: what a user of this CPU builds
    avx2) isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                     -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
          suffix="-avx2" ;;
    *) die "LLAMA_CPP_ISA must be native or avx2, got $ISA" ;;
esac

command -v cmake >/dev/null || die "cmake not found (apt-get install cmake, or pip install cmake)"
command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler found"

work=$(mktemp -d "${TMPDIR:-/tmp}/build_llama_cpp.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Find the sdist (and so the version) before looking for a cached build.
sdist=""
if [ -n "${LLAMA_CPP_SDIST:-}" ]; then
    [ -f "$LLAMA_CPP_SDIST" ] || die "LLAMA_CPP_SDIST=$LLAMA_CPP_SDIST is not a file"
    sdist=$LLAMA_CPP_SDIST
    VERSION=$(basename "$sdist" | sed -E 's/^llama_cpp_python-(.*)\.tar\.gz$/\1/')
elif [ "$VERSION" = latest ]; then
    log "downloading the newest llama-cpp-python sdist"
    "$PY" -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python -d "$work" >&2 \
        || die "pip download llama-cpp-python failed"
    sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
    VERSION=$(basename "$sdist" | sed -E 's/^llama_cpp_python-(.*)\.tar\.gz$/\1/')
fi

dest="$PEERS_DIR/llama.cpp-$VERSION$suffix"
bin="$dest/bin"
if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-batched-bench" ] && [ -f "$dest/build-info.txt" ]; then
    log "reusing $bin ($(grep '^llama.cpp commit' "$dest/build-info.txt" || true))"
    echo "$bin"
    exit 0
fi

mkdir -p "$PEERS_DIR"
# One build at a time per version: a second caller waits, then finds the binaries.
exec 9>"$dest.lock"
flock 9
if [ -x "$bin/llama-server" ] && [ -x "$bin/llama-batched-bench" ] && [ -f "$dest/build-info.txt" ]; then
    echo "$bin"
    exit 0
fi

if [ -z "$sdist" ]; then
    log "downloading the llama-cpp-python $VERSION sdist"
    "$PY" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work" >&2 \
        || die "pip download llama-cpp-python==$VERSION failed"
    sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
fi
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || die "no vendor/llama.cpp in $sdist"

# The sdist carries no .git: llama.cpp's own build info would say "unknown". The commit is the
# one llama-cpp-python's changelog names for this version ("update llama.cpp to ...@<sha>").
commit=$(awk -v v="## [$VERSION]" '
    index($0, v) == 1 { inside = 1; next }
    inside && /^## \[/ { exit }
    inside && match($0, /llama\.cpp@[0-9a-f]+/) { print substr($0, RSTART + 10, RLENGTH - 10); exit }
' "$work/llama_cpp_python-$VERSION/CHANGELOG.md" 2>/dev/null || true)
commit=${commit:-unknown}
ggml_version=$(sed -nE 's/^set\(GGML_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+)\)/\2/p' "$src/ggml/CMakeLists.txt" | paste -sd.)

flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF          # self-contained binaries, movable into the cache
    "${isa_flags[@]}"
    -DGGML_CUDA=OFF                  # the CPU peer, even where nvcc exists
    -DLLAMA_CURL=OFF                 # no model downloads (ignored by versions that dropped curl)
    -DLLAMA_OPENSSL=OFF              # no HTTPS needed on localhost
    -DLLAMA_BUILD_UI=OFF             # no npm build of the web UI
    -DLLAMA_USE_PREBUILT_UI=OFF      # and no download of a prebuilt one at build time
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    "-DLLAMA_BUILD_COMMIT=$commit"
)
log "configuring llama.cpp $commit (llama-cpp-python $VERSION) in $work/build"
cmake -S "$src" -B "$work/build" "${flags[@]}" >&2
targets=(llama-server llama-batched-bench llama-bench)
log "building ${targets[*]} with $JOBS jobs (about 10 minutes on 2 cores)"
start=$(date +%s)
cmake --build "$work/build" --config Release -j "$JOBS" --target "${targets[@]}" >&2
seconds=$(( $(date +%s) - start ))

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/bin"
for t in "${targets[@]}"; do
    cp "$work/build/bin/$t" "$dest.tmp/bin/"
done
{
    echo "llama-cpp-python sdist: $VERSION"
    echo "llama.cpp commit: $commit"
    echo "ggml version: $ggml_version"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${seconds}s with $JOBS jobs"
    echo "compiler: $(c++ --version | head -1)"
    echo "cmake: $(cmake --version | head -1)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //')"
    echo "flags: ${flags[*]}"
    echo "targets: ${targets[*]}"
} > "$dest.tmp/build-info.txt"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
log "built in ${seconds}s: $(tr '\n' ';' < "$dest/build-info.txt" | cut -c1-200)"
echo "$bin"
