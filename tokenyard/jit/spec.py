"""What one JIT unit is: one #include plus one instantiation, all logic in the headers."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Optional, Tuple

# C++ parameter types a kernel may take, and how ctypes passes each. Any pointer is a c_void_p.
_SCALARS = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "float": ctypes.c_float,
}

@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel parameter: its C++ type as written in the header's function, and its name."""

    ctype: str
    name: str

    @property
    def ctypes_type(self):
        if self.ctype.endswith("*"):
            return ctypes.c_void_p
        try:
            return _SCALARS[self.ctype]
        except KeyError:
            raise ValueError(f"kernel parameter type {self.ctype!r} has no ctypes mapping") from None


# NVRTC before 13.4 has no __builtin_offsetof; its front end folds __INTADDR__ of a member's address instead.
_OFFSET_OF = ("#ifdef __CUDACC_RTC__\n#define TOKENYARD_OFFSET_OF(T, m) __INTADDR__(&((T*)0)->m)\n"
              "#else\n#define TOKENYARD_OFFSET_OF(T, m) __builtin_offsetof(T, m)\n#endif\n\n")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel: `function<template_args>(params...)` from `header`, launched with `num_threads` threads.

    NOTE [kernel parameters]
    `params` is the only list of a kernel's parameters. The generated unit (`source`) writes them as the
    fields of a struct `Params`, pins its size and every offset to the ctypes layout that `pack` fills, and
    defines ``__global__ void <name>(const __grid_constant__ Params p)`` (NOTE [kernel names]), which
    calls ``function<template_args>(p)``: the device function takes `const Params& p` (a template
    parameter of its own) and reads its parameters by name, `p.num_tokens`, so a misspelt or missing one
    fails to compile and none can be swapped. Callers name every value (`pack` of a dict).

    NOTE [kernel names]
    Profilers show a kernel by its C++ name, and DeepEP's benchmark helper (`bench_kineto` in its tests)
    finds a call's kernels by it: exactly one line of the profile may contain "dispatch" (or "combine"), and
    the trace's events are matched on "::dispatch". So each kernel is a function of a namespace per mode,
    `name` (tokenyard::normal::dispatch, tokenyard::normal::notify, tokenyard::low_latency::combine, ...),
    and only a mode's data kernels are called dispatch and combine. The entry is not extern "C": it is found
    in the module by its Itanium-ABI symbol (`entry`), which for a function of namespaces taking the
    global struct Params is written without substitutions; ci_compile checks that every compiled unit holds it.

    `header` is found under tokenyard/include, or under `include_root` (an absolute folder searched too, for
    kernels that are not the library's own, such as the benchmark's). `defines`: macros the unit defines (as 1)
    before its include, for a variant of the same kernel (the counting one of NOTE [operation counters] in
    include/tokenyard/operation_counts.cuh); none by default, and then the unit is written as it was without them.
    `shared_bytes`: the dynamic shared memory every launch gets (the normal-mode data kernels' stages, NOTE [warp
    stages] in include/tokenyard/staging.cuh); the launchers take it from here unless a launch asks for more.
    """

    header: str
    function: str
    template_args: Tuple[str, ...]
    params: Tuple[Param, ...]
    num_threads: int
    include_root: Optional[str] = None
    name: str = ""  # NOTE [kernel names]: namespace::function; default tokenyard::<the function's last part>
    nvshmem: bool = False  # calls NVSHMEM's device API: compiled and linked as NOTE [NVSHMEM units] says
    defines: Tuple[str, ...] = ()
    shared_bytes: int = 0  # dynamic shared memory of every launch

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", "tokenyard::" + self.function.rsplit("::", 1)[-1])
        # Specs key the loaded-kernel table on every launch: hash the fields once.
        object.__setattr__(self, "_hash", hash((self.header, self.function, self.template_args, self.params,
                                                self.num_threads, self.include_root, self.name, self.nvshmem,
                                                self.defines)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def entry(self) -> str:
        """The kernel's symbol (NOTE [kernel names]): `name(Params)` mangled.

        Example: tokenyard::normal::dispatch -> _ZN9tokenyard6normal8dispatchE6Params.
        """
        return "_ZN" + "".join(f"{len(part)}{part}" for part in self.name.split("::")) + "E6Params"

    def source(self) -> str:
        """The unit: the header, the parameter struct written from `params` with its layout pinned to the
        ctypes one that `pack` fills (NOTE [kernel parameters]), and the entry point."""
        fields = "".join(f"    {p.ctype} {p.name};\n" for p in self.params)
        layout = self.args_type
        offsets = "".join(f"static_assert(TOKENYARD_OFFSET_OF(Params, {p.name}) == {getattr(layout, p.name).offset}, "
                          f"\"{p.name}\");\n" for p in self.params)
        template = ", ".join(str(a) for a in self.template_args)
        namespace, function = self.name.rsplit("::", 1)
        defines = "".join(f"#define {name} 1\n" for name in self.defines)
        return (f"{defines}#include <{self.header}>\n\n"
                f"{_OFFSET_OF}"
                f"struct Params {{\n{fields}}};\n"
                f"static_assert(sizeof(Params) == {ctypes.sizeof(layout)}, \"the parameter buffer's size\");\n"
                f"{offsets}\n"
                f"namespace {namespace} {{\n"
                f"__global__ void __launch_bounds__({self.num_threads}, 1)\n"
                f"{function}(const __grid_constant__ Params p) {{\n"
                f"    ::{self.function}<{template}>(p);\n"
                f"}}\n"
                f"}}  // namespace {namespace}\n")

    @functools.cached_property
    def args_type(self):
        """A ctypes Structure laid out as the kernel's parameter buffer (natural alignment, in order).
        Kept on the instance: the cache lookup would hash every parameter on every launch."""
        return _args_type(self.params)

    def ordered(self, args) -> list:
        """The values of `args` (parameter name -> value) in the kernel's parameter order: a call names every
        parameter once, so the list of parameters here is the only place that orders them.

        Raises:
            ValueError: a parameter without a value, or a value for no parameter.
        """
        names = [p.name for p in self.params]
        missing, unknown = [n for n in names if n not in args], [n for n in args if n not in names]
        if missing or unknown:
            raise ValueError(f"{self.function}: no value for {missing}, no parameter for {unknown}")
        return [args[n] for n in names]

    def pack(self, args):
        """Kernel argument values (parameter name -> value) in one parameter buffer."""
        return self.args_type(*self.ordered(args))


@functools.lru_cache(maxsize=None)
def _args_type(params: Tuple[Param, ...]):
    return type("KernelArgs", (ctypes.Structure,), {"_fields_": [(p.name, p.ctypes_type) for p in params]})
