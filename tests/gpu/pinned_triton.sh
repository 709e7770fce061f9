#!/usr/bin/env bash
# Triton at the install line's pin for a GPU machine whose image has another Triton (the GPU checks and
# benchmarks then run the compiler that CI and users install). The wheel is ~200 MB; what a GEMM run does not
# load (libtriton's debug symbols, the profiler and CUPTI libraries, the Blackwell ptxas) goes, leaving a
# ~50 MB archive that fits where uploads are size-capped.
#   bash tests/gpu/pinned_triton.sh pack DIR       (a CPU machine with pip and binutils: writes DIR/triton-<v>-slim.tar.xz)
#   source tests/gpu/pinned_triton.sh unpack DIR   (the GPU machine: unpacks into /tmp/pinned_triton, puts it
#                                                   first on PYTHONPATH and prints the version Python imports)
# TRITON_VERSION (default 3.7.1, the README's pin) and PYTHON_VERSION (default 3.12, the GPU image's) pick the wheel.

version=${TRITON_VERSION:-3.7.1}
archive_name=triton-$version-slim.tar.xz

pack() {
  local dir=$1 work
  work=$(mktemp -d) || return 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "triton==$version" || return 1
  (cd "$work" && python3 -m zipfile -e triton-*.whl tree) || return 1
  local pkg=$work/tree/triton
  strip --strip-unneeded "$pkg/_C/libtriton.so" || return 1
  rm -rf "$pkg/_C/libproton.so" "$pkg/backends/nvidia/lib/cupti" "$pkg/backends/nvidia/bin/ptxas-blackwell"
  chmod +x "$pkg"/backends/nvidia/bin/*   # zipfile does not keep the modes
  mkdir -p "$dir" && tar cJf "$dir/$archive_name" -C "$work/tree" . || return 1
  rm -rf "$work"
  ls -l "$dir/$archive_name"
}

unpack() {
  local dir=$1 target=/tmp/pinned_triton
  rm -rf "$target" && mkdir -p "$target" && tar xJf "$dir/$archive_name" -C "$target" || return 1
  export PYTHONPATH=$target:${PYTHONPATH:-}
  python3 -c "import triton; print('triton', triton.__version__, 'from', triton.__file__)"
}

case "${1:-}" in
  pack|unpack) [[ -n "${2:-}" ]] && "$1" "$2" ;;
  *) echo "usage: bash tests/gpu/pinned_triton.sh pack DIR | source tests/gpu/pinned_triton.sh unpack DIR" >&2; false ;;
esac
