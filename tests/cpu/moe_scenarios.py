"""MoE training pieces on every rank of a RankPool: differentiable dispatch/combine and the MoE layer.

Two kinds of functions live here:

- rank functions (run by ``ranks(n).run(...)`` or tests/gpu/spawn.py), which build their inputs from a
  seed or from a case dict and compare with a single-process computation;
- `transformers_case`, which builds a Hugging Face sparse MoE block with a tiny random config, runs it in
  one process on every rank's slice of the tokens, and returns the weights, inputs and the dense outputs
  and gradients that the ranks must reproduce. transformers is imported there only (in the test process
  on CPU; on every rank in tests/gpu, so that the block runs on the same GPU kernels as the layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tokenyard import Buffer
from tokenyard.layers import autograd, moe
from tokenyard.semantics import routing
from tokenyard.tools.testing import all_gather, make_rank_inputs

BF16_UNIT = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding moves a value by at most this, relatively


def _world():
    return dist.get_rank(), dist.get_world_size()


def _buffer(num_tokens, hidden, dtype):
    return moe.make_buffer(dist.group.WORLD, hidden, num_tokens, dtype, backend="reference")


def _integer_grads(shape, dtype, seed):
    """Small integers: every sum of a few of them is exact in bf16, so bf16 transport loses nothing."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=generator).to(dtype)


def _random(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _oracle_dispatch(xs, topk_idxs, topk_weights, num_experts):
    """Single-process, differentiable: what each rank receives (routing.dispatch_layout's meaning)."""
    num_ranks = len(xs)
    num_local = num_experts // num_ranks
    in_rank = [routing.dispatch_layout(t, num_experts, num_ranks)[2] for t in topk_idxs]
    received = []
    for q in range(num_ranks):
        rows = [in_rank[s][:, q] for s in range(num_ranks)]
        recv_x = torch.cat([xs[s][rows[s]] for s in range(num_ranks)])
        recv_idx = torch.cat([topk_idxs[s][rows[s]] for s in range(num_ranks)])
        recv_w = torch.cat([topk_weights[s][rows[s]] for s in range(num_ranks)])
        received.append((recv_x,) + routing.to_local_topk(recv_idx, recv_w, q, num_local))
    return received


# ------------------------------------------------------------------------------------------------------
# differentiable dispatch and combine
# ------------------------------------------------------------------------------------------------------

def dispatch_backward_is_combine(seed, num_tokens, hidden, num_experts, num_topk, kind, dtype_name,
                                 num_worst_tokens=0):
    """dispatch's backward against autograd through the single-process oracle, exactly.

    With `num_worst_tokens`, the padding rows get nonzero gradients, which must be ignored.
    """
    rank, num_ranks = _world()
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, "bf16")
    xs = [i[0].to(dtype, copy=True).requires_grad_() for i in inputs]
    weights = [i[2].clone().requires_grad_() for i in inputs]
    topk_idxs = [i[1] for i in inputs]
    want = _oracle_dispatch(xs, topk_idxs, weights, num_experts)
    grad_x = [_integer_grads(w[0].shape, dtype, seed + 11 * q) for q, w in enumerate(want)]
    grad_w = [_random(w[2].shape, torch.float32, seed + 13 * q) for q, w in enumerate(want)]
    torch.autograd.backward([w[0] for w in want] + [w[2] for w in want], grad_x + grad_w)

    buffer = _buffer(num_tokens, hidden, dtype)
    x = inputs[rank][0].to(dtype, copy=True).requires_grad_()
    w = inputs[rank][2].clone().requires_grad_()
    recv_x, recv_idx, recv_w, _, handle = autograd.dispatch(buffer, x, topk_idxs[rank], w, num_experts,
                                                            num_worst_tokens=num_worst_tokens)
    num_recv = want[rank][0].size(0)
    assert recv_x.size(0) == (num_worst_tokens or num_recv)
    assert torch.equal(recv_x[:num_recv], want[rank][0].detach()) and torch.equal(recv_idx[:num_recv], want[rank][1])
    assert torch.equal(recv_w[:num_recv], want[rank][2].detach())
    pad = recv_x.size(0) - num_recv
    my_grad_x = torch.cat([grad_x[rank], _integer_grads((pad, hidden), dtype, seed - 1) + 1])
    my_grad_w = torch.cat([grad_w[rank], _random((pad, num_topk), torch.float32, seed - 2)])
    torch.autograd.backward([recv_x, recv_w], [my_grad_x, my_grad_w])
    assert x.grad.dtype == dtype and torch.equal(x.grad, xs[rank].grad), "x.grad differs from the oracle's"
    assert torch.equal(w.grad, weights[rank].grad), "topk_weights.grad differs from the oracle's"
    # The property itself: the backward is a combine of the (masked) gradients with the same handle.
    combined, combined_w, _ = buffer.combine(my_grad_x.to(torch.bfloat16), handle,
                                             topk_weights=my_grad_w.masked_fill(recv_idx < 0, 0))
    assert torch.equal(x.grad, combined.to(dtype)) and torch.equal(w.grad, combined_w)

    # Arbitrary float32 gradients travel as bf16: within two bf16 roundings of the exact sum.
    if dtype == torch.float32:
        grads = [_random(g.shape, torch.float32, seed + 17 * q) for q, g in enumerate(grad_x)]
        exact = _oracle_x_grads(inputs, dtype, num_experts, grads)[rank]
        magnitude = _oracle_x_grads(inputs, dtype, num_experts, [g.abs() for g in grads])[rank]
        x.grad = None
        recv_x = autograd.dispatch(buffer, x, topk_idxs[rank], None, num_experts)[0]
        recv_x.backward(grads[rank])
        bound = (2 * BF16_UNIT + 1e-6) * magnitude
        assert bool(((x.grad - exact).abs() <= bound).all()), "float32 gradient beyond two bf16 roundings"
    buffer.destroy()
    return int(recv_x.size(0))


