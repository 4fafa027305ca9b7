"""The stream stress run: hundreds of calls on one `Buffer` (normal mode), one low-latency `Buffer` and one
`ElasticBuffer`, each call with stream and event keywords drawn at random, every output compared with the same
call on the reference backend (docs/semantics.md, "Streams and events"; NOTE [stream contract] in buffer.py).

NOTE [stream stress]
A stream bug shows only when work on one stream is late. The run makes it late on purpose, so that what the
contract forbids happens every time rather than now and then:
- *late inputs*: every tensor a call takes is fresh, poisoned on the caller's stream, and written with its
  values after a sleep, on the caller's stream (then the call's `previous_event`, when drawn, is recorded
  after it) or on a side stream the caller's stream never waits for (then `previous_event` is that stream's
  event, and only it says the inputs are ready). A call that reads an input before its event reads poison.
- *scribbled inputs*: once a call is complete for the caller (it returned, or its event or hook was waited
  for), another stream, after waiting for the caller's, poisons the inputs. A call still reading them then
  reads poison.
- *late reads of outputs*: a call's outputs are copied for the comparison only at the next call, after a
  sleep on the caller's stream that follows that call's `previous_event`, and the outputs are dropped at
  once. Where an output's memory went back to the communication stream's pool without being marked as used
  by the caller's stream, the next call's tensors take it and the copy reads what they wrote.
The draws come from one seed on every rank, so the ranks make the same calls; the inputs are fresh random
routings and values per call (tokenyard.tools.testing).
"""

from __future__ import annotations

import collections
import random

import torch

from tokenyard import EventHandle, EventOverlap

from .spawn import assert_same

HIDDEN, NUM_TOPK, EXPERTS_PER_RANK = 2048, 6, 8
MAX_TOKENS, LOW_LATENCY_MAX_TOKENS = 256, 64
SLEEP_CYCLES = 200_000  # GPU clock cycles: far longer than a launch, far shorter than a call


