"""The on-disk kernel cache (NOTE [kernel cache] in tokenyard/jit/cache.py), with a stand-in compiler: one
process compiles a unit while the others wait, a damaged file is compiled again, and a cache that cannot be
written gives an error naming the kernel and the path."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from tokenyard.jit import cache
from tokenyard.jit.spec import KernelSpec, Param

SPEC = KernelSpec("tokenyard/kernels/example.cuh", "tokenyard::kernels::example", ("7", "int64_t"),
                  (Param("int", "n"),), 128)


class _Compiler:
    """Compiles slowly to a fixed cubin and counts its compiles in a file (shared by processes)."""

    identity = "stand-in 1.0"

    def __init__(self, log: str):
        self.log = log

    def compile(self, source, arch, include_dirs):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return b"\x7fELF cubin of " + source.encode()[:32]


def _compile_in(folder: str, log: str) -> bytes:
    cache._compiler = _Compiler(log)
    return cache.compile_cubin(SPEC, "sm_90a", folder)


def test_processes_that_want_one_kernel_compile_it_once_and_all_read_it(tmp_path):
    log = str(tmp_path / "compiles.log")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        cubins = pool.starmap(_compile_in, [(str(tmp_path / "cache"), log)] * 4)
    assert len(set(cubins)) == 1 and cubins[0].startswith(b"\x7fELF")
    with open(log) as f:
        assert len(f.read().split()) == 1, "more than one process compiled the kernel"


def test_a_damaged_cache_file_is_compiled_again_and_replaced(tmp_path, monkeypatch):
    log = str(tmp_path / "compiles.log")
    monkeypatch.setattr(cache, "_compiler", _Compiler(log))
    folder = str(tmp_path / "cache")
    cubin = cache.compile_cubin(SPEC, "sm_90a", folder)
    (path,) = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
               if name.endswith(".cubin")]
    with open(path, "rb") as f:
        assert cache.without_trailer(f.read()) == cubin
    for damage in (lambda b: b[:-5], lambda b: b"", lambda b: b[:10] + b"X" + b[11:], lambda b: cubin):
        with open(path, "rb") as f:
            stored = f.read()
        with open(path, "wb") as f:
            f.write(damage(stored))
        assert cache.compile_cubin(SPEC, "sm_90a", folder) == cubin
        with open(path, "rb") as f:
            assert cache.without_trailer(f.read()) == cubin, "the damaged file was not replaced"
    with open(log) as f:
        assert len(f.read().split()) == 5  # the first compile and one per damage
    assert not [n for _, _, names in os.walk(folder) for n in names if n.endswith(".tmp")]


def test_a_cache_that_cannot_be_written_names_the_kernel_and_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_compiler", _Compiler(str(tmp_path / "compiles.log")))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    with pytest.raises(cache.KernelCacheError, match=r"tokenyard::kernels::example<7, int64_t>.*not-a-folder"):
        cache.compile_cubin(SPEC, "sm_90a", str(blocked))


def test_the_key_follows_the_headers_a_unit_includes_and_no_others(tmp_path):
    """NOTE [kernel cache]: a header the unit reaches (through another, by a relative name) changes its key;
    a header it does not include leaves the key alone."""
    root = tmp_path / "include"
    (root / "mine").mkdir(parents=True)
    (root / "mine" / "top.cuh").write_text('#pragma once\n#include "../common.cuh"\n#include <cuda_bf16.h>\n')
    (root / "common.cuh").write_text("#pragma once\nconstexpr int kValue = 1;\n")
    (root / "other.cuh").write_text("#pragma once\n")
    spec = KernelSpec("mine/top.cuh", "mine::top", (), (Param("int", "n"),), 32, include_root=str(root))
    before = cache.cache_key(spec, "sm_90a", "stand-in")
    (root / "other.cuh").write_text("#pragma once\nconstexpr int kOther = 2;\n")
    assert cache.cache_key(spec, "sm_90a", "stand-in") == before
    (root / "common.cuh").write_text("#pragma once\nconstexpr int kValue = 2;\n")
    assert cache.cache_key(spec, "sm_90a", "stand-in") != before


def test_a_manifest_records_each_kernel_loaded_once_and_precompile_fills_another_cache(tmp_path, monkeypatch,
                                                                                         tokenyard_env, capsys):
    """NOTE [kernel manifest]: a run's kernels, written down; compiled ahead into an empty cache where the compiler
    has the identity they were recorded with (the same keys, so the run would find them), skipped and named where
    it has another."""
    from tokenyard.jit import manifest
    from tokenyard.tools import precompile
    from tokenyard.tools.bench import copy_limit

    monkeypatch.setattr(manifest, "_written", set())
    path = tmp_path / "kernels.jsonl"
    tokenyard_env("TOKENYARD_JIT_MANIFEST", str(path))
    other = next(iter(copy_limit.every_kernel()))  # a spec with an include_root of its own
    monkeypatch.setattr(cache, "_compiler", _Compiler(str(tmp_path / "log")))
    run_cache = tmp_path / "run"
    first = [cache.compile_cubin(s, "sm_90a", str(run_cache)) for s in (SPEC, other, SPEC)]
    assert len(path.read_text().splitlines()) == 2
    assert [s for s, _, _ in manifest.read(str(path))] == [SPEC, other]

    tokenyard_env("TOKENYARD_JIT_MANIFEST", None)
    tokenyard_env("TOKENYARD_CACHE_DIR", str(tmp_path / "ahead"))
    assert precompile.main([str(path), "--jobs", "2"]) == 0
    assert "2 kernels compiled" in capsys.readouterr().out
    ahead = sorted(p.relative_to(tmp_path / "ahead") for p in (tmp_path / "ahead").rglob("*.cubin"))
    assert ahead == sorted(p.relative_to(run_cache) for p in run_cache.rglob("*.cubin")) and len(ahead) == 2
    assert cache.compile_cubin(SPEC, "sm_90a") == first[0]  # found there: no compile
    assert precompile.main([str(path)]) == 0 and "0 kernels compiled" in capsys.readouterr().out

    monkeypatch.setattr(cache._compiler, "identity", "stand-in 2.0")
    assert precompile.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 skipped" in out and "recorded with stand-in 1.0, here stand-in 2.0" in out
