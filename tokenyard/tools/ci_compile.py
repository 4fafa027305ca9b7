"""Compile every CUDA kernel for one architecture (CI runs this without a GPU); the NVSHMEM units where NVSHMEM is
installed (the internode extra), with nvcc and nvlink whatever the compiler chosen, each also as its counting variant
(NOTE [operation counters] in include/tokenyard/operation_counts.cuh), whose unit must hold the counters. With
`--compiler nvrtc`, the units the GPU machine compiles at run time, with the compiler it uses (NVRTC rejects some
code nvcc takes, and has no C++ standard headers); the NVSHMEM units, always nvcc's, are left to the nvcc run.

    python -m tokenyard.tools.ci_compile --arch sm_90 [--compiler nvrtc]
"""

from __future__ import annotations

import argparse
import sys
import time

from ..backends.cuda import kernels, transport
from ..jit import compiler as compilers
from ..jit import nvshmem
from .bench import copy_limit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--compiler", default="nvcc", choices=("nvcc", "nvrtc"))
    args = parser.parse_args(argv)
    compiler = compilers.make_compiler(args.compiler)
    if compiler is None:
        print(f"ci_compile: no {args.compiler} on this machine", file=sys.stderr)
        return 1
    specs = list(dict.fromkeys([*kernels.every_kernel(), *copy_limit.every_kernel()]))
    if nvshmem.find() is None:  # NOTE [NVSHMEM units]: they need the internode extra
        print(f"ci_compile: skipped the NVSHMEM units ({nvshmem.missing_reason()})")
        specs = [s for s in specs if not s.nvshmem]
    if args.compiler == "nvrtc":  # what the GPU machine compiles at run time; NVSHMEM units are nvcc's alone
        specs = [s for s in specs if not s.nvshmem]
    specs += [transport.counting(s) for s in specs if s.nvshmem]
    start = time.time()
    for i, spec in enumerate(specs, 1):
        unit_compiler = nvshmem.linker() if spec.nvshmem else compiler
        cubin = unit_compiler.compile(spec.source(), args.arch, compilers.include_dirs(spec))
        if spec.entry.encode() + b"\0" not in cubin:  # NOTE [kernel names]: the symbol the driver will look up
            print(f"ci_compile: {spec.name}: no symbol {spec.entry} in the compiled unit", file=sys.stderr)
            return 1
        counters = transport.COUNTERS_SYMBOL.encode() + b"\0"
        if (counters in cubin) != (transport.COUNTING_DEFINE in spec.defines):
            print(f"ci_compile: {spec.name} {spec.defines}: the operation counters are "
                  f"{'missing from' if counters not in cubin else 'in'} the compiled unit", file=sys.stderr)
            return 1
        counting = " (counting)" if spec.defines else ""
        print(f"[{i}/{len(specs)}] {spec.function}<{', '.join(map(str, spec.template_args))}>{counting}: "
              f"{len(cubin)} bytes", flush=True)
    print(f"ci_compile: {len(specs)} kernels compiled for {args.arch} with {compiler.identity} "
          f"in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
