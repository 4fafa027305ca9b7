"""Every call of the API once, its outputs recorded by name, on every rank of a RankPool (tokenyard/tools/launch.py) or of
the GPU tests (tests/gpu/spawn.py): the same calls under torch's default device and dtype (a program that calls
`torch.set_default_device` and `torch.set_default_dtype`, as DeepEP's tests and many training scripts do) give the
same outputs; every tensor in a return and in a handle is contiguous where DeepEP's is."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import tokenyard
from tokenyard import Buffer, Config, ElasticBuffer, EPHandle
from tokenyard.tools.testing import make_rank_inputs

NUM_TOKENS, HIDDEN, NUM_TOPK, NUM_MAX = 16, 512, 4, 16  # hidden 512: UE8M0 low-latency scales, one int32 a row
TIMEOUT_S = 30.0  # a call that hangs (a tensor left on the default device) fails in seconds, not 100


def _world():
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def torch_defaults(device: Optional[str], dtype: Optional[torch.dtype]):
    """`torch.set_default_device(device)` and `torch.set_default_dtype(dtype)` for the block (None: as they are)."""
    before = torch.get_default_dtype()
    try:
        if device is not None:
            torch.set_default_device(device)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(before)


@dataclasses.dataclass
class Buffers:
    """The Buffers one pass of `api_outputs` calls, made once (NVSHMEM starts once a process)."""

    normal: Buffer
    low_latency: Buffer
    elastic: ElasticBuffer
    internode: Buffer

    def destroy(self) -> None:
        for b in (self.normal, self.low_latency, self.elastic, self.internode):
            b.destroy()


def make_buffers(backend: str, internode_backend: str, device: Optional[str] = None) -> Buffers:
    """Buffers for `api_outputs` on this rank's group: one node; low-latency; an ElasticBuffer; and a normal-mode
    Buffer on virtual nodes of half the group (2 nodes, NOTE [virtual nodes])."""
    _, num_ranks = _world()
    group, num_experts = dist.group.WORLD, 4 * num_ranks
    nvl_bytes = Config(num_max_tokens_per_rank=4 * NUM_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks)
    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(NUM_MAX, HIDDEN, num_ranks, num_experts)
    common = dict(timeout_s=TIMEOUT_S, device=device)
    return Buffers(
        normal=Buffer(group, nvl_bytes, 0, backend=backend, **common),
        low_latency=Buffer(group, 0, rdma_bytes, low_latency_mode=True, backend=backend, **common),
        elastic=ElasticBuffer(group, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                              num_gpu_timeout_secs=int(TIMEOUT_S), backend=backend, device=device),
        internode=Buffer(group, nvl_bytes, 64 << 20, backend=internode_backend, ranks_per_node=max(num_ranks // 2, 1),
                         **common))


class Outputs:
    """What the calls returned, by name: `raw` every tensor of every return and handle as it came (for its
    layout), `defined` the parts whose values the API defines (rows past a count are unspecified)."""

    def __init__(self):
        self.raw: List[Tuple[str, torch.Tensor]] = []
        self.defined: List[Tuple[str, object]] = []

    def add(self, name: str, value, defined=None) -> None:
        """Record `value` (a tensor, a tuple of tensors, a handle, a list, a number or None)."""
        if isinstance(value, EPHandle):
            for field, item in vars(value).items():
                self.add(f"{name}.{field}", item)
            return
        if isinstance(value, tuple):  # (data, scales), or a handle: by its fields' names where it has them
            names = getattr(type(value), "_fields", None) or [str(i) for i in range(len(value))]
            for field, item in zip(names, value):
                self.add(f"{name}.{field}", item)
            return
        if isinstance(value, torch.Tensor):
            self.raw.append((name, value))
        if isinstance(value, (torch.Tensor, list, int, float, bool, type(None))):
            self.defined.append((name, value if defined is None else defined))


def _random_bf16(shape, seed: int, device) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16).to(device)


def _packed_slots(packed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A low-latency output's slots below each local expert's count, one after another (the rest are unspecified)."""
    return torch.cat([packed[l, :int(n)] for l, n in enumerate(count.tolist())])


