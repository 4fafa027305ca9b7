"""Call plans: what the host does for one call of a given shape, decided once and then run from C++.

NOTE [call plans]
A call's host work is a fixed sequence for a given shape: allocate its outputs, order the streams, launch
one or two kernels with arguments that are mostly constants (sizes, buffer offsets, grid shares) and a few
per-call values (tensor addresses, the call counters). `PlanBuilder` writes that sequence down once, with
every argument block packed from the kernel's parameter list (jit.spec) and the per-call values named as
slots: `inp(name)` (a tensor the caller passes, None for a null pointer), `out(name)` (a tensor the run
allocates), `scalar(name)` (an integer the caller passes; also usable as an output's size). A run
(csrc/call_plan.cpp) allocates, fills the slots, launches and, where the front-end asks, moves the work to
the communication stream and back, in one crossing from Python and without Python's per-tensor costs
(`benchmarks/results/host_cost.md`). The backend builds plans for every call it makes, the calls in
rounds included, so a call made through a cached plan (buffer.py's fast paths) and one made through the
full argument checks run the same launches.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...jit.driver import Kernel, check, libcuda
from ...jit.host import call_plans

_INPUT, _OUTPUT, _SCALAR, _ARENA_OFFSET = 0, 1, 2, 3  # csrc/call_plan.cpp's SlotKind
NO_FILL, POISON = -1, 0xAB
_EVENT_DISABLE_TIMING = 0x2


@dataclasses.dataclass(frozen=True)
class Ref:
    """A per-call value of a plan: an input tensor's address, an output's, a scalar, or where an output lies in the
    output arena (`PlanBuilder.arena_offset`)."""

    kind: int
    index: int


@functools.lru_cache(maxsize=1)
def module():
    """The host extension with the driver's entry points set (NOTE [host extension] in jit/host.py)."""
    extension = call_plans()
    lib = libcuda()
    addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                 for name in ("cuLaunchKernel", "cuEventRecord", "cuStreamWaitEvent", "cuMemsetD8Async",
                              "cuStreamIsCapturing")]
    extension.set_driver(*addresses)
    return extension


