"""The SASS of every Gluon GEMM build the launchers use, compiled for sm_90 on the CPU (Triton's own ptxas and
cuobjdump), one normalised file per build: a change whose files are unchanged (`diff -r` of two runs) left
those kernels' machine code as it was, so their GPU checks and timings still hold.

    python -m tp_overlap.launch.compile_check --sass DIR [--only scatter,fp8]
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from tp_overlap.gemm import GemmBlocks
from tp_overlap.gemm.fp8_gluon_launch import splits_tail

from .compile_gluon import (compile_fp8_gluon_gemm, compile_gluon_gemm, compile_gluon_reduce_gemm,
                            compile_gluon_scatter_gemm)

# (label, build): the bf16 GEMM's tile shapes (one and three consumer warpgroups, two B boxes, a split tail) in
# both layouts, the scatter (also two B boxes wide) and scatter-reduce GEMMs', the FP8 GEMM's with both A scale layouts
GEMM_BUILDS = ("128x256x64w4s3gl", "128x128x64w4s6gl", "128x64x64w4s8gl", "192x128x64w4s4gl", "128x256x64w4s3sk1gl",
               "64x96x64w4s8gl", "128x96x64w4s6gl")
SCATTER_BUILDS = ("128x256x64w4s3gl", "128x128x64w4s6gl", "128x144x64w4s5gl")
FP8_BUILDS = ("128x128x128w4s4gl", "128x64x128w4s4gl", "128x256x128w4s3gl")


def builds():
    """[(label, zero-argument compile)] of every build `write_sass` writes."""
    out = []
    for name in GEMM_BUILDS:
        for nk in (False, True):
            out.append((f"gemm_{name}_{'nk' if nk else 'kn'}",
                        lambda n=name, t=nk: compile_gluon_gemm(GemmBlocks.parse(n), b_transposed=t)))
    for name in SCATTER_BUILDS:
        for nk in (False, True):
            out.append((f"scatter_{name}_{'nk' if nk else 'kn'}",
                        lambda n=name, t=nk: compile_gluon_scatter_gemm(GemmBlocks.parse(n), b_transposed=t)))
            if not GemmBlocks.parse(name).gluon_boxes:  # the scatter-reduce GEMM runs one-box tiles only
                out.append((f"reduce_{name}_{'nk' if nk else 'kn'}",
                            lambda n=name, t=nk: compile_gluon_reduce_gemm(GemmBlocks.parse(n), b_transposed=t)))
    for name in FP8_BUILDS:
        for group_major in (True, False):
            for split in (True, False)[not splits_tail(GemmBlocks.parse(name).block_n):]:
                out.append((f"fp8_{name}_{'group_major' if group_major else 'row_major'}{'' if split else '_whole'}",
                            lambda n=name, g=group_major, t=split: compile_fp8_gluon_gemm(
                                GemmBlocks.parse(n), a_scales_group_major=g, split_tail=t)))
    return out


def sass_text(compiled) -> str:
    """The kernel's SASS without addresses and encodings (cuobjdump -sass of its cubin)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True,
                              timeout=300).stdout
    lines = (re.sub(r"/\*[0-9a-f]{4,}\*/|;\s*/\*.*\*/", "", line).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("/*")) + "\n"


def write_sass(out_dir: str, only: tuple[str, ...] = ()) -> list[str]:
    """Write `<label>.sass` per build (those whose label contains one of `only`, or all) into `out_dir`; returns
    the labels written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for label, build in builds():
        if only and not any(part in label for part in only):
            continue
        with open(os.path.join(out_dir, f"{label}.sass"), "w") as f:
            f.write(sass_text(build()))
        written.append(label)
    return written
