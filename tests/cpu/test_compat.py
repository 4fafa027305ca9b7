"""DeepEP code runs after an import change: names, signatures and handle shapes."""

import inspect

import tokenyard
import tokenyard.compat.deep_ep as deep_ep
from tokenyard.compat.deep_ep.utils import EventHandle, EventOverlap

# DeepEP's Buffer's parameters, in DeepEP's order (DeepEP main's deep_ep/buffers/legacy.py, whose constructor
# dropped V1's use_fabric).
DEEPEP_SIGNATURES = {
    "__init__": ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                 "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink", "comm"],
    "get_dispatch_layout": ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "dispatch": ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                 "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                 "config", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "combine": ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                "allocate_on_comm_stream"],
    "low_latency_dispatch": ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                             "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"],
    "low_latency_combine": ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                            "return_recv_hook", "out", "combine_wait_recv_cost_stats"],
    "clean_low_latency_buffer": ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "get_next_low_latency_combine_buffer": ["handle"],
    "get_local_buffer_tensor": ["dtype", "size", "offset", "use_rdma_buffer"],
    "low_latency_update_mask_buffer": ["rank_to_mask", "mask"],
    "low_latency_query_mask_buffer": ["mask_status"],
    "low_latency_clean_mask_buffer": [],
    "get_comm_stream": [],
    "destroy": [],
}
DEEPEP_STATICS = {
    "set_num_sms": ["new_num_sms"],
    "capture": [],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "is_sm90_compiled": [],
    "_unpack_bias": ["bias"],
}


def _positional(fn):
    return [name for name, p in inspect.signature(fn).parameters.items()
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]


def test_every_deepep_method_takes_deepeps_arguments_in_deepeps_order():
    for name, params in {**DEEPEP_SIGNATURES, **DEEPEP_STATICS}.items():
        ours = _positional(getattr(deep_ep.Buffer, name))
        assert ours[:len(params)] == params, f"Buffer.{name}: {ours} does not start with DeepEP's {params}"


def test_use_fabric_is_still_taken_by_keyword():
    parameter = inspect.signature(deep_ep.Buffer).parameters["use_fabric"]
    assert parameter.kind == parameter.KEYWORD_ONLY and parameter.default is False


def test_statics_are_static_and_class_attribute_num_sms_exists():
    for name in DEEPEP_STATICS:
        assert isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod), name
    assert deep_ep.Buffer.num_sms == 20


def test_framework_imports_resolve():
    assert deep_ep.Buffer is tokenyard.Buffer and deep_ep.Config is tokenyard.Config
    assert deep_ep.EventOverlap is EventOverlap and deep_ep.EventHandle is EventHandle
    assert deep_ep.topk_idx_t is tokenyard.topk_idx_t
    from tokenyard.compat.deep_ep.buffer import Buffer
    from tokenyard.compat.deep_ep.utils import check_nvlink_connections

    assert Buffer is tokenyard.Buffer and callable(check_nvlink_connections)
    assert deep_ep.__version__ == tokenyard.__version__


def test_seed_readme_autotuner_benchmark_and_cli_resolve():
    """The seed README's ``from deep_ep import AutoTuner, Benchmark`` and ``python -m deep_ep.benchmark``."""
    import subprocess
    import sys

    from tokenyard.compat.deep_ep import AutoTuner, Benchmark

    assert AutoTuner is tokenyard.AutoTuner and Benchmark is tokenyard.Benchmark
    shown = subprocess.run([sys.executable, "-m", "tokenyard.compat.deep_ep.benchmark", "--help"], check=True,
                           capture_output=True, text=True).stdout
    assert "--mode" in shown and "--num_tokens" in shown