def device_constant(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, for a plan to pass by address, copied on the current stream from
    pinned memory, so that a call that makes one never waits for the GPU (a copy from pageable memory waits
    for the stream's earlier work)."""
    # On the CPU whatever torch.set_default_device says: only CPU tensors pin. Held by PyTorch's allocator until the
    # copy ends.
    host = torch.tensor(values, dtype=dtype, device="cpu").pin_memory()
    return host.to(device, non_blocking=True)


def new_event() -> int:
    """A CUDA event without timing, for ordering streams; lives as long as the process."""
    event = ctypes.c_void_p()
    check(libcuda().cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
    return event.value


class PlanBuilder:
    """Collects a plan's outputs and launches; `build()` -> a `Plan`."""

    def __init__(self, device: torch.device, inputs: Sequence[str], scalars: Sequence[str] = (),
                 poison_outputs: bool = False, arena=None):
        """`arena`: the backend's output arena (module().OutputArena, NOTE [output arena] in csrc/call_plan.cpp), or
        None: `output(..., in_arena=True)` then allocates as any other output."""
        self.device = device
        self.arena = arena
        self.input_names = tuple(inputs)
        self.scalar_names = tuple(scalars)
        self.poison_outputs = poison_outputs
        # (name, dims, dtype, fill, within, returned, order, in_arena): `within` >= 0 a part of that whole (`whole`,
        # `part`); `order` non-empty: handed back as the contiguous tensor of `dims` permuted so (`part`); `in_arena`:
        # a block of the output arena where one is free
        self.outputs: List[Tuple[str, Tuple[int, ...], torch.dtype, int, int, bool, Tuple[int, ...], bool]] = []
        self.launches = []

    def inp(self, name: str) -> Ref:
        return Ref(_INPUT, self.input_names.index(name))

    def scalar(self, name: str) -> Ref:
        return Ref(_SCALAR, self.scalar_names.index(name))

    def out(self, name: str) -> Ref:
        return Ref(_OUTPUT, [o[0] for o in self.outputs].index(name))

    def output(self, name: str, shape: Sequence, dtype: torch.dtype, zero: bool = False,
               fill: Optional[int] = None, in_arena: bool = False) -> Ref:
        """A tensor the run allocates; a dimension may be a scalar `Ref` (its value at the run). `fill`: a
        byte every byte of it starts as (0xFF: int32 -1), whatever `zero` and poisoning say. `in_arena`: in a block
        of the output arena where the builder has one and a block is free (`arena_offset` says which)."""
        self.outputs.append((name, self._dims(shape), dtype, self._fill(zero) if fill is None else fill, -1, True, (),
                             in_arena and self.arena is not None))
        return Ref(_OUTPUT, len(self.outputs) - 1)

    @staticmethod
    def arena_offset(output: Ref) -> Ref:
        """The byte offset of `output`'s block in the output arena at each run, -1 where it got none."""
        return Ref(_ARENA_OFFSET, output.index)

    def whole(self, zero: bool = False) -> int:
        """An allocation for tensors that live together (NOTE [plan allocations] in csrc/call_plan.cpp): as
        many bytes as its parts need (`part`, each 16-byte aligned), filled once. One allocation and at most
        one fill instead of one each; its memory is free when the last part is."""
        self.outputs.append((f"whole{len(self.outputs)}", (0,), torch.uint8, self._fill(zero), -1, False, (), False))
        return len(self.outputs) - 1

    def part(self, whole: int, name: str, shape: Sequence, dtype: torch.dtype, order: Sequence[int] = ()) -> Ref:
        """A tensor the run makes as a part of `whole`; a dimension may be a scalar `Ref`. With `order`, the
        caller gets the contiguous tensor of `shape` as `.permute(*order)` would show it (made so in C++)."""
        self.outputs.append((name, self._dims(shape), dtype, NO_FILL, whole, True, tuple(order), False))
        return Ref(_OUTPUT, len(self.outputs) - 1)

    def outputs_in_one(self, outputs: Sequence[Tuple[str, Sequence, torch.dtype]], zero: bool = False) -> Tuple[Ref, ...]:
        """`outputs` (name, shape, dtype) as the parts of one new whole."""
        whole = self.whole(zero)
        return tuple(self.part(whole, name, shape, dtype) for name, shape, dtype in outputs)

    def _fill(self, zero: bool) -> int:
        return 0 if zero else (POISON if self.poison_outputs else NO_FILL)

    @staticmethod
    def _dims(shape: Sequence) -> Tuple[int, ...]:
        assert all(isinstance(d, int) or d.kind == _SCALAR for d in shape), shape
        return tuple(-(d.index + 1) if isinstance(d, Ref) else int(d) for d in shape)

    def launch(self, kernel: Kernel, grid: int, args: Dict[str, object], shared_bytes: int = 0) -> None:
        """A launch of `kernel` with `args` by parameter name (KernelSpec.ordered): ints, or `Ref`s filled at
        each run."""
        spec = kernel.spec
        args = spec.ordered(args)
        shared_bytes = kernel.prepare(shared_bytes)
        block_type = spec.args_type
        constants = [0 if isinstance(a, Ref) else a for a in args]
        packed = bytes(block_type(*constants))
        slots = []
        for param, value in zip(spec.params, args):
            if isinstance(value, Ref):
                field = getattr(block_type, param.name)
                slots.append((field.offset, value.kind, value.index, field.size))
        self.launches.append((kernel.handle, grid, spec.num_threads, shared_bytes, packed, slots))

    def build(self) -> "Plan":
        native = module().Plan(self.device)
        if any(o[7] for o in self.outputs):
            native.set_arena(self.arena)
        for _, dims, dtype, fill, within, returned, order, in_arena in self.outputs:
            native.add_output(list(dims), dtype, fill, within, returned, list(order), in_arena)
        for launch in self.launches:
            native.add_launch(*launch)
        return Plan(native, tuple(o[0] for o in self.outputs if o[5]), self.input_names, self.scalar_names)


class Plan:
    """A built plan. `run_here(inputs, scalars)` launches on `stream` and returns the outputs, in order."""

    __slots__ = ("native", "output_names", "input_names", "scalar_names")

    def __init__(self, native, output_names, input_names, scalar_names):
        self.native = native
        self.output_names = output_names
        self.input_names = input_names
        self.scalar_names = scalar_names

    def run_here(self, stream: int, inputs: tuple, scalars: Sequence[int] = ()) -> tuple:
        return self.native.run(inputs, scalars, stream, 0, 0, 0, 0, False, False, 0)

    def named(self, outputs: tuple) -> Dict[str, torch.Tensor]:
        return dict(zip(self.output_names, outputs))


class PlanCache:
    """Plans by key, built at the first call of each key (`get(key, build)`)."""

    def __init__(self, limit: int = 256):
        self._plans: Dict[tuple, Plan] = {}
        self._limit = limit

    def get(self, key: tuple, build) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self._limit:  # shapes that keep changing: start over rather than grow
                self._plans.clear()
            plan = self._plans[key] = build()
        return plan


@dataclasses.dataclass(frozen=True)
class DispatchShape:
    """Everything that decides a dispatch's plans (`of`)."""

    num_tokens: int
    hidden: int
    dtype: torch.dtype
    element_size: int
    num_scales: int
    scale_dtype: Optional[torch.dtype]
    scale_strides: Tuple[int, int]
    num_topk: int
    topk_dtype: torch.dtype
    with_weights: bool
    num_experts: int
    expert_alignment: int
    num_rows: Optional[int]            # known before the count exchange: a handle's, or num_worst_tokens
    cached: bool
    num_sms: int
    round_0: bool                      # round 0 of a call in rounds (its placement makes no tensors)
    placed_rows: Optional[int]         # a later round: the whole call's tensors' rows
    placed_by_notify: bool             # the count exchange places the round (recv_first and cursor given)
    whole_call: bool                   # round 0: the whole call's counts are exchanged too
    judged: bool                       # the count exchange judges the whole call's values (request.check)
    judged_topk: bool                  # ... with its topk_idx
    all_weights: bool                  # every slot's weight arrives (DispatchRequest.all_topk_weights)
    expanded: bool                     # a dispatch into the expanded layout (DispatchRequest.expansion)
    expanded_fresh: bool               # ... that makes the layout (not cached)
    zero_fill: bool                    # ... whose padding rows are zeroed
    num_max_tokens_per_rank: int       # ... fresh: for the handle's metadata

    @classmethod
    def of(cls, request, num_ranks: int) -> "DispatchShape":
        """What decides the plans of `request` (a DispatchRequest) on `num_ranks` ranks, from its metadata (no value
        read)."""
        x, scales, placement = request.x, request.x_scales, request.placement
        cached, expansion = request.handle is not None, request.expansion
        topk_idx = request.kernel_topk_idx
        fresh = expansion is not None and expansion.fresh
        outputs = None if placement is None else placement.outputs
        return cls(
            num_tokens=x.size(0), hidden=x.size(1), dtype=x.dtype, element_size=x.element_size(),
            num_scales=0 if scales is None else scales.size(1), scale_dtype=None if scales is None else scales.dtype,
            scale_strides=(0, 0) if scales is None else (scales.stride(0), scales.stride(1)),
            num_topk=0 if topk_idx is None else topk_idx.size(1),
            topk_dtype=torch.int64 if topk_idx is None else topk_idx.dtype,
            with_weights=(not cached or expansion is not None) and request.topk_weights is not None,
            num_experts=expansion.num_experts if expansion is not None else num_ranks if cached else request.num_experts,
            expert_alignment=request.expert_alignment,
            num_rows=request.handle.num_rows if cached else (request.num_worst_tokens or None),
            cached=cached, num_sms=request.config.num_sms,
            round_0=placement is not None and outputs is None,
            placed_rows=None if outputs is None else outputs[0].size(0),
            placed_by_notify=placement is not None and placement.cursor is not None,
            whole_call=request.call is not None, judged=request.check is not None,
            judged_topk=request.check is not None and request.check.topk_idx is not None,
            all_weights=request.all_topk_weights, expanded=expansion is not None, expanded_fresh=fresh,
            zero_fill=expansion is not None and expansion.zero_fill,
            num_max_tokens_per_rank=expansion.num_max_tokens_per_rank if fresh else 0)