def _one_column_ue8m0_scales(num_tokens: int, device) -> torch.Tensor:
    """SGLang's FP8 scales at hidden 512: four UE8M0 exponents packed in one int32 per token, column-major with
    rows padded to 4 (TMA-aligned), so the one column's stride is not 1."""
    storage = torch.full((1, (num_tokens + 3) // 4 * 4), 127 * 0x01010101, dtype=torch.int32, device=device)
    return storage[:, :num_tokens].t()


def api_outputs(buffers: Buffers, seed: int, device) -> Outputs:
    """One pass of every API call on `buffers` (inputs on `device`), recorded."""
    rank, num_ranks = _world()
    num_experts = 4 * num_ranks
    out = Outputs()
    inputs = make_rank_inputs(seed, num_ranks, NUM_TOKENS, HIDDEN, num_experts, NUM_TOPK, "uniform", "bf16", device)
    x, topk_idx, topk_weights = inputs[rank]
    fp8 = tokenyard.quantize_fp8(x)
    bias = _random_bf16((NUM_TOKENS, HIDDEN), seed - rank, device)

    # Normal mode on one node: layout, dispatch (bf16, FP8, one-column UE8M0 scales), cached, worst case, combine.
    buffer = buffers.normal
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    out.add("layout", layout[:4])
    per_rank, _, per_expert, in_rank = layout[:4]
    given = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                 topk_idx=topk_idx, topk_weights=topk_weights)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(x, **given)
    out.add("dispatch", (recv_x, recv_idx, recv_w, per_expert_list, handle))
    out.add("dispatch_fp8", buffer.dispatch(fp8, **given)[0])
    out.add("dispatch_ue8m0", buffer.dispatch((fp8[0], _one_column_ue8m0_scales(NUM_TOKENS, device)), **given)[0])
    out.add("cached_dispatch", buffer.dispatch(x, handle=handle)[0])
    y = _random_bf16(recv_x.shape, seed + rank, device)
    out.add("combine", buffer.combine(y, handle, topk_weights=recv_w, bias=bias)[:2])
    worst = num_ranks * NUM_TOKENS
    w_x, w_idx, w_w, _, w_handle, _ = buffer.dispatch(x, num_worst_tokens=worst, **given)
    received = w_handle.recv_src_idx >= 0  # the rows past them are unspecified
    for field, value in (("recv_x", w_x), ("recv_topk_idx", w_idx), ("recv_topk_weights", w_w)):
        out.add(f"worst_dispatch.{field}", value, value[received])
    out.add("worst_dispatch.handle", w_handle)
    w_y = torch.where(received.view(-1, 1), _random_bf16(w_x.shape, seed + 5 * rank, device), 0)
    out.add("worst_combine", buffer.combine(w_y, w_handle, topk_weights=w_w)[:2])

    # Low-latency mode: FP8 (and UE8M0) and bf16, with and without a receive hook, zero-copy combine.
    buffer = buffers.low_latency
    num_local = num_experts // num_ranks
    y = _random_bf16((num_local, num_ranks * NUM_MAX, HIDDEN), seed + 7 * rank, device)
    for name, options in (("fp8", dict(use_fp8=True)), ("ue8m0", dict(use_fp8=True, round_scale=True, use_ue8m0=True)),
                          ("bf16", dict(use_fp8=False))):
        for hook in (False, True):
            tag = f"low_latency_{name}{'_hook' if hook else ''}"
            recv, count, ll_handle, _, receive = buffer.low_latency_dispatch(
                x, topk_idx, NUM_MAX, num_experts, return_recv_hook=hook, **options)
            assert (receive is None) != hook, f"{tag}: the hook is {receive!r}"
            if hook:
                receive()
            data, scales = recv if isinstance(recv, tuple) else (recv, None)
            out.add(f"{tag}.packed_recv_x", data, _packed_slots(data, count))
            if scales is not None:
                out.add(f"{tag}.packed_recv_x_scales", scales, _packed_slots(scales, count))
            out.add(f"{tag}.packed_recv_count", count)
            out.add(f"{tag}.handle.src_info", ll_handle.src_info, _packed_slots(ll_handle.src_info, count))
            out.add(f"{tag}.handle.layout_range", ll_handle.layout_range)
            combined, _, receive = buffer.low_latency_combine(y, topk_idx, topk_weights, ll_handle,
                                                              return_recv_hook=hook)
            assert (receive is None) != hook, f"{tag} combine: the hook is {receive!r}"
            if hook:
                receive()
            out.add(f"{tag}.combine", combined)
    buffer.get_next_low_latency_combine_buffer(ll_handle).copy_(y)
    out.add("low_latency_zero_copy", buffer.low_latency_combine(y, topk_idx, topk_weights, ll_handle,
                                                                zero_copy=True)[0])

    # ElasticBuffer: as received and expanded, with and without the CPU sync, cached, combine.
    elastic = buffers.elastic
    stats = torch.zeros(num_local, dtype=torch.int32, device=device)
    for do_expand, do_cpu_sync in ((False, True), (True, False)):
        tag = f"elastic_{'expanded' if do_expand else 'received'}"
        e_x, e_idx, e_w, e_handle, _ = elastic.dispatch(fp8 if do_expand else x, topk_idx, topk_weights, stats,
                                                         num_experts, expert_alignment=4, do_cpu_sync=do_cpu_sync,
                                                         do_expand=do_expand, do_zero_padding=do_expand)
        out.add(tag, (e_x, e_idx, e_w, e_handle))
        again = elastic.dispatch(fp8 if do_expand else x, handle=e_handle, topk_weights=topk_weights,
                                 do_expand=do_expand, do_zero_padding=do_expand)
        out.add(f"{tag}.cached", again[:3])
        rows = (e_x[0] if isinstance(e_x, tuple) else e_x).size(0)
        e_y = _random_bf16((rows, HIDDEN), seed + 11 * rank, device)
        out.add(f"{tag}.combine", elastic.combine(e_y, e_handle, e_w, bias)[:2])
    out.add("elastic_stats", stats)

    # Internode normal mode on 2 virtual nodes: layout, dispatch, cached dispatch, combine.
    buffer = buffers.internode
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    out.add("internode_layout", layout[:4])
    per_rank, per_rdma, per_expert, in_rank = layout[:4]
    i_x, i_idx, i_w, i_list, i_handle, _ = buffer.dispatch(
        fp8, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    out.add("internode_dispatch", (i_x, i_idx, i_w, i_list, i_handle))
    out.add("internode_cached", buffer.dispatch(fp8, handle=i_handle)[0])
    i_y = _random_bf16((i_idx.size(0), HIDDEN), seed + 13 * rank, device)
    out.add("internode_combine", buffer.combine(i_y, i_handle, topk_weights=i_w, bias=bias)[:2])
    return out


def _same(name: str, got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{name}: {type(got).__name__}, want a tensor"
        assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device), \
            f"{name}: {tuple(got.shape)} {got.dtype} {got.device}, want {tuple(want.shape)} {want.dtype} {want.device}"
        a, b = (t.contiguous().view(torch.uint8) if t.element_size() == 1 else t for t in (got, want))
        assert torch.equal(a, b), f"{name}: values differ"
    else:
        assert got == want, f"{name}: {got!r}, want {want!r}"


def same_outputs_under_torch_defaults(seed: int, default_device: str, backend: str, internode_backend: str,
                                      device: str = "cpu") -> int:
    """The calls under `torch.set_default_device(default_device)` and bf16 as the default dtype, the Buffers made
    there too, twice (the CUDA backend's fast paths take the second, NOTE [fast paths]), then without: the same
    outputs, bit for bit, on the same devices and in the same dtypes."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    with torch_defaults(default_device, torch.bfloat16):
        buffers = make_buffers(backend, internode_backend)
        under = [api_outputs(buffers, seed, device) for _ in range(2)]
    plain = api_outputs(buffers, seed, device)
    for got in under:
        assert [n for n, _ in got.defined] == [n for n, _ in plain.defined]
        for (name, value), (_, want) in zip(got.defined, plain.defined):
            _same(name, value, want)
    buffers.destroy()
    return len(plain.defined)


# Tensors DeepEP itself hands back with other strides, kept so (docs/semantics.md): low-latency FP8 scales are
# column-major in the last two axes (for TMA).
NOT_CONTIGUOUS_IN_DEEPEP = ("packed_recv_x_scales",)


def handles_and_returns_are_contiguous(seed: int, backend: str = "reference", internode_backend: str = "reference",
                                       device: str = "cpu") -> int:
    """Every tensor of every return and every handle is contiguous, where DeepEP's is (vLLM's kernels read some of
    them as plain memory, such as `psum_num_recv_tokens_per_scaleup_rank`)."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    buffers = make_buffers(backend, internode_backend)
    outputs = api_outputs(buffers, seed, device)
    strided = [f"{name} {tuple(t.shape)} strides {t.stride()}" for name, t in outputs.raw
               if not t.is_contiguous() and not name.endswith(NOT_CONTIGUOUS_IN_DEEPEP)]
    assert not strided, "not contiguous: " + "; ".join(strided)
    buffers.destroy()
    return len(outputs.raw)
