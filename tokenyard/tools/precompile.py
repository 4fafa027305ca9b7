"""Compile ahead, into the kernel cache, the kernels a run recorded (NOTE [kernel manifest] in jit/manifest.py).

    TOKENYARD_JIT_MANIFEST=kernels.jsonl torchrun ... my_job.py     # on the GPU machine, once
    python -m tokenyard.tools.precompile kernels.jsonl [--jobs N]    # where the cache is to be filled; no GPU needed

Each kernel is compiled for the architecture it was loaded on, into TOKENYARD_CACHE_DIR, where the compiler here has
the identity the line recorded (its cache key would differ otherwise: the kernel is skipped and named). Prints how
many were compiled, found cached already, or skipped, and why.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from .. import env
from ..jit import cache, manifest
from ..jit import compiler as compilers


def compiler_for(spec):
    """The compiler `cache.compile_cubin` would use for `spec`, or None where there is none here."""
    try:
        return cache.compiler_for(spec)
    except compilers.CompileError:  # no NVRTC, nvcc or NVSHMEM here: every such kernel is skipped, and said so
        return None


def precompile(path: str, jobs: int) -> dict:
    """-> {"compiled": n, "cached": n, "skipped": [(kernel, why)]}."""
    todo, skipped, cached = [], [], 0
    for spec, arch, identity in manifest.read(path):
        compiler = compiler_for(spec)
        name = f"{spec.function}<{', '.join(map(str, spec.template_args))}> for {arch}"
        if compiler is None:
            skipped.append((name, "no compiler for it here"))
        elif compiler.identity != identity:
            skipped.append((name, f"recorded with {identity}, here {compiler.identity}"))
        elif spec.include_root is not None and not os.path.isdir(spec.include_root):
            skipped.append((name, f"its headers' folder {spec.include_root} is not here"))
        else:
            if os.path.exists(cache.cubin_path(cache.cache_key(spec, arch, identity))):
                cached += 1
            else:
                todo.append((spec, arch))
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(lambda item: cache.compile_cubin(*item), todo))
    return {"compiled": len(todo), "cached": cached, "skipped": skipped}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    done = precompile(args.manifest, args.jobs)
    print(f"precompile: {done['compiled']} kernels compiled into {env.settings().cache_dir}, {done['cached']} cached "
          f"already, {len(done['skipped'])} skipped")
    for name, why in done["skipped"]:
        print(f"  skipped {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
