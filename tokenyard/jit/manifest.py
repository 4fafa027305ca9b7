"""The kernels a process loaded, written down so that another machine can compile them ahead (NOTE [kernel
manifest]).

NOTE [kernel manifest]
With TOKENYARD_JIT_MANIFEST naming a file, every kernel a process loads is appended to it once, as one JSON line:
the spec's fields, the target architecture and the compiler's identity (what the cache key holds besides the source,
NOTE [kernel cache]). `python -m tokenyard.tools.precompile FILE` then compiles each line's kernel into the kernel
cache, on any machine whose compiler has that identity: a container build, CI, or a developer's machine before a
session on a GPU machine whose time counts. The GPU is not needed to compile. A spec's include_root (the benchmark's
own headers) is written relative to the tokenyard package, so the line reads the same in any checkout. Writers
append under an flock: the ranks of one machine share the file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import threading
from typing import Iterator, Optional, Set, Tuple

from .spec import KernelSpec, Param

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_written: Set[Tuple[KernelSpec, str]] = set()
_lock = threading.Lock()


def line_of(spec: KernelSpec, arch: str, identity: str) -> str:
    fields = dataclasses.asdict(spec)
    if spec.include_root is not None:
        fields["include_root"] = os.path.relpath(spec.include_root, _PACKAGE)
    return json.dumps({"arch": arch, "identity": identity, "spec": fields}, sort_keys=True)


def spec_of(fields: dict) -> KernelSpec:
    root = fields.get("include_root")
    return KernelSpec(fields["header"], fields["function"], tuple(fields["template_args"]),
                      tuple(Param(**p) for p in fields["params"]), fields["num_threads"],
                      None if root is None else os.path.normpath(os.path.join(_PACKAGE, root)), fields["name"],
                      fields["nvshmem"], tuple(fields["defines"]), fields["shared_bytes"])


def record(path: str, spec: KernelSpec, arch: str, identity: str) -> None:
    """Append `spec`'s line to `path`, once per process."""
    with _lock:
        if (spec, arch) in _written:
            return
        _written.add((spec, arch))
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line_of(spec, arch, identity) + "\n")


def read(path: str) -> Iterator[Tuple[KernelSpec, str, Optional[str]]]:
    """Each distinct kernel of the file: (spec, arch, identity), in the order first written."""
    seen = set()
    with open(path) as f:
        for line in f:
            if line.strip() and line not in seen:
                seen.add(line)
                entry = json.loads(line)
                yield spec_of(entry["spec"]), entry["arch"], entry.get("identity")
