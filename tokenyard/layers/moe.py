"""An expert-parallel Mixture-of-Experts layer built on tokenyard's differentiable dispatch and combine.

Rank r of R holds experts ``r*L .. r*L+L-1`` (L = E / R) and a replica of the router and of any shared
expert. A forward pass routes this rank's tokens, dispatches them to the experts' ranks, runs the local
experts on what arrived, sums each received token's expert outputs with their top-k weights, and combines
the sums back to the tokens' ranks. Weight names follow Hugging Face transformers' fused MoE modules
(``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.{gate,up,down}_proj``),
so dense weights load by slicing or `load_state_dict`.

Gradients: the local experts' gradients are complete on their rank (every token that used them arrived
there); the router's and the shared expert's are this rank's tokens' share, to be summed over the ranks
as for any data-parallel replica.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import env
from ..buffer import Buffer
from ..config import DEEPEP_RANKS_PER_NODE, Config
from ..elastic import ElasticBuffer
from ..errors import InvalidInputError
from . import autograd

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

Activation = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _activation(hidden_act: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(hidden_act):
        return hidden_act
    if hidden_act not in _ACTIVATIONS:
        raise InvalidInputError(f"unknown hidden_act {hidden_act!r}; choose from {', '.join(_ACTIVATIONS)} "
                                "or pass a callable")
    return _ACTIVATIONS[hidden_act]


def grouped_gemm_kind(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """How a rank's experts multiply rows grouped by expert: ``torch._grouped_mm`` for bf16 on a GPU that has it
    (sm90+), else one GEMM per expert."""
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and \
            torch.cuda.get_device_capability(device)[0] >= 9:
        return "torch._grouped_mm"
    return "loop over experts"


def gated_experts_on_groups(x: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                            act_fn: Callable[[torch.Tensor], torch.Tensor], kind: str,
                            row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [n, H]`` grouped by local expert, expert l's rows ending at ``ends[l]`` (int32 ``[L]`` on x's device;
    rows past the last end are not read, and their outputs are unspecified) -> ``[n, H]``:
    ``down[l] @ (act(gate[l] x) * up[l] x * w)``, where ``w`` is the row's weight (`row_weights` ``[n]``,
    rounded to x's dtype; 1 where None). The weight scales the activation, as Megatron's fused weighted SwiGLU
    does: I products per row rather than H. `kind`: `grouped_gemm_kind`'s.

    ``gate_up [L, 2*I, H]`` (gate rows, then up rows), ``down [L, H, I]``: `GatedExperts`' parameters.
    """
    def activation(h: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        act = act_fn(gate) * up
        return act if weights is None else act * weights[:, None].to(act.dtype)

    if kind == "torch._grouped_mm":
        act = activation(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=ends), row_weights)
        return torch._grouped_mm(act, down.transpose(-2, -1), offs=ends)
    outs, begin = [], 0
    for expert, end in enumerate(ends.tolist()):
        weights = None if row_weights is None else row_weights[begin:end]
        outs.append(F.linear(activation(F.linear(x[begin:end], gate_up[expert]), weights), down[expert]))
        begin = end
    return torch.cat(outs + [x.new_zeros(x.size(0) - begin, x.size(1))])