def test_handles_survive_copy_deepcopy_and_pickle():
    import copy
    import pickle

    import torch

    fields = [torch.arange(3) + i for i in range(6)]
    handle = tokenyard.DispatchHandle(*fields, buffer_id=3, num_recv_tokens=7)
    made = tokenyard.DispatchHandle.of(tuple(fields), {"buffer_id": 3, "num_recv_tokens": 7})  # the calls' way
    low = tokenyard.LowLatencyHandle(fields[0], fields[1], 128, 7168, 256, buffer_id=3, num_topk=8, half=1)
    low_made = tokenyard.LowLatencyHandle.of((fields[0], fields[1], 128, 7168, 256),
                                             {"buffer_id": 3, "num_topk": 8, "half": 1})
    for copied in (copy.copy(handle), copy.deepcopy(handle), pickle.loads(pickle.dumps(handle)), made,
                   pickle.loads(pickle.dumps(made))):
        assert type(copied) is tokenyard.DispatchHandle and (copied.buffer_id, copied.num_recv_tokens) == (3, 7)
        assert all(torch.equal(a, b) for a, b in zip(copied, fields)) and copied.rounds is None
    for copied in (copy.copy(low), copy.deepcopy(low), pickle.loads(pickle.dumps(low)), low_made,
                   copy.deepcopy(low_made)):
        assert type(copied) is tokenyard.LowLatencyHandle and (copied.num_topk, copied.half) == (8, 1)
        assert tuple(copied)[2:] == (128, 7168, 256) and copied.hidden == 7168 and copied.num_tokens is None


def test_config_takes_deepeps_positional_arguments_and_gives_hints():
    config = deep_ep.Config(24, 6, 256, 6, 128)
    assert config.num_sms == 24
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > 4096 * 8 * 7168 * 2
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) == config.internode_region_bytes(7168 * 2, 16, 8) > 0
    assert config.internode_region_bytes(7168 * 2, 4, 2) > 0  # 2 virtual nodes of 2
    assert config.internode_region_bytes(7168 * 2, 4, 4) == config.internode_region_bytes(7168 * 2, 4, 0) == 0
    for ranks in (2, 3, 4, 6, 8, 16):
        assert deep_ep.Buffer.get_dispatch_config(ranks).num_sms == deep_ep.Buffer.num_sms


def test_set_num_sms_accepts_even_counts_only():
    before = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.get_combine_config(4).num_sms == 24
        for bad in (23, 0, -2):
            try:
                deep_ep.Buffer.set_num_sms(bad)
            except tokenyard.InvalidInputError:
                continue
            raise AssertionError(f"set_num_sms({bad}) was accepted")
    finally:
        deep_ep.Buffer.num_sms = before


def test_event_overlap_is_a_context_manager_without_cuda():
    event = deep_ep.Buffer.capture()
    with event as same:
        assert same is event
    event.current_stream_wait()


class _Recorded:
    """An event handle that records its waits."""

    def __init__(self, log):
        self.log = log

    def current_stream_wait(self):
        self.log.append("wait")


def test_event_overlap_has_deepep_v2s_release_handle_call_and_hook_after_wait():
    log = []
    event = EventOverlap(_Recorded(log))
    event.register_hook_after_wait(lambda: log.append("hook"))
    try:
        event.register_hook_after_wait(lambda: None)
    except tokenyard.InvalidInputError:
        pass
    else:
        raise AssertionError("a second hook was accepted")
    event.current_stream_wait()
    event.current_stream_wait(release_handle=True)
    assert log == ["wait", "hook", "wait"] and event.event is None, log  # the hook once, after the wait
    log.clear()
    event = EventOverlap(_Recorded(log))
    assert event(release_handle=True) is event
    with event(release_handle=True):
        assert log == []
    assert log == ["wait"] and event.event is None
    with EventOverlap(_Recorded(log)) as kept:
        pass
    assert kept.event is not None, "without release_handle the event stays"
    hooked = EventOverlap(None)  # no event to wait for (a call without async_finish, CPU): the hook still runs
    hooked.register_hook_after_wait(lambda: log.append("hook"))
    with hooked:
        pass
    assert log[-1] == "hook"