def _flat(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flat(v)
        elif isinstance(v, torch.Tensor):
            yield v


def _poison(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_floating_point() and t.element_size() > 1:
        t.fill_(float("nan"))
    else:  # FP8 (0xff is NaN in e4m3), integers (ids far outside every range)
        t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(-(2 ** 20) - 7)


class _Streams:
    """The caller's stream, the side stream that makes late inputs, the stream that scribbles on used inputs,
    and the outputs waiting for their late copy (NOTE [stream stress])."""

    def __init__(self, device):
        self.device = device
        self.caller = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.scribbler = torch.cuda.Stream(device)
        self.pending = []  # (check, outputs): copied at the next call
        self.checks = []  # (check, copies): compared at the end of the round
        self.failures = []  # the round's host-side differences

    def inputs(self, values, source: str):
        """Fresh tensors holding `values` (tensors, Nones and tuples of them), written late by `source`
        ("none" or "caller": the caller's stream; "side": the side stream), and the event that says they are
        ready (an `EventHandle`, for "caller" and "side"; None for "none"). The outputs of the calls before are
        copied after it."""
        def fresh(v):
            if isinstance(v, tuple):
                return tuple(fresh(u) for u in v)
            if not isinstance(v, torch.Tensor):
                return v
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            _poison(t)
            return t

        made = [fresh(v) for v in values]
        stream = self.side if source == "side" else self.caller
        if source == "side":
            self.side.wait_stream(self.caller)  # after the poison
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            for t, v in zip(_flat(made), _flat(values)):
                t.copy_(v)
                t.record_stream(stream)
            event = None if source == "none" else EventHandle(stream)
        self._copy_pending()
        return made, event

    def _copy_pending(self) -> None:
        """The late copies of the earlier calls' outputs, on the caller's stream after a sleep; the outputs
        themselves are dropped."""
        if not self.pending:
            return
        torch.cuda._sleep(SLEEP_CYCLES)
        for check, outputs in self.pending:
            self.checks.append((check, [None if t is None else t.clone() for t in outputs]))
        self.pending = []

    def done(self, inputs, check, outputs) -> None:
        """A call is complete for the caller: scribble on its inputs (another stream, after the caller's), and
        queue its outputs for their late copy; `check(copies)` compares them at the end of the round."""
        self.scribbler.wait_stream(self.caller)
        with torch.cuda.stream(self.scribbler):
            for t in _flat(inputs):
                _poison(t)
                t.record_stream(self.scribbler)  # the test's own order: freed only after the poison is written
        self.pending.append((check, list(outputs)))

    def finish_round(self) -> list:
        """Copy what is left, wait for everything, run the comparisons: the failures' texts."""
        self._copy_pending()
        torch.cuda.synchronize(self.device)
        failures, self.failures = self.failures, []
        for check, copies in self.checks:
            try:
                check(copies)
            except AssertionError as exc:
                failures.append(str(exc))
        self.checks = []
        return failures


def _equal(what):
    def check(copies):
        assert_same(what, *copies)
    return check


def _close(what):
    from tokenyard.tools.testing import assert_within_bf16_rounding

    def check(copies):
        assert_within_bf16_rounding(copies[0], copies[1], what)
    return check


class _Run:
    """One rank's stress run (NOTE [stream stress])."""

    def __init__(self, seed: int):
        import torch.distributed as dist

        from tokenyard import Buffer, Config, ElasticBuffer

        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts = EXPERTS_PER_RANK * self.num_ranks
        self.draw = random.Random(seed)  # the same on every rank: the same calls
        self.seed = seed
        self.streams = _Streams(self.device)
        self.covered = collections.Counter()
        self.num_calls = 0
        group = dist.group.WORLD
        nvl = Config(num_max_tokens_per_rank=MAX_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, self.num_ranks)
        rdma = Buffer.get_low_latency_rdma_size_hint(LOW_LATENCY_MAX_TOKENS, HIDDEN, self.num_ranks,
                                                     self.num_experts)
        self.v1 = Buffer(group, nvl, 0, backend="cuda", timeout_s=30)
        self.v1_ref = Buffer(group, nvl, 0, backend="reference")
        self.ll = Buffer(group, 0, rdma, backend="cuda", timeout_s=30)
        self.ll.runtime.use_low_latency_kernels = True
        self.ll_ref = Buffer(group, 0, rdma, backend="reference")
        self.v2 = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                                num_gpu_timeout_secs=30, backend="cuda", check_inputs=False)
        self.v2_ref = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                                    backend="reference", check_inputs=False)
        for buffer in (self.v1, self.ll, self.v2.buffer):
            buffer.runtime.poison_outputs = True

    # -- draws ---------------------------------------------------------------------------------------------

    def _pick(self, name: str, options):
        value = self.draw.choice(options)
        self.covered[f"{name}={value}"] += 1
        return value

    def _stream_keywords(self, op: str, v2: bool):
        """A normal-mode call's stream keywords, and where its inputs come from."""
        source = self._pick(f"{op}.inputs", ("none", "caller", "side"))
        asynchronous = self._pick(f"{op}.{'async_with_compute_stream' if v2 else 'async_finish'}", (False, True))
        allocate = self._pick(f"{op}.allocate_on_comm_stream", (False, True))
        self.num_calls += 1
        return source, asynchronous, allocate

    @staticmethod
    def _event(event, v2: bool):
        """V2 takes an `EventHandle` as `previous_event`, V1 an `EventOverlap`."""
        return event if v2 or event is None else EventOverlap(event)

    def _expect(self, ok: bool, what: str) -> None:
        """A host-side comparison, noted without raising, so that every rank goes on making the same calls."""
        if not ok:
            self.streams.failures.append(what)

    def _wait(self, event) -> None:
        """An asynchronous call's event, waited for now or after some work of the caller's own."""
        if self.draw.random() < 0.5:
            torch.cuda._sleep(SLEEP_CYCLES // 4)
        event.current_stream_wait()

    def _inputs(self, call):
        """Fresh random inputs of a round (this rank's), and the dispatch's dtype ("bf16" or "fp8"; the
        low-latency dispatch takes bf16 and casts with use_fp8)."""
        from tokenyard.tools.testing import make_rank_inputs

        num_tokens = self.draw.randint(1, MAX_TOKENS if call != "ll" else LOW_LATENCY_MAX_TOKENS)
        kind = self._pick("routing", ("uniform", "masked", "skewed"))
        dtype = self._pick(f"{call}.dtype", ("bf16", "fp8"))
        made = "bf16" if call == "ll" else dtype
        return make_rank_inputs(self.draw.randrange(1 << 30), self.num_ranks, num_tokens, HIDDEN,
                                self.num_experts, NUM_TOPK, kind, made, self.device)[self.rank], dtype

    # -- V1 normal mode ------------------------------------------------------------------------------------

    def v1_round(self) -> None:
        s = self.streams
        (x, topk_idx, weights), dtype = self._inputs("v1")
        r_layout = self.v1_ref.get_dispatch_layout(topk_idx, self.num_experts)
        source, asynchronous, allocate = self._stream_keywords("v1.layout", False)
        (idx,), event = s.inputs([topk_idx], source)
        layout = self.v1.get_dispatch_layout(idx, self.num_experts, previous_event=self._event(event, False),
                                             async_finish=asynchronous, allocate_on_comm_stream=allocate)
        if asynchronous:
            self._wait(layout[-1])
        per_rank, _, per_expert, in_rank, _ = layout
        del layout  # every output is dropped once queued for its late copy (NOTE [stream stress])
        s.done([idx], _equal("v1 layout is_token_in_rank"), (in_rank, r_layout[3]))
        s.done([], _equal("v1 layout num_tokens_per_rank"), (per_rank, r_layout[0]))
        s.done([], _equal("v1 layout num_tokens_per_expert"), (per_expert, r_layout[2]))

        alignment = self._pick("v1.expert_alignment", (1, 4))
        ref = self.v1_ref.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=r_layout[0],
                                   is_token_in_rank=r_layout[3], num_tokens_per_expert=r_layout[2],
                                   expert_alignment=alignment)
        source, asynchronous, allocate = self._stream_keywords("v1.dispatch", False)
        # is_token_in_rank stays the caller's: DeepEP's handle holds it, so it is not scribbled on
        (xs, idx, w, per_rank_in, per_expert_in), event = s.inputs([x, topk_idx, weights, per_rank, per_expert],
                                                                   source)
        del per_rank, per_expert
        out = self.v1.dispatch(xs, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank_in,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert_in,
                               expert_alignment=alignment, previous_event=self._event(event, False),
                               async_finish=asynchronous, allocate_on_comm_stream=allocate)
        if asynchronous:
            self._wait(out[-1])
        recv_x, recv_idx, recv_w, per_expert_list, handle, _ = out
        self._expect(per_expert_list == ref[3], f"v1 dispatch: per-expert counts {per_expert_list} vs {ref[3]}")
        parts, ref_parts = (recv_x if dtype == "fp8" else (recv_x,)), (ref[0] if dtype == "fp8" else (ref[0],))
        s.done([xs, idx, w, per_rank_in, per_expert_in], _equal("v1 dispatch recv_x"), (parts[0], ref_parts[0]))
        if dtype == "fp8":
            s.done([], _equal("v1 dispatch recv_x scales"), (parts[1], ref_parts[1]))
        s.done([], _equal("v1 dispatch recv_topk_idx"), (recv_idx, ref[1]))
        s.done([], _equal("v1 dispatch recv_topk_weights"), (recv_w, ref[2]))
        del out, recv_x, recv_idx, recv_w, parts

        if self._pick("v1.cached_dispatch", (False, True)):
            source, asynchronous, allocate = self._stream_keywords("v1.cached_dispatch", False)
            (xs,), event = s.inputs([x], source)
            again = self.v1.dispatch(xs, handle=handle, previous_event=self._event(event, False),
                                     async_finish=asynchronous, allocate_on_comm_stream=allocate)
            if asynchronous:
                self._wait(again[-1])
            s.done([xs], _equal("v1 cached dispatch recv_x"), (again[0][0] if dtype == "fp8" else again[0],
                                                               ref_parts[0]))
            del again

        y = (ref_parts[0].float() * 0.5 - 0.25).to(torch.bfloat16)
        biases = self._pick("v1.combine.biases", (0, 1, 2))
        bias = [torch.randn(x_rows(x), HIDDEN, device=self.device).to(torch.bfloat16) for _ in range(biases)]
        bias_arg = None if biases == 0 else (bias[0] if biases == 1 else tuple(bias))
        want = self.v1_ref.combine(y, ref[4], topk_weights=ref[2], bias=bias_arg)
        source, asynchronous, allocate = self._stream_keywords("v1.combine", False)
        (ys, w, b), event = s.inputs([y, ref[2], bias_arg], source)
        got = self.v1.combine(ys, handle, topk_weights=w, bias=b, previous_event=self._event(event, False),
                              async_finish=asynchronous, allocate_on_comm_stream=allocate)
        if asynchronous:
            self._wait(got[-1])
        s.done([ys, w, b], _equal("v1 combine"), (got[0], want[0]))
        s.done([], _equal("v1 combined weights"), (got[1], want[1]))
        del got

    # -- V2 ElasticBuffer ----------------------------------------------------------------------------------

    def v2_round(self) -> None:
        s = self.streams
        (x, topk_idx, weights), dtype = self._inputs("v2")
        expand = self._pick("v2.do_expand", (False, True))
        alignment = self._pick("v2.expert_alignment", (1, 16, 128))
        cpu_sync = self._pick("v2.do_cpu_sync", (False, True))
        local = self.num_experts // self.num_ranks
        settings = dict(num_experts=self.num_experts, expert_alignment=alignment, do_cpu_sync=cpu_sync,
                        do_expand=expand, do_zero_padding=expand)
        r_stats = torch.zeros(local, dtype=torch.int32, device=self.device)
        ref = self.v2_ref.dispatch(x, topk_idx, weights, r_stats, **settings)
        source, asynchronous, allocate = self._stream_keywords("v2.dispatch", True)
        stats = torch.zeros(local, dtype=torch.int32, device=self.device)
        (xs, idx, w), event = s.inputs([x, topk_idx, weights], source)
        out = self.v2.dispatch(xs, idx, w, stats, previous_event=self._event(event, True),
                               async_with_compute_stream=asynchronous, allocate_on_comm_stream=allocate, **settings)
        if asynchronous:
            self._wait(out[-1])
        recv_x, recv_idx, recv_w, handle, _ = out
        r_handle = ref[3]
        valid = int(r_handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        rows = slice(None) if expand else slice(0, valid)
        counts = (handle.num_recv_tokens, handle.num_expanded_tokens, handle.num_recv_tokens_per_expert_list)
        want = (r_handle.num_recv_tokens, r_handle.num_expanded_tokens, r_handle.num_recv_tokens_per_expert_list)
        self._expect(counts == want, f"v2 dispatch: counts {counts} vs {want}")
        data, ref_data = (recv_x[0], ref[0][0]) if dtype == "fp8" else (recv_x, ref[0])
        s.done([xs, idx, w], _equal("v2 dispatch recv_x"), (data[rows], ref_data[rows]))
        if dtype == "fp8":
            s.done([], _equal("v2 dispatch recv_x scales"), (recv_x[1][rows], ref[0][1][rows]))
        s.done([], _equal("v2 dispatch recv_topk_weights"), (recv_w[rows], ref[2][rows]))
        if not expand:
            s.done([], _equal("v2 dispatch recv_topk_idx"), (recv_idx[rows], ref[1][rows]))
        s.done([], _equal("v2 dispatch stats"), (stats, r_stats))
        for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                     "num_unaligned_recv_tokens_per_expert"):
            s.done([], _equal(f"v2 handle.{name}"), (getattr(handle, name), getattr(r_handle, name)))
        del out, recv_x, recv_idx, recv_w, data

        if self._pick("v2.cached_dispatch", (False, True)):
            source, asynchronous, allocate = self._stream_keywords("v2.cached_dispatch", True)
            (xs, w), event = s.inputs([x, weights], source)
            again = self.v2.dispatch(xs, topk_weights=w, handle=handle, do_expand=expand, do_zero_padding=expand,
                                     previous_event=self._event(event, True), async_with_compute_stream=asynchronous,
                                     allocate_on_comm_stream=allocate)
            if asynchronous:
                self._wait(again[-1])
            again_data = again[0][0] if dtype == "fp8" else again[0]
            s.done([xs, w], _equal("v2 cached dispatch recv_x"), (again_data[rows], ref_data[rows]))
            s.done([], _equal("v2 cached dispatch recv_topk_weights"), (again[2][rows], ref[2][rows]))
            del again, again_data

        y = (ref_data.float() * 0.5 - 0.25).to(torch.bfloat16)
        biases = self._pick("v2.combine.biases", (0, 1, 2))
        bias = [torch.randn(x_rows(x), HIDDEN, device=self.device).to(torch.bfloat16) for _ in range(biases)]
        bias_arg = None if biases == 0 else (bias[0] if biases == 1 else tuple(bias))
        want = self.v2_ref.combine(y, r_handle, ref[2], bias_arg)
        source, asynchronous, allocate = self._stream_keywords("v2.combine", True)
        (ys, w, b), event = s.inputs([y, ref[2], bias_arg], source)
        got = self.v2.combine(ys, handle, w, b, previous_event=self._event(event, True),
                              async_with_compute_stream=asynchronous, allocate_on_comm_stream=allocate)
        if asynchronous:
            self._wait(got[-1])
        s.done([ys, w, b], _close(f"v2 {'expanded ' if expand else ''}combine"), (got[0], want[0]))
        s.done([], _equal("v2 combined_topk_weights"), (got[1], want[1]))
        del got

    # -- low-latency mode ----------------------------------------------------------------------------------

    def _ll_mode(self, op: str) -> str:
        self.num_calls += 1
        return self._pick(f"{op}.mode", ("plain", "async_finish", "return_recv_hook"))

    def _ll_complete(self, mode: str, event, hook) -> None:
        if mode == "async_finish":
            self._wait(event)
        elif mode == "return_recv_hook":
            if self.draw.random() < 0.5:
                torch.cuda._sleep(SLEEP_CYCLES // 4)  # the other micro-batch's work
            hook()

    def ll_round(self) -> None:
        s = self.streams
        (x, topk_idx, weights), dtype = self._inputs("ll")
        use_fp8 = dtype == "fp8"
        n = LOW_LATENCY_MAX_TOKENS
        ref = self.ll_ref.low_latency_dispatch(x, topk_idx, n, self.num_experts, use_fp8=use_fp8)
        mode = self._ll_mode("ll.dispatch")
        (xs, idx), _ = s.inputs([x, topk_idx], "none")
        out = self.ll.low_latency_dispatch(xs, idx, n, self.num_experts, use_fp8=use_fp8,
                                           async_finish=mode == "async_finish",
                                           return_recv_hook=mode == "return_recv_hook")
        self._ll_complete(mode, out[3], out[4])
        recv, count, handle = out[0], out[1], out[2]
        r_handle = ref[2]
        s.done([], _equal("low-latency packed_recv_count"), (count, ref[1]))
        counts = (r_handle.layout_range & 0xFFFFFFFF).sum(1)
        valid = torch.arange(self.num_ranks * n, device=self.device).view(1, -1) < counts.view(-1, 1)
        data, ref_data = (recv[0], ref[0][0]) if use_fp8 else (recv, ref[0])
        s.done([xs, idx], _equal("low-latency dispatch data"), (data[valid], ref_data[valid]))
        if use_fp8:
            s.done([], _equal("low-latency dispatch scales"), (recv[1][valid], ref[0][1][valid]))
        s.done([], _equal("low-latency layout_range"), (handle.layout_range, r_handle.layout_range))

        y = (ref_data.float() * 0.5 + 1.0).to(torch.bfloat16)
        want = self.ll_ref.low_latency_combine(y, topk_idx, weights, r_handle)[0]
        mode = self._ll_mode("ll.combine")
        (ys, idx, w), _ = s.inputs([y, topk_idx, weights], "none")
        got = self.ll.low_latency_combine(ys, idx, w, handle, async_finish=mode == "async_finish",
                                          return_recv_hook=mode == "return_recv_hook")
        self._ll_complete(mode, got[1], got[2])
        s.done([ys, idx, w], _close("low-latency combine"), (got[0], want))

    def run(self, num_rounds: int) -> dict:
        failures = []
        for round_idx in range(num_rounds):
            family = self._pick("family", ("v1", "v2", "ll"))
            where = f"seed {self.seed} round {round_idx} ({family})"
            try:
                getattr(self, f"{family}_round")()
            except Exception as exc:  # a tokenyard error: the ranks may no longer make the same calls, so stop
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
                break
            failures += [f"{where}: {f}" for f in self.streams.finish_round()]
        torch.cuda.synchronize()
        return {"rank": self.rank, "num_calls": self.num_calls, "covered": dict(sorted(self.covered.items())),
                "failures": failures}

    def destroy(self) -> None:
        for buffer in (self.v1, self.v1_ref, self.ll, self.ll_ref, self.v2, self.v2_ref):
            buffer.destroy()


def x_rows(x) -> int:
    return (x[0] if isinstance(x, tuple) else x).size(0)


def stress(seed: int, num_rounds: int) -> dict:
    """One rank's run (under tokenyard.tools.launch.run_on_ranks): its calls, the keyword values they covered,
    and the failures, each naming its seed, round and output."""
    run = _Run(seed)
    try:
        return run.run(num_rounds)
    finally:
        run.destroy()