def group_ends(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 ``[L]``: where each expert's rows end, for rows grouped by expert `counts` each. From pinned memory
    without a wait on a GPU: a plain copy from a list would make the host wait for the stream."""
    ends = torch.tensor(list(counts), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return ends.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ends


def rows_by_expert(recv_topk_idx: torch.Tensor, num_local: int, counts: Optional[Sequence[int]] = None):
    """``(rows, slots, counts)``: the (received row, top-k slot) pairs of local experts, grouped by expert in
    received order (a stable sort), and each expert's count: `counts` where the dispatch gave them (its
    ``num_recv_tokens_per_expert_list``, on the host already), else read back from the device (a host sync)."""
    flat = recv_topk_idx.masked_fill(recv_topk_idx < 0, num_local).flatten()
    order = torch.sort(flat, stable=True).indices
    if counts is None:
        counts = torch.bincount(flat, minlength=num_local + 1)[:num_local].tolist()
    order = order[:sum(counts)]
    return order // recv_topk_idx.size(1), order % recv_topk_idx.size(1), list(counts)


def experts_on_received(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
                        kind: str, counts: Optional[Sequence[int]] = None):
    """The experts on normal-mode rows: ``out[i] = sum_k w[i, k] * expert_k(recv_x[i])`` over local ``recv_topk_idx``
    (-1: another rank's expert), summed in float32 in expert order and returned in recv_x's dtype. The pairs are
    grouped by expert (`rows_by_expert`, `counts` as there) and each expert's rows multiplied together
    (`gated_experts_on_groups`). -> (out, the rows grouped by expert, counts)."""
    rows, slots, counts = rows_by_expert(recv_topk_idx, gate_up.size(0), counts)
    grouped = recv_x[rows]
    if not sum(counts):
        # Nothing arrived. Still hand back a result that depends on recv_x, so that this rank's backward
        # reaches the combine and the dispatch which every other rank's backward waits for.
        return recv_x * 0, grouped, counts
    y = gated_experts_on_groups(grouped, group_ends(counts, recv_x.device), gate_up, down, act_fn, kind).float()
    y = y * recv_topk_weights[rows, slots].float()[:, None]
    out = torch.zeros(recv_x.size(0), recv_x.size(1), dtype=torch.float32, device=recv_x.device)
    begin = 0
    for count in counts:  # an expert's rows are distinct: each add is one per row, in expert order
        if count:
            out.index_add_(0, rows[begin:begin + count], y[begin:begin + count])
        begin += count
    return out.to(recv_x.dtype), grouped, counts


def make_buffer(group: dist.ProcessGroup, hidden_size: int, num_max_tokens_per_rank: int,
                dtype: torch.dtype = torch.bfloat16, *, backend: Optional[str] = None,
                elastic: bool = False) -> Union[Buffer, ElasticBuffer]:
    """A normal-mode `Buffer` (or, with `elastic`, an `ElasticBuffer`) for an MoE layer's forward and backward.

    Naive equivalent: ``Buffer(group, config.get_nvl_buffer_size_hint(hidden_bytes, R),
    config.get_rdma_buffer_size_hint(hidden_bytes, R))`` with ``config = Config(num_max_tokens_per_rank=N)`` and
    ``hidden_bytes = hidden_size * max(element_size, 2)`` (under TOKENYARD_RANKS_PER_NODE, the NVSHMEM bytes of
    nodes of that many ranks: `Config.internode_region_bytes`); ``ElasticBuffer(group, the NVLink bytes,
    num_max_tokens_per_rank=N, hidden=hidden_size)``.

    Arguments:
        group: the EP group.
        hidden_size: H.
        num_max_tokens_per_rank: the most tokens one rank passes to the layer at once.
        dtype: the activations' dtype (float32 rows are twice as wide as bf16 rows).
        backend: as `Buffer(backend=...)`.
        elastic: an `ElasticBuffer`, with which `ExpertParallelMoE` runs bf16 activations through the expanded
            layout (NOTE [expanded experts]).
    Raises:
        BackendUnavailableError: as `Buffer`.
    """
    hidden_bytes = hidden_size * max(dtype.itemsize, 2)
    num_max = max(int(num_max_tokens_per_rank), 1)
    config = Config(num_max_tokens_per_rank=num_max)
    num_bytes = config.get_nvl_buffer_size_hint(hidden_bytes, group.size())
    if elastic:
        return ElasticBuffer(group, num_bytes, num_max_tokens_per_rank=num_max, hidden=hidden_size, backend=backend)
    # Across nodes normal mode keeps its rows in NVSHMEM memory (NOTE [internode region]): nodes of 8 ranks as
    # DeepEP's hint assumes, or of TOKENYARD_RANKS_PER_NODE where set, as the Buffer sees them.
    ranks_per_node = env.settings().ranks_per_node or DEEPEP_RANKS_PER_NODE
    return Buffer(group, num_bytes, config.internode_region_bytes(hidden_bytes, group.size(), ranks_per_node),
                  backend=backend)


class TopKRouter(nn.Module):
    """Each token's top-k experts and their weights.

    Naive equivalent, ``scoring="softmax"`` (Mixtral, Qwen2-MoE)::

        probs = softmax(float32(x @ weight.T))
        topk_weights, topk_idx = probs.topk(K)
        if norm_topk_prob: topk_weights /= topk_weights.sum(-1, keepdim=True) + 1e-20
        topk_weights *= routed_scaling_factor

    ``scoring="sigmoid"`` (DeepSeek-V3): ``scores = sigmoid(x @ weight.T)`` take the place of `probs`, and
    experts are chosen by ``scores + e_score_correction_bias`` while the weights are the chosen `scores`.
    With ``num_groups > 1`` the choice is made only among the experts of the `num_topk_groups` best of
    `num_groups` equal groups (a group scores the sum of its two best), for either scoring.

    Shapes: ``x [T, H]`` -> ``topk_idx [T, K]`` int64, ``topk_weights [T, K]`` float32. The logits are
    computed in x's dtype, or in float32 with `logits_in_float32` (DeepSeek-V3 does).

    Raises:
        InvalidInputError: at construction, for K above E, an unknown scoring, or groups that do not
        divide E (or hold fewer than two experts).
    """

    def __init__(self, hidden_size: int, num_experts: int, num_topk: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, num_groups: int = 1,
                 num_topk_groups: int = 1, logits_in_float32: bool = False, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if not 1 <= num_topk <= num_experts:
            raise InvalidInputError(f"num_topk={num_topk} must be in [1, num_experts={num_experts}]")
        if scoring not in ("softmax", "sigmoid"):
            raise InvalidInputError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if num_groups < 1 or num_experts % num_groups != 0 or not 1 <= num_topk_groups <= num_groups:
            raise InvalidInputError(f"{num_experts} experts cannot form {num_groups} groups with "
                                    f"{num_topk_groups} chosen")
        if num_groups > 1 and num_experts // num_groups < 2:
            raise InvalidInputError("each expert group needs at least two experts (a group scores its best two)")
        self.hidden_size, self.num_experts, self.num_topk = hidden_size, num_experts, num_topk
        self.scoring, self.norm_topk_prob = scoring, norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.num_groups, self.num_topk_groups = num_groups, num_topk_groups
        self.logits_in_float32 = logits_in_float32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=hidden_size ** -0.5)
        if scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32,
                                                                     device=device))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor):
        if self.logits_in_float32:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight)
        if self.scoring == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
            choice_scores = scores
        else:
            scores = logits.float().sigmoid()
            choice_scores = scores + self.e_score_correction_bias.float()
        topk_idx = self._grouped_choice(choice_scores.detach())
        topk_weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            # 1e-20 only guards an all-zero row: it is below the float32 rounding of any real sum.
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx.to(torch.int64), topk_weights * self.routed_scaling_factor

    def _grouped_choice(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """Top-k of `choice_scores` among the experts of the best `num_topk_groups` groups."""
        if self.num_groups > 1:
            grouped = choice_scores.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best_groups = group_scores.topk(self.num_topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice_scores)
            choice_scores = choice_scores.masked_fill(~keep, float("-inf"))
        return choice_scores.topk(self.num_topk, dim=-1).indices


class GatedMLP(nn.Module):
    """One dense gated MLP, as a shared expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``.

    Shapes: ``[..., H]`` -> ``[..., H]`` in the weights' dtype. The parameter names are transformers'
    (``gate_proj``, ``up_proj``, ``down_proj``), so a transformers MLP's state dict loads as it is.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: Activation = "silu", *,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.act_fn = _activation(hidden_act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GatedExperts(nn.Module):
    """This rank's L experts, expert l computing ``down_proj[l] @ (act(gate(x)) * up(x))``.

    Naive equivalent of `forward`: ``out[i] = sum_k recv_topk_weights[i, k] *
    expert[recv_topk_idx[i, k]](recv_x[i])`` over the k with ``recv_topk_idx[i, k] >= 0``.

    Parameters: ``gate_up_proj [L, 2*I, H]`` (the gate's I rows, then the up projection's, as in
    transformers' fused experts) and ``down_proj [L, H, I]``.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: Activation = "silu", *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.num_local_experts, self.hidden_size = num_local_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.act_fn = _activation(hidden_act)
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size,
                                                  dtype=dtype, device=device))
        nn.init.normal_(self.gate_up_proj, std=hidden_size ** -0.5)
        nn.init.normal_(self.down_proj, std=intermediate_size ** -0.5)

    @classmethod
    def from_dense(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, rank: int, num_ranks: int,
                   hidden_act: Activation = "silu") -> "GatedExperts":
        """Rank `rank`'s share of all E experts: experts ``rank*L .. rank*L+L-1`` (copied).

        Shapes: ``gate_up_proj [E, 2*I, H]``, ``down_proj [E, H, I]``.

        Raises:
            InvalidInputError: shapes that disagree, or E not divisible by `num_ranks`.
        """
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise InvalidInputError("gate_up_proj must be [E, 2*I, H] and down_proj [E, H, I]")
        num_experts, two_intermediate, hidden = gate_up_proj.shape
        if two_intermediate % 2 or tuple(down_proj.shape) != (num_experts, hidden, two_intermediate // 2):
            raise InvalidInputError(f"gate_up_proj {list(gate_up_proj.shape)} and down_proj "
                                    f"{list(down_proj.shape)} do not describe the same experts")
        if num_experts % num_ranks:
            raise InvalidInputError(f"{num_experts} experts are not divisible by {num_ranks} ranks")
        num_local = num_experts // num_ranks
        mine = slice(rank * num_local, (rank + 1) * num_local)
        experts = cls(num_local, hidden, two_intermediate // 2, hidden_act, dtype=gate_up_proj.dtype,
                      device=gate_up_proj.device)
        with torch.no_grad():
            experts.gate_up_proj.copy_(gate_up_proj[mine])
            experts.down_proj.copy_(down_proj[mine])
        return experts

    def expert(self, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `local_expert` on rows ``x [n, H]`` -> ``[n, H]``."""
        gate, up = F.linear(x, self.gate_up_proj[local_expert]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[local_expert])

    def forward(self, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                num_recv_tokens_per_expert_list: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``recv_x [N, H]``, local ``recv_topk_idx [N, K]`` (-1: another rank's expert), float32
        ``recv_topk_weights [N, K]`` -> ``[N, H]`` in recv_x's dtype, summed in float32 in expert order
        (`experts_on_received`: two grouped GEMMs where `grouped_gemm_kind` says so).
        `num_recv_tokens_per_expert_list`, the dispatch's counts (with expert_alignment 1), spares a host sync.
        """
        return experts_on_received(recv_x, recv_topk_idx, recv_topk_weights, self.gate_up_proj, self.down_proj,
                                   self.act_fn, grouped_gemm_kind(recv_x.device, recv_x.dtype),
                                   num_recv_tokens_per_expert_list or None)[0]

    def forward_expanded(self, recv_x: torch.Tensor, ends: torch.Tensor,
                         recv_topk_weights: Optional[torch.Tensor]) -> torch.Tensor:
        """NOTE [expanded experts]
        DeepEP V2's expanded layout (`tokenyard.layers.autograd.expanded_dispatch`): ``recv_x [M, H]`` holds one
        row per (received token, local expert) pair grouped by expert, expert l's ending at ``ends[l]`` (the
        handle's ``psum_num_recv_tokens_per_expert``), ``recv_topk_weights [M]`` each pair's weight -> ``[M, H]``:
        each row through its expert, its weight applied to the activation (`gated_experts_on_groups`). The
        expanded combine then sums a token's rows: no sort, gather or index_add is left to the layer
        (benchmarks/results/moe_step.md, "One GPU")."""
        if recv_x.size(0) == 0:
            return recv_x * 0  # as in forward: the backward still reaches the calls every rank makes
        kind = grouped_gemm_kind(recv_x.device, recv_x.dtype)
        return gated_experts_on_groups(recv_x, ends, self.gate_up_proj, self.down_proj, self.act_fn, kind,
                                       recv_topk_weights)

    def forward_packed(self, packed_recv_x: torch.Tensor, packed_recv_count: torch.Tensor) -> torch.Tensor:
        """Low-latency layout: ``packed_recv_x [L, R*M, H]``, ``packed_recv_count [L]`` -> ``[L, R*M, H]``.

        Naive equivalent: ``out[l, :n_l] = expert[l](packed_recv_x[l, :n_l])``; slots past the count
        are 0. The result has packed_recv_x's dtype and goes to `Buffer.low_latency_combine`, which
        applies the top-k weights.
        """
        out = torch.zeros_like(packed_recv_x)
        for local_expert, count in enumerate(packed_recv_count.tolist()):
            if count:
                out[local_expert, :count] = self.expert(local_expert, packed_recv_x[local_expert, :count]).to(out.dtype)
        return out


class ExpertParallelMoE(nn.Module):
    """A sparse MoE block whose experts are spread over the ranks of `buffer`'s group.

    Naive equivalent (one process holding all E experts)::

        topk_idx, topk_weights = router(x)
        out[t] = sum_k topk_weights[t, k] * expert[topk_idx[t, k]](x[t])
        out += sigmoid(shared_expert_gate(x)) * shared_expert(x)     (each part only if given)

    computed as router -> `autograd.dispatch` -> local experts with the weights -> `autograd.combine`; with an
    `ElasticBuffer` and bf16 activations, through the expanded layout instead (NOTE [expanded experts]).

    Shapes: ``hidden_states [..., H]`` -> ``[..., H]`` in the same dtype (bf16 or float32; float32 rows are
    rounded to bf16 for the combine, NOTE [combine wire dtype] in tokenyard/layers/autograd.py). Every rank must
    call forward (and backward) the same number of times, with any number of tokens, zero included.

    Arguments:
        buffer: a normal-mode `Buffer`, or an `ElasticBuffer` (see `make_buffer`).
        router: a module mapping ``x [T, H]`` to ``(topk_idx [T, K] int64, topk_weights [T, K])``, such
            as `TopKRouter`; None if every call passes `topk_idx` and `topk_weights`.
        experts: this rank's `GatedExperts`; E = ``experts.num_local_experts * R``.
        shared_expert: a module applied to every token locally (`GatedMLP`), or None.
        shared_expert_gate: a module ``[T, H] -> [T, 1]`` whose sigmoid scales the shared expert, or None.
    Raises:
        InvalidInputError: a router whose `num_experts` is not E; in forward, a hidden size other than
        H, or `topk_idx` without `topk_weights`; and whatever `Buffer.dispatch` raises.
    """

    def __init__(self, buffer: Buffer, router: Optional[nn.Module], experts: GatedExperts, *,
                 shared_expert: Optional[nn.Module] = None, shared_expert_gate: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.buffer = buffer
        v1 = buffer.buffer if isinstance(buffer, ElasticBuffer) else buffer
        self.rank, self.num_ranks = v1.rank, v1.group_size
        self.num_experts = experts.num_local_experts * self.num_ranks
        if router is not None and getattr(router, "num_experts", self.num_experts) != self.num_experts:
            raise InvalidInputError(f"the router chooses among {router.num_experts} experts; {self.num_ranks} "
                                    f"ranks of {experts.num_local_experts} hold {self.num_experts}")
        self.gate = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    @classmethod
    def from_dense(cls, buffer: Buffer, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
                   router: Optional[nn.Module], hidden_act: Activation = "silu",
                   shared_expert: Optional[nn.Module] = None,
                   shared_expert_gate: Optional[nn.Module] = None) -> "ExpertParallelMoE":
        """The layer holding this rank's share of a dense model's experts (``r*L .. r*L+L-1``).

        Naive equivalent: ``ExpertParallelMoE(buffer, router, GatedExperts.from_dense(gate_up_proj,
        down_proj, buffer.rank, R, hidden_act), ...)``.

        Shapes: ``gate_up_proj [E, 2*I, H]`` (gate rows, then up rows), ``down_proj [E, H, I]``; from
        transformers' fused experts these are ``experts.gate_up_proj`` and ``experts.down_proj``, and from
        per-expert linears ``stack([cat([w1, w3]) for each expert])`` and ``stack([w2 ...])``. The router
        and shared modules are used as given (replicated on every rank).

        Raises:
            InvalidInputError: as `GatedExperts.from_dense` and the constructor.
        """
        v1 = buffer.buffer if isinstance(buffer, ElasticBuffer) else buffer
        experts = GatedExperts.from_dense(gate_up_proj, down_proj, v1.rank, v1.group_size, hidden_act)
        return cls(buffer, router, experts, shared_expert=shared_expert, shared_expert_gate=shared_expert_gate)

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.experts.num_local_experts

    def forward(self, hidden_states: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.experts.hidden_size
        if hidden_states.size(-1) != hidden:
            raise InvalidInputError(f"hidden_states has hidden size {hidden_states.size(-1)}, the experts {hidden}")
        x = hidden_states.reshape(-1, hidden)
        if topk_idx is None:
            if self.gate is None:
                raise InvalidInputError("this layer has no router: pass topk_idx and topk_weights")
            topk_idx, topk_weights = self.gate(x)
        elif topk_weights is None:
            raise InvalidInputError("topk_idx needs topk_weights")
        if isinstance(self.buffer, ElasticBuffer) and x.dtype == torch.bfloat16:  # NOTE [expanded experts]
            recv_x, recv_topk_weights, handle, _ = autograd.expanded_dispatch(self.buffer, x, topk_idx,
                                                                             topk_weights.float(), self.num_experts)
            rows = self.experts.forward_expanded(recv_x, handle.psum_num_recv_tokens_per_expert, recv_topk_weights)
            out, _, _ = autograd.expanded_combine(self.buffer, rows, handle)
        else:
            buffer = self.buffer.buffer if isinstance(self.buffer, ElasticBuffer) else self.buffer
            recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle = autograd.dispatch(
                buffer, x, topk_idx, topk_weights.float(), self.num_experts)
            expert_out = self.experts(recv_x, recv_topk_idx, recv_topk_weights, per_expert)
            out, _ = autograd.combine(buffer, expert_out, handle)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(hidden_states.shape)