def _oracle_x_grads(inputs, dtype, num_experts, grads):
    """Every rank's x.grad for recv_x gradients `grads`, by autograd through the oracle."""
    xs = [i[0].to(dtype, copy=True).requires_grad_() for i in inputs]
    received = _oracle_dispatch(xs, [i[1] for i in inputs], [i[2] for i in inputs], num_experts)
    torch.autograd.backward([r[0] for r in received], grads)
    return [t.grad for t in xs]


def combine_backward_is_cached_dispatch(seed, num_tokens, hidden, num_experts, num_topk, kind, dtype_name,
                                        num_worst_tokens=0):
    """combine's backward is a cached dispatch of the gradients; checked against routing.dispatch."""
    rank, num_ranks = _world()
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, "bf16")
    x, topk_idx, weights = inputs[rank]
    buffer = _buffer(num_tokens, hidden, dtype)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert,
                                                      num_worst_tokens=num_worst_tokens)
    num_rows = recv_x.size(0)
    rows = _random((num_rows, hidden), dtype, seed + 5 * rank).requires_grad_()
    row_weights = recv_w.clone().requires_grad_()
    out, out_w = autograd.combine(buffer, rows, handle, topk_weights=row_weights)
    want_out, want_w = buffer.combine(rows.detach().to(torch.bfloat16), handle, topk_weights=recv_w)[:2]
    assert out.dtype == dtype and torch.equal(out, want_out.to(dtype)) and torch.equal(out_w, want_w)

    grads = [_random((i[1].size(0), hidden), dtype, seed + 7 * s) for s, i in enumerate(inputs)]
    grads_w = [_random(tuple(i[1].shape), torch.float32, seed + 9 * s) for s, i in enumerate(inputs)]
    torch.autograd.backward([out, out_w], [grads[rank], grads_w[rank]])
    oracle = routing.dispatch(grads, [None] * num_ranks, [i[1] for i in inputs], grads_w, num_experts)[rank]
    num_recv = oracle["recv_x"].size(0)
    assert rows.grad.dtype == dtype and torch.equal(rows.grad[:num_recv], oracle["recv_x"])
    # The oracle's recv_topk_weights are masked to local experts; the gradient rows are the full rows.
    full_w = torch.cat([g[in_r[:, rank]] for g, in_r in
                        zip(grads_w, [routing.dispatch_layout(i[1], num_experts, num_ranks)[2] for i in inputs])])
    assert torch.equal(row_weights.grad[:num_recv], full_w)
    assert not bool(rows.grad[num_recv:].any()) and not bool(row_weights.grad[num_recv:].any()), \
        "padding rows must get zero gradient"
    if not num_worst_tokens:
        assert torch.equal(rows.grad, buffer.dispatch(grads[rank], handle=handle)[0])
    buffer.destroy()
    return num_recv