def test_elastic_buffer_has_deepep_v2s_statics_and_refuses_what_it_does_not_offer():
    statics = {"get_engram_storage_size_hint": (1024, 7168, 128), "get_pp_buffer_size_hint": (1 << 20, 2),
               "get_agrs_num_max_session_bytes": (None, (8, 7168), None), "get_agrs_buffer_size_hint": (None, 1 << 20)}
    for name, args in statics.items():
        assert isinstance(inspect.getattr_static(deep_ep.ElasticBuffer, name), staticmethod), name
        try:
            getattr(deep_ep.ElasticBuffer, name)(*args)
        except tokenyard.InvalidInputError as exc:
            assert name in str(exc) and "does not offer" in str(exc), str(exc)
        else:
            raise AssertionError(f"{name} was answered")
    defaults = inspect.signature(deep_ep.ElasticBuffer.get_theoretical_num_sms).parameters
    assert (defaults["sm_read_gbs"].default, defaults["sm_write_gbs"].default) == (200, 50)  # DeepEP V2's


def test_deepep_mains_module_layout_imports():
    """DeepEP main's deep_ep.buffers.legacy / .elastic and deep_ep.utils.event / .envs, as code imports them."""
    import importlib

    from tokenyard.compat.deep_ep.buffers import elastic, legacy
    from tokenyard.compat.deep_ep.utils import envs, event

    assert legacy.Buffer is tokenyard.Buffer and legacy.Config is tokenyard.Config
    assert elastic.ElasticBuffer is tokenyard.ElasticBuffer and elastic.EPHandle is tokenyard.EPHandle
    assert event.EventOverlap is EventOverlap and event.EventHandle is EventHandle
    assert envs.get_physical_domain_size is deep_ep.get_physical_domain_size
    assert envs.get_logical_domain_size is deep_ep.get_logical_domain_size
    assert deep_ep.utils.check_nvlink_connections is envs.check_nvlink_connections
    for name in deep_ep.SUBMODULES:
        assert importlib.import_module(f"tokenyard.compat.deep_ep.{name}") is not None
    try:
        envs.init_dist
    except AttributeError as exc:
        assert "does not offer" in str(exc)
    else:
        raise AssertionError("deep_ep.utils.envs.init_dist answered")


def test_handles_unpack_as_deepeps_tuples():
    import torch

    fields = [torch.zeros(1) for _ in range(6)]
    handle = tokenyard.DispatchHandle(*fields, buffer_id=3)
    a, b, c, d, e, f = handle
    assert a is fields[0] and handle.send_head is fields[5] and handle.buffer_id == 3
    low = tokenyard.LowLatencyHandle(fields[0], fields[1], 128, 7168, 256)
    src_info, layout_range, num_max, hidden, num_experts = low
    assert (num_max, hidden, num_experts) == (128, 7168, 256) and low.hidden == 7168


def test_importing_tokenyard_loads_no_cuda_library():
    import subprocess
    import sys

    code = ("import sys, tokenyard, tokenyard.compat.deep_ep; "
            "bad = [m for m in sys.modules if m.startswith('tokenyard.backends.cuda') or m.startswith('tokenyard.jit')]; "
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_inputs_deepep_accepts_in_normal_mode_are_accepted(ranks, seed):
    """A handle on another Buffer, num_worst_tokens with a handle, [T] scales, numpy sizes."""
    from . import compat_scenarios

    ranks(2).run(compat_scenarios.normal_leniencies, seed)


def test_one_column_ue8m0_scales_at_hidden_512_are_accepted(ranks, seed):
    """SGLang's FP8 dispatch with UE8M0 scales (int32, column-major, packed) of one column (issue 47)."""
    from . import compat_scenarios

    ranks(4).run(compat_scenarios.one_column_scales, seed)


def test_inputs_deepep_accepts_in_low_latency_mode_are_accepted(ranks, seed):
    """use_logfmt (with zero_copy too), [R] int64 wait-cost stats, DeepEP's runtime queries."""
    from . import compat_scenarios

    ranks(2).run(compat_scenarios.low_latency_leniencies, seed)


def test_every_tensor_of_every_return_and_handle_is_contiguous_where_deepeps_is(ranks, seed):
    """vLLM's kernels read handle tensors as plain memory (`psum_num_recv_tokens_per_scaleup_rank` of an EPHandle):
    normal, low-latency, ElasticBuffer and internode returns and handles (tests/cpu/api_scenarios.py)."""
    from . import api_scenarios

    ranks(4).run(api_scenarios.handles_and_returns_are_contiguous, seed)
