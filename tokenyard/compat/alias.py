"""``python -m tokenyard.compat.alias install | uninstall | status``: make ``import deep_ep`` give tokenyard.

Megatron-LM, SGLang and vLLM look for DeepEP by its module name (``import deep_ep``, ``find_spec("deep_ep")``).
`install` writes a small package ``deep_ep`` into this interpreter's site-packages (or ``--target``) whose
modules are tokenyard's compatibility modules: ``deep_ep.Buffer`` is ``tokenyard.Buffer``, ``deep_ep.buffer``,
``deep_ep.utils`` and the rest of DeepEP's layout (``deep_ep.buffers.legacy``, ``deep_ep.utils.envs``, ...) are
``tokenyard.compat.deep_ep``'s modules (its `SUBMODULES`), and ``python -m deep_ep.benchmark`` runs tokenyard's
benchmark. It is opt-in and reversible (`uninstall` removes exactly what `install` wrote, recognised by its
marker file), and it refuses, naming what it found, wherever a real DeepEP is installed: a ``deep_ep``
importable from anywhere else, or a distribution that ships ``deep_ep/__init__.py``. tokenyard never shadows
a real DeepEP.

Exit status: 0 done, 1 refused (the message says why), 2 a bad command line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from typing import Optional

MARKER = "TOKENYARD_ALIAS"

# The alias package: every module hands over to tokenyard's own.
_INIT = '''"""DeepEP's module name, served by tokenyard (`python -m tokenyard.compat.alias uninstall` removes it)."""

import sys

from tokenyard.compat import deep_ep as _tokenyard
from tokenyard.compat.deep_ep import (Buffer, Config, ElasticBuffer, EPHandle, EventHandle,  # noqa: F401
                                      EventOverlap, __version__, buffer, buffers, get_logical_domain_size,
                                      get_physical_domain_size, topk_idx_t, utils)

# deep_ep.<name> is tokenyard.compat.deep_ep.<name>, one module under both names: `import deep_ep.buffers.legacy`
# finds it here, after this package's import, before looking for a file.
for _name in _tokenyard.SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"{_tokenyard.__name__}.{_name}"]

TOKENYARD_ALIAS = True
__all__ = _tokenyard.__all__
__getattr__ = _tokenyard.__getattr__  # AutoTuner and Benchmark load when first named
'''
_BENCHMARK = '''"""python -m deep_ep.benchmark: tokenyard's benchmark (an alias written by tokenyard.compat.alias)."""

import sys

from tokenyard.tools.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m deep_ep.benchmark"))
'''
FILES = {"__init__.py": _INIT, "benchmark.py": _BENCHMARK}


class Refused(Exception):
    """The alias cannot be installed or removed here; the message says why."""


def default_target() -> str:
    """This interpreter's site-packages (a virtual environment's, where one is active)."""
    return sysconfig.get_paths()["purelib"]


def _ours(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


def real_deep_ep(target: str) -> Optional[str]:
    """Where a real DeepEP is, if one is installed (None where there is none, or only our alias)."""
    for dist in importlib.metadata.distributions():
        for path in dist.files or ():
            if str(path).replace("\\", "/") == "deep_ep/__init__.py":
                return f"the distribution {dist.metadata['Name']} {dist.version} ({dist.locate_file(path)})"
    spec = importlib.util.find_spec("deep_ep")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if not _ours(folder):
                return f"a deep_ep package at {folder}"
    elif spec is not None:
        return f"a deep_ep module at {spec.origin}"
    folder = os.path.join(target, "deep_ep")
    if os.path.exists(folder) and not _ours(folder):
        return f"{folder}, which tokenyard did not write"
    return None


def install(target: Optional[str] = None) -> str:
    """Write the alias package into `target` (default: site-packages; made where missing). Raises Refused beside a
    real DeepEP."""
    target = target or default_target()
    found = real_deep_ep(target)
    if found is not None:
        raise Refused(f"a real DeepEP is installed here: {found}. tokenyard will not shadow it: uninstall it first "
                      "if you mean to use tokenyard under its name, or import tokenyard.compat.deep_ep directly")
    from .. import __version__

    folder = os.path.join(target, "deep_ep")
    os.makedirs(target, exist_ok=True)  # a --target that does not exist yet
    staging = tempfile.mkdtemp(prefix=".deep_ep-", dir=target)
    try:
        for name, text in FILES.items():
            with open(os.path.join(staging, name), "w") as f:
                f.write(text)
        with open(os.path.join(staging, MARKER), "w") as f:
            f.write(f"written by tokenyard {__version__}; python -m tokenyard.compat.alias uninstall removes it\n")
        if os.path.exists(folder):  # our own, from an earlier install
            shutil.rmtree(folder)
        os.rename(staging, folder)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging)
    return folder


def uninstall(target: Optional[str] = None) -> Optional[str]:
    """Remove the alias package from `target`; None where there is none. Raises Refused for a real DeepEP."""
    folder = os.path.join(target or default_target(), "deep_ep")
    if not os.path.exists(folder):
        return None
    if not _ours(folder):
        raise Refused(f"{folder} is not tokenyard's alias (no {MARKER} file): left as it is")
    shutil.rmtree(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenyard.compat.alias", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("install", "uninstall", "status"))
    parser.add_argument("--target", help="the folder to write into, made where missing (default: this "
                        "interpreter's site-packages)")
    args = parser.parse_args(argv)
    target = args.target or default_target()
    try:
        if args.action == "install":
            print(f"deep_ep now resolves to tokenyard: {install(target)}")
        elif args.action == "uninstall":
            removed = uninstall(target)
            print(f"removed {removed}" if removed else f"no deep_ep alias in {target}")
        else:
            folder = os.path.join(target, "deep_ep")
            found = real_deep_ep(target)
            print(f"real DeepEP: {found}" if found else
                  f"tokenyard's alias: {folder}" if os.path.exists(folder) else "no deep_ep installed")
    except Refused as exc:
        print(f"tokenyard.compat.alias: refused: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