def _oracle_expanded(received, num_local):
    """Single-process, differentiable: each rank's expanded rows and their weights from its received rows
    (tokenyard/semantics/expand.py's order: by local expert, then received row)."""
    out = []
    for recv_x, recv_idx, recv_w in received:
        pairs = [(j, k) for expert in range(num_local) for j in range(recv_idx.size(0))
                 for k in range(recv_idx.size(1)) if int(recv_idx[j, k]) == expert]
        rows = torch.tensor([j for j, _ in pairs], dtype=torch.int64, device=recv_x.device)
        slots = torch.tensor([k for _, k in pairs], dtype=torch.int64, device=recv_x.device)
        out.append((recv_x[rows], recv_w[rows, slots]))
    return out


def _pair_rows(handle):
    """int64 indices of an expanded tensor's pair rows (the rest is padding): expert i's count rows end at
    the handle's ``psum_num_recv_tokens_per_expert[i]``."""
    ends = handle.psum_num_recv_tokens_per_expert.tolist()
    counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
    return torch.tensor([row for end, count in zip(ends, counts) for row in range(end - count, end)],
                        dtype=torch.int64, device=handle.psum_num_recv_tokens_per_expert.device)


def _backend_device(backend):
    return torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")


def _random_on(shape, dtype, seed, device):
    return _random(shape, dtype, seed).to(device)


def expanded_dispatch_backward_is_combine(seed, num_tokens, hidden, num_experts, num_topk, kind, alignment,
                                          cpu_sync, backend="reference"):
    """The expanded dispatch's backward against autograd through the single-process oracle, exactly; padding rows
    (aligned groups, or the worst case's rows without the CPU sync) get nonzero gradients, which must go nowhere."""
    import tokenyard

    rank, num_ranks = _world()
    device = _backend_device(backend)
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, "bf16", device)
    xs = [i[0].clone().requires_grad_() for i in inputs]
    weights = [i[2].clone().requires_grad_() for i in inputs]
    topk_idxs = [i[1] for i in inputs]
    want = _oracle_expanded(_oracle_dispatch(xs, topk_idxs, weights, num_experts), num_experts // num_ranks)
    grad_x = [_integer_grads(w[0].shape, torch.bfloat16, seed + 11 * q).to(device) for q, w in enumerate(want)]
    grad_w = [_random_on(w[1].shape, torch.float32, seed + 13 * q, device) for q, w in enumerate(want)]
    torch.autograd.backward([w[0] for w in want] + [w[1] for w in want], grad_x + grad_w)

    buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden,
                                     backend=backend)
    x, w = inputs[rank][0].clone().requires_grad_(), inputs[rank][2].clone().requires_grad_()
    recv_x, recv_w, handle, _ = autograd.expanded_dispatch(buffer, x, topk_idxs[rank], w, num_experts,
                                                           expert_alignment=alignment, do_cpu_sync=cpu_sync)
    pairs = _pair_rows(handle)
    assert pairs.numel() == want[rank][0].size(0) and (cpu_sync or recv_x.size(0) > pairs.numel())
    assert torch.equal(recv_x[pairs], want[rank][0].detach()) and torch.equal(recv_w[pairs], want[rank][1].detach())
    my_grad_x = (_integer_grads(recv_x.shape, torch.bfloat16, seed - 1) + 1).to(device)  # padding rows: nonzero
    my_grad_w = _random_on(recv_w.shape, torch.float32, seed - 2, device)
    my_grad_x[pairs], my_grad_w[pairs] = grad_x[rank], grad_w[rank]
    torch.autograd.backward([recv_x, recv_w], [my_grad_x, my_grad_w])
    assert torch.equal(x.grad, xs[rank].grad), "x.grad differs from the oracle's"
    assert torch.equal(w.grad, weights[rank].grad), "topk_weights.grad differs from the oracle's"
    buffer.destroy()
    return int(pairs.numel())


