"""Compile every Gluon kernel configuration the launchers use and write normalised SASS per config to a dir:
`python wip_probe/sass_snapshot.py DIR`; compare two dirs with `diff -r`."""
import os
import re
import subprocess
import sys
import tempfile

from tp_overlap.gemm import GemmBlocks
from tp_overlap.launch.measure import compile_gluon as cg

CUOBJDUMP = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass(compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return "\n".join(re.sub(r"/\*[0-9a-f]{4}\*/", "", line).strip() for line in out.splitlines() if "/*" in line)


def configs():
    for name in ("128x256x64w4s3gl", "128x128x64w4s6gl", "128x64x64w4s8gl", "192x128x64w4s4gl",
                 "128x256x64w4s3sk1gl", "64x96x64w4s8gl", "128x96x64w4s6gl"):
        for bt in (False, True):
            yield f"gemm_{name}_{'nk' if bt else 'kn'}", lambda n=name, b=bt: cg.compile_gluon_gemm(
                GemmBlocks.parse(n), b_transposed=b)
    for name in ("128x256x64w4s3gl", "128x128x64w4s6gl"):
        for bt in (False, True):
            yield f"scatter_{name}_{'nk' if bt else 'kn'}", lambda n=name, b=bt: cg.compile_gluon_scatter_gemm(
                GemmBlocks.parse(n), b_transposed=b)
    for name in ("128x128x128w4s4gl", "128x64x128w4s4gl"):
        for gm in (True, False):
            yield f"fp8_{name}_{'gm' if gm else 'rm'}", lambda n=name, g=gm: cg.compile_fp8_gluon_gemm(
                GemmBlocks.parse(n), a_scales_group_major=g)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for label, build in configs():
        if only and not any(o in label for o in only):
            continue
        try:
            text = sass(build())
        except Exception as exc:  # noqa: BLE001
            text = f"ERROR {type(exc).__name__}: {str(exc)[-300:]}"
        with open(os.path.join(out_dir, label + ".sass"), "w") as f:
            f.write(text)
        print(label, len(text.splitlines()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
