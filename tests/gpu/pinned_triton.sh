#!/usr/bin/env bash
# Triton at the install line's pin for a GPU machine whose image has another Triton (the GPU checks and
# benchmarks then run the compiler that CI and users install). The wheel is ~200 MB; what a GEMM run does not
# load (libtriton's debug symbols, the profiler and CUPTI libraries, the Blackwell ptxas) goes, leaving a
# ~53 MB archive that fits where uploads are size-capped.
#   bash tests/gpu/pinned_triton.sh pack DIR       (a CPU machine with pip and binutils: writes
#                                                   DIR/triton-<v>-slim.tar.xz)
#   source tests/gpu/pinned_triton.sh unpack DIR   (the GPU machine: unpacks into /tmp/pinned_triton, puts it
#                                                   first on PYTHONPATH, checks the version Python imports)
# TRITON_VERSION (default 3.7.1, the README's pin) and PYTHON_VERSION (default 3.12, the GPU image's) pick the wheel.
# Sourced, it changes only PYTHONPATH in the caller's shell.

_pinned_triton() {
  local mode=$1 dir=$2 version=${TRITON_VERSION:-3.7.1}
  local archive=$dir/triton-$version-slim.tar.xz target=/tmp/pinned_triton
  if [[ $mode == pack ]]; then
    local work
    work=$(mktemp -d) || return 1
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
          --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "triton==$version" ||
       ! (cd "$work" && python3 -m zipfile -e triton-*.whl tree) ||
       ! strip --strip-unneeded "$work/tree/triton/_C/libtriton.so"; then
      rm -rf "$work"; return 1
    fi
    rm -rf "$work/tree/triton/_C/libproton.so" "$work/tree/triton/backends/nvidia/lib/cupti" \
      "$work/tree/triton/backends/nvidia/bin/ptxas-blackwell"
    chmod +x "$work"/tree/triton/backends/nvidia/bin/*   # zipfile does not keep the modes
    mkdir -p "$dir" && tar cJf "$archive" -C "$work/tree" .
    local status=$?
    rm -rf "$work"
    [[ $status == 0 ]] && ls -l "$archive"
    return $status
  fi
  rm -rf "$target" && mkdir -p "$target" && tar xJf "$archive" -C "$target" || return 1
  export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import sys, triton; print('triton', triton.__version__, 'from', triton.__file__)
sys.exit(triton.__version__ != sys.argv[1])" "$version"
}

_pinned_triton_main() {
  local status=1
  if [[ $# == 2 && ($1 == pack || $1 == unpack) ]]; then
    _pinned_triton "$1" "$2"; status=$?
  else
    echo "usage: bash tests/gpu/pinned_triton.sh pack DIR | source tests/gpu/pinned_triton.sh unpack DIR" >&2
  fi
  unset -f _pinned_triton _pinned_triton_main
  return $status
}
_pinned_triton_main "$@"