def expanded_combine_backward_is_cached_dispatch(seed, num_tokens, hidden, num_experts, num_topk, kind, alignment,
                                                 backend="reference"):
    """The expanded combine's backward is a cached expanded dispatch of the gradients; checked against the oracle
    (each pair row gets its token's gradient, and its slot's weight gradient)."""
    import tokenyard

    rank, num_ranks = _world()
    device = _backend_device(backend)
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, "bf16", device)
    x, topk_idx, weights = inputs[rank]
    buffer = tokenyard.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden,
                                     backend=backend)
    _, recv_w, handle, _ = autograd.expanded_dispatch(buffer, x, topk_idx, weights, num_experts,
                                                      expert_alignment=alignment, do_zero_padding=True)
    rows = _random_on((recv_w.size(0), hidden), torch.bfloat16, seed + 5 * rank, device).requires_grad_()
    row_weights = recv_w.clone().requires_grad_()
    out, out_w, _ = autograd.expanded_combine(buffer, rows, handle, topk_weights=row_weights, do_zero_padding=True)
    want_out, want_w, _ = buffer.combine(rows.detach(), handle, topk_weights=recv_w)
    assert torch.equal(out, want_out) and torch.equal(out_w, want_w)

    grads = [_random_on((i[1].size(0), hidden), torch.bfloat16, seed + 7 * s, device) for s, i in enumerate(inputs)]
    grads_w = [_random_on(tuple(i[1].shape), torch.float32, seed + 9 * s, device) for s, i in enumerate(inputs)]
    torch.autograd.backward([out, out_w], [grads[rank], grads_w[rank]])
    oracle = _oracle_expanded(_oracle_dispatch(grads, [i[1] for i in inputs], grads_w, num_experts),
                              num_experts // num_ranks)[rank]
    pairs = _pair_rows(handle)
    assert torch.equal(rows.grad[pairs], oracle[0]) and torch.equal(row_weights.grad[pairs], oracle[1])
    padding = torch.ones(rows.size(0), dtype=torch.bool, device=device)
    padding[pairs] = False
    assert not bool(rows.grad[padding].any()), "do_zero_padding: the padding rows' gradient must be zero"
    buffer.destroy()
    return int(pairs.numel())


def autograd_refuses_other_dtypes():
    """combine accepts bf16 and float32 only, with a message naming the dtype."""
    import tokenyard

    rank, num_ranks = _world()
    x, topk_idx, weights = make_rank_inputs(3, num_ranks, 8, 64, 8, 2)[rank]
    buffer = _buffer(8, 64, torch.float32)
    recv_x, _, _, _, handle = autograd.dispatch(buffer, x, topk_idx, weights, 8)
    try:
        autograd.combine(buffer, recv_x.to(torch.float16), handle)
    except tokenyard.InvalidInputError as exc:
        message = str(exc)
    else:
        raise AssertionError("a float16 combine was accepted")
    buffer.destroy()
    assert "float16" in message, message
    return message


# ------------------------------------------------------------------------------------------------------
# the MoE layer against a dense transformers block
# ------------------------------------------------------------------------------------------------------

MODELS = ("mixtral", "qwen2_moe", "deepseek_v3")


def transformers_case(model, seed, num_ranks, num_tokens, dtype=torch.float32, hidden=64, device="cpu"):
    """Build `model`'s sparse MoE block (8 experts, top-2) and run it on each rank's slice of the tokens.

    Returns a dict of plain tensors (CPU): ``weights`` (transformers' names), ``router`` (`TopKRouter`
    settings), ``x`` and ``grad_out`` ``[R*T, H]``, and ``want``: the block's output, the input's gradient
    and every parameter's gradient for the loss ``sum(out * grad_out)``.
    """
    import transformers

    generator = torch.Generator().manual_seed(seed)
    intermediate = 96
    # experts_implementation="eager": transformers' own loop over experts, not a fused kernel.
    common = dict(hidden_size=hidden, num_experts_per_tok=2, hidden_act="silu", experts_implementation="eager")
    if model == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = transformers.MixtralConfig(intermediate_size=intermediate, num_local_experts=8, **common)
        block = MixtralSparseMoeBlock(config)
        router = dict(scoring="softmax", norm_topk_prob=True)
    elif model == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = transformers.Qwen2MoeConfig(moe_intermediate_size=intermediate, num_experts=8,
                                             shared_expert_intermediate_size=2 * intermediate,
                                             norm_topk_prob=False, **common)
        block = Qwen2MoeSparseMoeBlock(config)
        router = dict(scoring="softmax", norm_topk_prob=False)
    elif model == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        config = transformers.DeepseekV3Config(moe_intermediate_size=intermediate, n_routed_experts=8,
                                               n_shared_experts=1, n_group=4, topk_group=2,
                                               routed_scaling_factor=2.5, norm_topk_prob=True, **common)
        block = DeepseekV3MoE(config)
        router = dict(scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=4,
                      num_topk_groups=2, logits_in_float32=True)
    else:
        raise ValueError(f"unknown model {model!r}; choose from {MODELS}")
    with torch.no_grad():
        for p in block.parameters():  # transformers leaves fused experts uninitialized
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=generator) * 0.1)
    block = block.to(device=device, dtype=dtype)
    x = torch.randn(num_ranks * num_tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    grad_out = torch.randn(num_ranks * num_tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    x.requires_grad_()
    # One call per rank's slice, as the ranks see them: the same shapes give the router the same bits
    # (a matmul's rounding may depend on the row count), so near-ties cannot flip an expert choice.
    outs = []
    for rank in range(num_ranks):
        mine = slice(rank * num_tokens, (rank + 1) * num_tokens)
        outs.append(block(x[mine].view(1, num_tokens, hidden)).view(num_tokens, hidden))
        outs[-1].backward(grad_out[mine])
    out = torch.cat(outs)
    tensors = list(block.named_parameters()) + list(block.named_buffers())
    return {
        "model": model, "transformers": transformers.__version__, "dtype": dtype, "hidden": hidden,
        "num_tokens": num_tokens, "num_experts": 8, "num_topk": 2, "intermediate": intermediate,
        "router": router, "x": x.detach().cpu(), "grad_out": grad_out.cpu(),
        "weights": {n: t.detach().cpu() for n, t in tensors},
        "want": {"out": out.detach().cpu(), "x.grad": x.grad.cpu(),
                 **{n: p.grad.cpu() for n, p in block.named_parameters()}},
    }


def _our_name(transformers_name):
    return transformers_name.replace("shared_experts.", "shared_expert.")


def _transformers_name(our_name, names):
    return our_name if our_name in names else our_name.replace("shared_expert.", "shared_experts.")


def build_layer(case, buffer, device):
    """tokenyard's `ExpertParallelMoE` from a case's transformers weights (this rank's experts only)."""
    weights = {_our_name(n): t.to(device) for n, t in case["weights"].items()}
    hidden, dtype = case["hidden"], case["dtype"]
    router = moe.TopKRouter(hidden, case["num_experts"], case["num_topk"], dtype=dtype, device=device,
                            **case["router"])
    shared = shared_gate = None
    if "shared_expert.gate_proj.weight" in weights:
        shared = moe.GatedMLP(hidden, weights["shared_expert.gate_proj.weight"].size(0), dtype=dtype, device=device)
    if "shared_expert_gate.weight" in weights:
        shared_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
    layer = moe.ExpertParallelMoE.from_dense(buffer, weights["experts.gate_up_proj"], weights["experts.down_proj"],
                                             router=router, shared_expert=shared, shared_expert_gate=shared_gate)
    # Everything but the experts is replicated: load it by name.
    replicated = {n: t for n, t in weights.items() if not n.startswith("experts.")}
    missing, unexpected = layer.load_state_dict(replicated, strict=False)
    assert not unexpected and all(n.startswith("experts.") for n in missing), (missing, unexpected)
    return layer


def _errors(got, want):
    """(max |got - want|, the same divided by max |want|: the error in units of the tensor's scale)."""
    max_abs = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return max_abs, max_abs / (scale if scale > 0 else 1.0)


def layer_matches_transformers(case, tolerances, backend="reference", elastic=False):
    """Run the layer on this rank's slice of the case's tokens; compare output and every gradient. With
    `elastic`, the layer holds an `ElasticBuffer` (bf16 then runs through the expanded layout).

    `tolerances` maps "out", "x.grad" and "weights" to the largest error allowed, in units of the
    reference tensor's largest magnitude (None: measure only). Expert gradients are gathered from all
    ranks, the router's and the shared expert's summed over ranks, before comparing with the dense
    block's. Returns this rank's ``{name: (max abs error, scaled error)}``.
    """
    rank, num_ranks = _world()
    num_tokens, hidden, dtype = case["num_tokens"], case["hidden"], case["dtype"]
    buffer = moe.make_buffer(dist.group.WORLD, hidden, num_tokens, dtype, backend=backend, elastic=elastic)
    device = (buffer.buffer if elastic else buffer).device
    layer = build_layer(case, buffer, device)
    assert layer.experts.num_local_experts == case["num_experts"] // num_ranks
    mine = slice(rank * num_tokens, (rank + 1) * num_tokens)
    x = case["x"][mine].to(device, copy=True).requires_grad_()
    out = layer(x)
    out.backward(case["grad_out"][mine].to(device))
    if buffer.backend == "cuda":  # what a kernel of the backward recorded (a combine has no CPU wait) raises here
        torch.cuda.synchronize()
        buffer.runtime.check_failures()

    want = case["want"]
    errors = {"out": _errors(out, want["out"][mine].to(device)),
              "x.grad": _errors(x.grad, want["x.grad"][mine].to(device))}
    for name, p in layer.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        gathered = all_gather(grad)  # every rank's, also where the group cannot move the device's tensors
        grad = gathered.flatten(0, 1) if name.startswith("experts.") else gathered.sum(0)
        errors[name] = _errors(grad, want[_transformers_name(name, want)].to(device))
    compared = {_transformers_name(n, want) for n in errors}
    assert compared == set(want), f"compared {sorted(compared)}, the block has {sorted(want)}"
    buffer.destroy()
    for name, (_, scaled) in errors.items():
        limit = None if tolerances is None else tolerances.get(name, tolerances["weights"])
        assert limit is None or scaled <= limit, \
            f"{case['model']} {dtype}: {name} off by {scaled:.3g} of its scale (limit {limit:.3g})"
    return errors


# ------------------------------------------------------------------------------------------------------
# decode: low-latency dispatch, packed experts, low-latency combine
# ------------------------------------------------------------------------------------------------------

def packed_experts_match_dense(seed, num_tokens, hidden, intermediate, num_experts, num_topk):
    """GatedExperts.forward_packed between low-latency dispatch and combine equals the dense sum."""
    rank, num_ranks = _world()
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * hidden ** -0.5)
    down = (torch.randn(num_experts, hidden, intermediate, generator=generator) * intermediate ** -0.5)
    gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    x, topk_idx, topk_weights = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk,
                                                 "masked")[rank]
    experts = moe.GatedExperts.from_dense(gate_up, down, rank, num_ranks)
    buffer = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks,
                                                                            num_experts), backend="reference")
    packed_x, packed_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                       use_fp8=False)
    with torch.no_grad():
        out, _, _ = buffer.low_latency_combine(experts.forward_packed(packed_x, packed_count), topk_idx,
                                               topk_weights, handle)
        dense = moe.GatedExperts.from_dense(gate_up, down, 0, 1)
        want = torch.zeros(x.size(0), hidden)
        for k in range(num_topk):
            for t in range(x.size(0)):
                e = int(topk_idx[t, k])
                if e >= 0:
                    want[t] += topk_weights[t, k] * dense.expert(e, x[t:t + 1])[0].float()
    buffer.destroy()
    error = _errors(out, want)[1]
    assert error <= 2 * BF16_UNIT, f"decode output off by {error:.3g} of its scale"
    return error


def layer_on_virtual_nodes_matches_dense(seed, ranks_per_node):
    """`make_buffer` across virtual nodes (TOKENYARD_RANKS_PER_NODE): the Buffer holds the NVSHMEM bytes its nodes
    need (`Config.internode_region_bytes`; with none the CUDA backend's first dispatch there raised CapacityError),
    and the layer through it still matches the dense experts."""
    import os

    from tokenyard import Config, env

    os.environ["TOKENYARD_RANKS_PER_NODE"] = str(ranks_per_node)
    env.settings.cache_clear()
    try:
        _, num_ranks = _world()
        buffer = _buffer(16, 64, torch.bfloat16)
        want = Config(num_max_tokens_per_rank=16).internode_region_bytes(64 * 2, num_ranks, ranks_per_node)
        assert buffer.topology.num_nodes == num_ranks // ranks_per_node and buffer._internode
        assert buffer.num_rdma_bytes == want > 0, (buffer.num_rdma_bytes, want)
        buffer.destroy()
        layer_with_given_routing_matches_dense(seed, 16, 64, 96, 8, 2, "skewed")
    finally:
        del os.environ["TOKENYARD_RANKS_PER_NODE"]
        env.settings.cache_clear()


def layer_with_given_routing_matches_dense(seed, num_tokens, hidden, intermediate, num_experts, num_topk, kind):
    """The layer with precomputed routing (router None) against the dense experts on one process.

    `kind` "empty_rank" leaves the last rank without tokens to compute and "no_tokens" gives rank 1 no
    tokens at all: their backward must still join the others' combine and dispatch. Checks the output,
    the input's and the top-k weights' gradients, and the expert gradients.
    """
    rank, num_ranks = _world()
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) * intermediate ** -0.5
    inputs = make_rank_inputs(seed, num_ranks, num_tokens, hidden, num_experts, num_topk, kind, "bf16")
    grads = [_random((i[1].size(0), hidden), torch.float32, seed + 3 * s) for s, i in enumerate(inputs)]

    dense = moe.GatedExperts.from_dense(gate_up, down, 0, 1)
    xs = [i[0].float().requires_grad_() for i in inputs]
    weights = [i[2].clone().requires_grad_() for i in inputs]
    outs = [dense(x, i[1], w) for x, i, w in zip(xs, inputs, weights)]
    torch.autograd.backward(outs, grads)

    buffer = moe.make_buffer(dist.group.WORLD, hidden, num_tokens, torch.float32)
    layer = moe.ExpertParallelMoE.from_dense(buffer, gate_up, down, router=None)
    x = inputs[rank][0].float().requires_grad_()
    w = inputs[rank][2].clone().requires_grad_()
    out = layer(x, inputs[rank][1], w)
    out.backward(grads[rank])
    num_local = num_experts // num_ranks
    mine = slice(rank * num_local, (rank + 1) * num_local)
    checks = {"out": (out, outs[rank], 4 * BF16_UNIT), "x.grad": (x.grad, xs[rank].grad, 4 * BF16_UNIT),
              "topk_weights.grad": (w.grad, weights[rank].grad, 1e-5),
              "gate_up_proj.grad": (_grad(layer.experts.gate_up_proj), dense.gate_up_proj.grad[mine], 1e-5),
              "down_proj.grad": (_grad(layer.experts.down_proj), dense.down_proj.grad[mine], 1e-5)}
    errors = {}
    for name, (got, want, limit) in checks.items():
        if got is not None and got.numel():  # rank 1 of "no_tokens" has nothing to compare
            errors[name] = _errors(got, want)[1]
            assert errors[name] <= limit, f"{kind}: {name} off by {errors[name]:.3g} of its scale"
    buffer.destroy()
    return errors


def _grad(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)
