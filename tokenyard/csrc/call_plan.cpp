// The host side of one call in one crossing from Python: allocate its tensors, order the streams, fill in
// the kernels' arguments and launch them (NOTE [call plans] in tokenyard/backends/cuda/plans.py).
//
// A Plan is built once per call shape in Python, which decides everything (kernels, grids, the argument
// blocks with their constant values, the tensors' shapes); a run only allocates, copies pointers and
// per-call integers into the argument blocks at the offsets the plan names, and launches. The CUDA driver
// entry points come from Python as addresses (the libcuda that PyTorch uses), so this file needs no CUDA
// header and compiles against any build of PyTorch, the CPU build included.
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tokenyard::host {

using CUresult = int;
using LaunchKernelFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    void*, void**, void**);
using EventRecordFn = CUresult (*)(void*, void*);
using StreamWaitEventFn = CUresult (*)(void*, void*, unsigned);
using MemsetD8AsyncFn = CUresult (*)(uint64_t, unsigned char, size_t, void*);
using StreamIsCapturingFn = CUresult (*)(void*, int*);

struct Driver {
    LaunchKernelFn launch = nullptr;
    EventRecordFn record = nullptr;
    StreamWaitEventFn wait = nullptr;
    MemsetD8AsyncFn memset8 = nullptr;
    StreamIsCapturingFn capturing = nullptr;
};

Driver& driver() {
    static Driver d;
    return d;
}

void set_driver(int64_t launch, int64_t record, int64_t wait, int64_t memset8, int64_t capturing) {
    Driver& d = driver();
    d.launch = reinterpret_cast<LaunchKernelFn>(launch);
    d.record = reinterpret_cast<EventRecordFn>(record);
    d.wait = reinterpret_cast<StreamWaitEventFn>(wait);
    d.memset8 = reinterpret_cast<MemsetD8AsyncFn>(memset8);
    d.capturing = reinterpret_cast<StreamIsCapturingFn>(capturing);
}

void check(CUresult status, const char* what) {
    if (status != 0)
        throw std::runtime_error(std::string("tokenyard: ") + what + " failed: CUDA driver error " +
                                 std::to_string(status));
}

// A Python object that is a tensor (None costs no isinstance check, which goes through torch.Tensor's metaclass).
bool is_tensor(PyObject* obj) { return obj != Py_None && THPVariable_Check(obj); }

// NOTE [plan profile]: with profiling on (`set_profiling`), each run adds the time of each of its steps to
// per-step totals, which `take_profile` returns as means per run and clears (benchmarks/host_cost.py prints
// them); with it off, a step costs a branch.
enum Step : int { kInputs, kOutputs, kStreams, kFills, kLaunches, kResult, kNumSteps };
const char* const kStepNames[kNumSteps] = {"inputs", "outputs", "streams", "fills", "launches", "result"};

struct ProfileTotals {
    bool on = false;
    int64_t runs = 0;
    double ns[kNumSteps] = {};
};

ProfileTotals& profile_totals() {
    static ProfileTotals totals;
    return totals;
}

class Profile {
public:
    Profile() : on_(profile_totals().on), last_(on_ ? now() : 0) {}
    void step(Step step) {
        if (on_) {
            const double t = now();
            profile_totals().ns[step] += t - last_;
            last_ = t;
        }
    }
    void done() const { profile_totals().runs += on_; }

private:
    static double now() {
        return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    bool on_;
    double last_;
};

void set_profiling(bool on) { profile_totals().on = on; }

py::dict take_profile() {
    ProfileTotals& totals = profile_totals();
    py::dict result;
    for (int s = 0; s < kNumSteps; ++s) {
        result[kStepNames[s]] = totals.runs ? totals.ns[s] / totals.runs / 1e3 : 0.0;  // us per run
        totals.ns[s] = 0;
    }
    result["runs"] = totals.runs;
    totals.runs = 0;
    return result;
}

// NOTE [call signatures]: the key of a fast path (NOTE [fast paths] in backends/cuda/fast_paths.py) is what
// the full path's checks read of a call's arguments, as bytes: of a tensor its dtype, device, sizes, strides
// and how far past a 16-byte boundary its data starts (checks.tensor's `aligned`); of None, a bool or an int its
// value; of a tuple its items. Any other object (a list, a float, a tensor without strides) makes no signature:
// None, and the call takes the full path.
void append_word(std::string& out, int64_t word) { out.append(reinterpret_cast<const char*>(&word), sizeof word); }

bool append_signature(std::string& out, PyObject* obj) {
    enum Tag : int64_t { kNone, kFalse, kTrue, kInt, kTensor, kTuple };
    if (obj == Py_None) {
        append_word(out, kNone);
    } else if (PyBool_Check(obj)) {  // before the ints: a bool is one
        append_word(out, obj == Py_True ? kTrue : kFalse);
    } else if (PyLong_Check(obj)) {
        int overflow = 0;
        const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return false;
        }
        append_word(out, kInt);
        append_word(out, value);
    } else if (PyTuple_Check(obj)) {
        const Py_ssize_t size = PyTuple_GET_SIZE(obj);
        append_word(out, kTuple);
        append_word(out, size);
        for (Py_ssize_t i = 0; i < size; ++i) {
            if (!append_signature(out, PyTuple_GET_ITEM(obj, i)))
                return false;
        }
    } else if (THPVariable_Check(obj)) {
        const at::Tensor& t = THPVariable_Unpack(obj);
        if (t.layout() != at::kStrided || t.is_nested())
            return false;
        try {
            const auto sizes = t.sizes();
            const auto strides = t.strides();
            append_word(out, kTensor);
            append_word(out, static_cast<int64_t>(t.scalar_type()));
            append_word(out, static_cast<int64_t>(t.device().type()) << 32 | static_cast<uint8_t>(t.device().index()));
            append_word(out, static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
            append_word(out, static_cast<int64_t>(sizes.size()));
            for (size_t d = 0; d < sizes.size(); ++d) {
                append_word(out, sizes[d]);
                append_word(out, strides[d]);
            }
        } catch (const c10::Error&) {  // symbolic sizes (a fake tensor)
            return false;
        }
    } else {
        return false;
    }
    return true;
}

py::object signature(const py::tuple& items) {
    std::string out;
    out.reserve(512);
    if (!append_signature(out, items.ptr()))
        return py::none();
    return py::bytes(out);
}

// Where a run writes a per-call value into an argument block.
// kArenaOffset: the byte offset of an output's block in the output arena, -1 where it has none (NOTE [output arena]).
enum SlotKind : int { kInputPointer = 0, kOutputPointer = 1, kScalar = 2, kArenaOffset = 3 };

struct Slot {
    int64_t offset;
    int kind;
    int index;
    int bytes;  // 4 or 8
};

struct Launch {
    void* function;
    unsigned grid, block, shared_bytes;
    std::vector<uint8_t> args;  // the template; the slots are overwritten at each run
    std::vector<Slot> slots;
};

struct Output {
    std::vector<int64_t> shape;  // a negative entry d: the run's scalar -d - 1
    at::ScalarType dtype;
    int fill;  // a byte value every byte is set to on the launch stream before the first launch; -1: none
    int within;  // >= 0: a part of that earlier output (a whole), not allocated
    bool returned;  // false: a whole, bytes enough for its parts (each 16-byte aligned), handed back only as them
    std::vector<int64_t> order;  // non-empty: handed back as the contiguous tensor of `shape` permuted so
    bool in_arena;  // a block of the plan's output arena where one is free (NOTE [output arena])
};

// NOTE [output arena]
// A dispatch's senders place each row's data straight into its destination's recv_x (NOTE [placed rows] in
// kernels/dispatch.cuh), so recv_x must lie in memory every peer maps: the Buffer's output arena, one allocation per
// rank shared by CUDA IPC as its buffer is (backends/cuda/memory.py). A plan's output marked for the arena is a
// block of it (first fit, kArenaAlign-aligned), handed out as a tensor whose storage gives the block back when its
// last user lets go; where no block is free the output is allocated as any other, and the call takes the staged
// path. Reuse follows the caching allocator's stream rule: a block given back records an event on the device's
// current stream of the thread that let go of it, and the next run that takes the block first makes its own launch
// stream wait for that event; peers write a block only once this rank's data kernel, later on that stream, has
// published it. (The allocator's record_stream does nothing for these storages, as for any storage it did not
// make.) The memory is freed (`free_fn`, the runtime's cudaFree) once the Buffer has let go of the arena
// (the backend's destroy, after its peers unmapped it) and no tensor holds a block of it. Under CUDA-graph capture
// no block is taken: a captured call keeps the staged path.
class OutputArena : public std::enable_shared_from_this<OutputArena> {
public:
    static constexpr int64_t kArenaAlign = 512;

    OutputArena(c10::Device device, int64_t base, int64_t bytes, int64_t free_fn)
        : device_(device), guard_(c10::impl::getDeviceGuardImpl(device.type())), base_(base),
          free_fn_(reinterpret_cast<FreeFn>(free_fn)) {
        if (bytes > 0)
            free_[0] = bytes;
    }

    ~OutputArena() {
        for (const Pending& pending : pending_)
            destroy_event(pending.event);
        for (void* event : spare_events_)
            destroy_event(event);
        if (free_fn_ != nullptr && base_ != 0)
            free_fn_(reinterpret_cast<void*>(base_));
    }

    // A tensor of `shape` and `dtype` in a block of the arena, and the block's byte offset; an undefined tensor
    // and -1 where no block is free (or `stream` is capturing). `stream` waits for the block's last users.
    std::pair<at::Tensor, int64_t> take(const std::vector<int64_t>& shape, at::ScalarType dtype,
                                        c10::DispatchKeySet keys, void* stream) {
        int64_t numel = 1;
        for (int64_t size : shape)
            numel *= size;
        const int64_t bytes = std::max<int64_t>(kArenaAlign, (numel * static_cast<int64_t>(c10::elementSize(dtype)) +
                                                              kArenaAlign - 1) / kArenaAlign * kArenaAlign);
        const Driver& d = driver();
        int capture_status = 0;
        if (d.capturing != nullptr && stream != nullptr) {
            check(d.capturing(stream, &capture_status), "cuStreamIsCapturing");
            if (capture_status != 0)
                return {at::Tensor(), -1};
        }
        std::lock_guard<std::mutex> lock(mutex_);
        collect();
        int64_t offset = fit(bytes);
        if (offset < 0)
            offset = wait_for_fit(bytes, stream);
        if (offset < 0)
            return {at::Tensor(), -1};
        auto* block = new Block{shared_from_this(), offset, bytes};
        c10::DataPtr data(reinterpret_cast<void*>(base_ + offset), block, &OutputArena::give_back, device_);
        c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), nullptr, false);
        at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys,
                                                                     caffe2::TypeMeta::fromScalarType(dtype));
        tensor.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
        return {std::move(tensor), offset};
    }

    // Bytes no tensor holds (read by tests).
    int64_t free_bytes() {
        std::lock_guard<std::mutex> lock(mutex_);
        int64_t total = 0;
        for (const auto& [offset, size] : free_)
            total += size;
        for (const Pending& pending : pending_)
            total += pending.bytes;
        return total;
    }

private:
    using FreeFn = int (*)(void*);
    struct Block {
        std::shared_ptr<OutputArena> arena;
        int64_t offset, bytes;
    };
    struct Pending {
        int64_t offset, bytes;
        void* event;
    };

    static void give_back(void* context) {
        std::unique_ptr<Block> block(static_cast<Block*>(context));
        block->arena->returned(block->offset, block->bytes);
    }

    void returned(int64_t offset, int64_t bytes) {
        if (device_.is_cpu()) {  // no streams: free at once (the allocator's logic, tested on the CPU)
            std::lock_guard<std::mutex> lock(mutex_);
            release_range(offset, bytes);
            return;
        }
        void* event = nullptr;
        try {  // after the uses the current stream has queued (a deleter must not throw)
            std::lock_guard<std::mutex> lock(mutex_);
            if (!spare_events_.empty()) {
                event = spare_events_.back();
                spare_events_.pop_back();
            }
            guard_->record(&event, guard_->getStream(device_), device_.index(), c10::EventFlag::PYTORCH_DEFAULT);
            pending_.push_back({offset, bytes, event});
        } catch (...) {  // no stream to record on (the process is ending): the block stays out of use
            destroy_event(event);
        }
    }

    // Blocks given back whose event has passed return to the free list. Under mutex_.
    void collect() {
        for (size_t i = 0; i < pending_.size();) {
            if (!guard_->queryEvent(pending_[i].event)) {
                ++i;
                continue;
            }
            release(i);
        }
    }

    // Blocks given back but still in use on the GPU return to the free list, the oldest first, the launch `stream`
    // waiting for each one's event, until `bytes` fit -> the offset, or -1. The stream waits for no more uses than
    // the fit needs. Under mutex_.
    int64_t wait_for_fit(int64_t bytes, void* stream) {
        while (!pending_.empty()) {
            check(driver().wait(stream, pending_.front().event, 0), "cuStreamWaitEvent");
            release(0);
            const int64_t offset = fit(bytes);
            if (offset >= 0)
                return offset;
        }
        return -1;
    }

    // pending_[i]'s block back in the free list and its event spare; the others keep their order (oldest first).
    // Under mutex_.
    void release(size_t i) {
        release_range(pending_[i].offset, pending_[i].bytes);
        spare_events_.push_back(pending_[i].event);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    }

    // First fit; -1: none. Under mutex_.
    int64_t fit(int64_t bytes) {
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second < bytes)
                continue;
            const int64_t offset = it->first, rest = it->second - bytes;
            free_.erase(it);
            if (rest > 0)
                free_[offset + bytes] = rest;
            return offset;
        }
        return -1;
    }

    // The range back in the free list, merged with its neighbours. Under mutex_.
    void release_range(int64_t offset, int64_t bytes) {
        auto next = free_.lower_bound(offset);
        if (next != free_.end() && next->first == offset + bytes) {
            bytes += next->second;
            next = free_.erase(next);
        }
        if (next != free_.begin()) {
            auto before = std::prev(next);
            if (before->first + before->second == offset) {
                before->second += bytes;
                return;
            }
        }
        free_[offset] = bytes;
    }

    void destroy_event(void* event) {
        if (event == nullptr)
            return;
        try {
            guard_->destroyEvent(event, device_.index());
        } catch (...) {
        }
    }

    c10::Device device_;
    const c10::impl::DeviceGuardImplInterface* guard_;
    int64_t base_;
    FreeFn free_fn_;
    std::mutex mutex_;
    std::map<int64_t, int64_t> free_;  // offset -> bytes
    std::vector<Pending> pending_;  // in the order given back
    std::vector<void*> spare_events_;
};

// NOTE [plan allocations]: at::empty is among the dearest steps of a call's host time (the dispatcher, a device
// guard, then the caching allocator), and a view by view()/narrow() costs too (benchmarks/results/host_cost.md). A run
// allocates through the allocator that made a tensor of this device (the caching allocator on a GPU, on the
// current stream, as at::empty) with the same helper at::empty ends in, when this device is the current one
// (else it takes at::empty's way); and outputs that live together are parts of one allocation (a whole),
// each made as a bare tensor of the whole's storage.
class Plan {
public:
    explicit Plan(c10::Device device)
        : device_(device),
          allocator_(at::empty({0}, at::TensorOptions().device(device).dtype(at::kByte)).storage().allocator()),
          keys_(c10::computeDispatchKey(std::nullopt, at::kStrided, device)),
          guard_(c10::impl::getDeviceGuardImpl(device.type())) {}

    void add_output(std::vector<int64_t> shape, at::ScalarType dtype, int64_t fill, int64_t within, bool returned,
                    std::vector<int64_t> order, bool in_arena) {
        const bool part_of_a_whole = within >= 0 && within < static_cast<int64_t>(outputs_.size()) &&
                                     !outputs_[within].returned;
        if ((within >= 0 && !part_of_a_whole) || (within >= 0 && !returned))
            throw std::invalid_argument("tokenyard: a plan output is a part of no earlier whole");
        if (in_arena && (within >= 0 || !returned || !order.empty()))
            throw std::invalid_argument("tokenyard: an arena output is a returned tensor of its own, in order");
        std::vector<int64_t> sorted(order);
        std::sort(sorted.begin(), sorted.end());
        for (size_t d = 0; d < sorted.size(); ++d) {
            if (sorted[d] != static_cast<int64_t>(d) || sorted.size() != shape.size() || !returned)
                throw std::invalid_argument("tokenyard: a plan output's order is no permutation of its dimensions");
        }
        outputs_.push_back({std::move(shape), dtype, static_cast<int>(fill), static_cast<int>(within), returned,
                            std::move(order), in_arena});
        num_returned_ += returned;
    }

    void set_arena(std::shared_ptr<OutputArena> arena) { arena_ = std::move(arena); }

    void add_launch(int64_t function, int64_t grid, int64_t block, int64_t shared_bytes, const std::string& args,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& slots) {
        Launch launch{reinterpret_cast<void*>(function), static_cast<unsigned>(grid), static_cast<unsigned>(block),
                      static_cast<unsigned>(shared_bytes), std::vector<uint8_t>(args.begin(), args.end()), {}};
        for (const auto& [offset, kind, index, bytes] : slots) {
            if (offset < 0 || offset + bytes > static_cast<int64_t>(launch.args.size()) || (bytes != 4 && bytes != 8))
                throw std::invalid_argument("tokenyard: a plan slot lies outside its argument block");
            launch.slots.push_back({offset, static_cast<int>(kind), static_cast<int>(index), static_cast<int>(bytes)});
        }
        launches_.push_back(std::move(launch));
    }

    int64_t num_outputs() const { return num_returned_; }

    // inputs: tensors or None (a null pointer); scalars: per-call integers. The launches go to `comm` after
    // it waited for `wait_event` (the caller's event; -1: nothing, the call's earlier launches are on `comm`
    // already) or else for `compute` (through `enter_event`); with
    // `join` the compute stream then waits for them (through `exit_event`). Without `comm` they go to
    // `compute`. `record_on_comm`: the run's tensors (and the inputs) are marked as used by the comm stream
    // (an asynchronous call, whose compute stream does not wait), `comm_id` being PyTorch's id of it.
    py::tuple run(const py::tuple& inputs, const std::vector<int64_t>& scalars, int64_t compute, int64_t comm,
                  int64_t wait_event, int64_t enter_event, int64_t exit_event, bool join, bool record_on_comm,
                  int64_t comm_id) {
        const Driver& d = driver();
        if (d.launch == nullptr)
            throw std::runtime_error("tokenyard: the call plans' driver entry points were not set");
        Profile profile;
        std::vector<uint64_t> input_ptrs(inputs.size(), 0);
        for (size_t i = 0; i < inputs.size(); ++i) {
            PyObject* obj = PyTuple_GET_ITEM(inputs.ptr(), i);
            if (is_tensor(obj))
                input_ptrs[i] = reinterpret_cast<uint64_t>(THPVariable_Unpack(obj).data_ptr());
        }
        profile.step(kInputs);
        const auto options = at::TensorOptions().device(device_);
        const bool here = device_.is_cpu() || guard_->getDevice() == device_;  // NOTE [plan allocations]
        const size_t n = outputs_.size();
        std::vector<std::vector<int64_t>> shapes(n);
        std::vector<int64_t> bytes(n, 0), offsets(n, 0);  // a whole's bytes; a part's byte offset in its whole
        for (size_t i = 0; i < n; ++i) {
            const Output& out = outputs_[i];
            shapes[i] = out.shape;
            int64_t numel = 1;
            for (int64_t& size : shapes[i]) {
                size = size < 0 ? scalars.at(-size - 1) : size;
                numel *= size;
            }
            if (out.within >= 0) {
                offsets[i] = bytes[out.within];
                bytes[out.within] += (numel * static_cast<int64_t>(c10::elementSize(out.dtype)) + 15) / 16 * 16;
            }
        }
        std::vector<at::Tensor> outputs;
        outputs.reserve(n);
        std::vector<int64_t> arena_offsets(n, -1);
        void* stream = reinterpret_cast<void*>(comm != 0 ? comm : compute);
        for (size_t i = 0; i < n; ++i) {
            const Output& out = outputs_[i];
            if (out.in_arena && arena_ != nullptr && here) {
                auto [tensor, offset] = arena_->take(shapes[i], out.dtype, keys_, stream);
                if (tensor.defined()) {
                    arena_offsets[i] = offset;
                    outputs.push_back(std::move(tensor));
                    continue;
                }
            }
            if (out.within >= 0) {
                const at::Tensor& whole = outputs[out.within];
                at::Tensor part = at::detail::make_tensor<c10::TensorImpl>(
                        c10::Storage(whole.storage()), keys_, caffe2::TypeMeta::fromScalarType(out.dtype));
                part.unsafeGetTensorImpl()->set_storage_offset(offsets[i] /
                                                               static_cast<int64_t>(c10::elementSize(out.dtype)));
                part.unsafeGetTensorImpl()->set_sizes_contiguous(shapes[i]);
                outputs.push_back(std::move(part));
                continue;
            }
            if (!out.returned)
                shapes[i] = {bytes[i]};
            if (here)
                outputs.push_back(at::detail::empty_generic(shapes[i], allocator_, keys_, out.dtype, std::nullopt));
            else
                outputs.push_back(at::empty(shapes[i], options.dtype(out.dtype)));
        }

        for (size_t i = 0; i < n; ++i) {
            const std::vector<int64_t>& order = outputs_[i].order;
            if (order.empty())
                continue;
            const c10::DimVector strides = c10::contiguous_strides(shapes[i]);
            std::vector<int64_t> sizes_seen(order.size()), strides_seen(order.size());
            for (size_t d = 0; d < order.size(); ++d) {
                sizes_seen[d] = shapes[i][order[d]];
                strides_seen[d] = strides[order[d]];
            }
            outputs[i].unsafeGetTensorImpl()->set_sizes_and_strides(sizes_seen, strides_seen);
        }
        profile.step(kOutputs);
        if (comm != 0 && wait_event >= 0) {
            void* waited = reinterpret_cast<void*>(wait_event);
            if (waited == nullptr) {
                waited = reinterpret_cast<void*>(enter_event);
                check(d.record(waited, reinterpret_cast<void*>(compute)), "cuEventRecord");
            }
            check(d.wait(stream, waited, 0), "cuStreamWaitEvent");
        }
        profile.step(kStreams);
        for (size_t i = 0; i < outputs_.size(); ++i) {
            if (outputs_[i].within < 0 && outputs_[i].fill >= 0 && outputs[i].numel() > 0)
                check(d.memset8(reinterpret_cast<uint64_t>(outputs[i].data_ptr()),
                                static_cast<unsigned char>(outputs_[i].fill), outputs[i].nbytes(), stream),
                      "cuMemsetD8Async");
        }
        profile.step(kFills);
        for (Launch& launch : launches_) {
            for (const Slot& slot : launch.slots) {
                uint64_t value;
                if (slot.kind == kInputPointer)
                    value = input_ptrs.at(slot.index);
                else if (slot.kind == kOutputPointer)
                    value = reinterpret_cast<uint64_t>(outputs.at(slot.index).data_ptr());
                else if (slot.kind == kArenaOffset)
                    value = static_cast<uint64_t>(arena_offsets.at(slot.index));
                else
                    value = static_cast<uint64_t>(scalars.at(slot.index));
                std::memcpy(launch.args.data() + slot.offset, &value, slot.bytes);  // little-endian: low bytes
            }
            size_t size = launch.args.size();
            void* extra[] = {reinterpret_cast<void*>(1), launch.args.data(), reinterpret_cast<void*>(2), &size,
                             nullptr};  // CU_LAUNCH_PARAM_BUFFER_POINTER, _SIZE, _END
            check(d.launch(launch.function, launch.grid, 1, 1, launch.block, 1, 1, launch.shared_bytes, stream,
                           nullptr, extra),
                  "cuLaunchKernel");
        }
        profile.step(kLaunches);
        if (comm != 0 && join) {
            check(d.record(reinterpret_cast<void*>(exit_event), stream), "cuEventRecord");
            check(d.wait(reinterpret_cast<void*>(compute), reinterpret_cast<void*>(exit_event), 0), "cuStreamWaitEvent");
        }
        if (record_on_comm) {
            const auto on_comm = c10::Stream::unpack3(comm_id, device_.index(), device_.type());
            for (size_t i = 0; i < n; ++i) {
                if (outputs_[i].within < 0)  // a part's storage is its whole's
                    outputs[i].record_stream(on_comm);
            }
            for (size_t i = 0; i < inputs.size(); ++i) {
                PyObject* obj = PyTuple_GET_ITEM(inputs.ptr(), i);
                if (is_tensor(obj))
                    THPVariable_Unpack(obj).record_stream(on_comm);
            }
        }
        profile.step(kStreams);
        py::tuple result(num_returned_);
        for (size_t i = 0, r = 0; i < outputs.size(); ++i) {
            if (outputs_[i].returned)
                result[r++] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outputs[i])));
        }
        profile.step(kResult);
        profile.done();
        return result;
    }

private:
    c10::Device device_;
    c10::Allocator* allocator_;
    c10::DispatchKeySet keys_;
    const c10::impl::DeviceGuardImplInterface* guard_;
    std::vector<Output> outputs_;
    int64_t num_returned_ = 0;
    std::vector<Launch> launches_;
    std::shared_ptr<OutputArena> arena_;
};

// NOTE [fast calls]: the C++ half of a Buffer's fast paths (NOTE [fast paths] in backends/cuda/fast_paths.py),
// one per CUDA backend. It keeps the recorded calls by signature (NOTE [call signatures]), the order of the
// Buffer's streams (NOTE [joined stream] in buffer.py), the dispatches' tickets, the turns of the low-latency
// buffer's halves and the count of fast calls, so a call whose shape was seen before crosses from Python once:
// the lookup, the checks that decide whether a fast path may run (the current device, a readable
// `previous_event`, no failure recorded), the stream choice and the plan's run. A stream handle of -1 is none:
// 0 is the legacy default stream.
class Calls {
public:
    Calls(c10::Device device, int64_t host_record, py::object check_failures)
        : device_(device),
          guard_(c10::impl::getDeviceGuardImpl(device.type())),
          host_record_(reinterpret_cast<const volatile int32_t*>(host_record)),
          check_failures_(std::move(check_failures)) {}

    // The Buffer's comm stream (its raw handle and PyTorch's id) and two events for crossing to it and back.
    void set_streams(int64_t comm, int64_t comm_id, int64_t enter_event, int64_t exit_event) {
        comm_ = comm;
        comm_id_ = comm_id;
        enter_event_ = enter_event;
        exit_event_ = exit_event;
    }

    // Records a call: `extra` comes back with each run's outputs; `scalars` are the run's per-call values, the
    // first replaced by a new ticket where `ticketed`; a run needs a handle whose rounds fit `round_tokens`.
    // `scalars_by_half` (a low-latency dispatch): a set for each half of the low-latency buffer, the run taking
    // the next half (`next_low_latency_half`) on the caller's stream, outside the Buffer's stream order.
    bool learn(const py::tuple& key_items, py::object plan, py::object extra, std::vector<int64_t> scalars,
               bool ticketed, int64_t round_tokens, std::vector<std::vector<int64_t>> scalars_by_half) {
        std::string key;
        if (!signature_of(key_items, key))
            return false;  // an argument without a signature: always the full path
        if (!scalars_by_half.empty() && scalars_by_half.size() != 2)
            throw std::invalid_argument("tokenyard: a low-latency call has a set of scalars for each of two halves");
        Plan* native = plan.cast<Plan*>();
        entries_[std::move(key)] = {std::move(plan), native, std::move(extra), std::move(scalars), ticketed,
                                    round_tokens, std::move(scalars_by_half)};
        return true;
    }

    // Forgets every recorded call (their scalars went stale: the low-latency trace started).
    void forget() { entries_.clear(); }

    // A recorded call's run, on the stream NOTE [joined stream] picks for it: -> (extra, outputs, the half of
    // a low-latency dispatch or 0), or None where the full path must run (nothing recorded, rounds that do not
    // fit, not `ready`, an unreadable `previous_event`). `compute`: the caller's current stream on the Buffer's
    // device.
    py::object run(const py::tuple& key_items, const py::tuple& inputs, int64_t compute, py::handle previous_event,
                   bool async_finish, int64_t max_round_tokens) {
        Entry* found = find(key_items);
        if (found == nullptr || found->round_tokens < max_round_tokens)
            return py::none();
        int64_t waited = 0;
        if (!previous_event.is_none() && !read_event(previous_event, waited))
            return py::none();
        if (!ready())
            return py::none();
        Entry& entry = *found;
        if (!entry.scalars_by_half.empty()) {
            const int64_t half = next_low_latency_half();
            py::tuple outputs = entry.native->run(inputs, entry.scalars_by_half[half], compute, 0, 0, 0, 0, false,
                                                  false, 0);
            return py::make_tuple(entry.extra, std::move(outputs), half);
        }
        if (entry.ticketed)
            entry.scalars.at(0) = next_ticket();  // the entry's own copy: runs hold the GIL, one at a time
        py::tuple outputs = launch(*entry.native, inputs, entry.scalars, compute, waited, async_finish, true);
        return py::make_tuple(entry.extra, std::move(outputs), 0);
    }

    // NOTE [fresh calls]: a fresh dispatch with the CPU wait runs two plans, the count exchange and then, once the
    // host has read the counts, the transfer. Its record is found by `take`; `run_first` runs the first plan on
    // the stream `run` would pick, with the caller's `scalars`, and leaves the call open there; `finish` runs the
    // second plan after it and leaves the streams as `run` does (`finish_counted` once it read the counts itself,
    // NOTE [counted finish]); `abandon` only joins them (the host's wait raised in between). -> the first plan's
    // outputs, or None where `previous_event` cannot be read (the full path runs).
    py::object run_first(py::object plan, const py::tuple& inputs, const std::vector<int64_t>& scalars,
                         int64_t compute, py::handle previous_event, bool async_finish) {
        int64_t waited = 0;
        if (!previous_event.is_none() && !read_event(previous_event, waited))
            return py::none();
        py::tuple outputs = launch(*plan.cast<Plan*>(), inputs, scalars, compute, waited, async_finish, false);
        open_compute_ = compute;
        return std::move(outputs);
    }

    py::tuple finish(py::object plan, const py::tuple& inputs, const std::vector<int64_t>& scalars,
                     bool async_finish) {
        const int64_t compute = open_compute_;
        open_compute_ = -1;
        Plan& second = *plan.cast<Plan*>();
        if (!open_on_comm_)
            return second.run(inputs, scalars, compute, 0, 0, 0, 0, false, false, 0);
        // After the first plan's launches on the comm stream, with no wait: one for `compute` would hold the
        // transfer behind whatever the caller queued there before the call (what `previous_event` frees it from).
        py::tuple outputs = second.run(inputs, scalars, compute, comm_, -1, enter_event_, exit_event_, !async_finish,
                                       async_finish, comm_id_);
        joined_ = async_finish ? -1 : compute;
        return outputs;
    }

    // NOTE [counted finish]: `finish` as soon as the host has the counts of call `ticket`, with no Python between
    // their arrival and the second plan's launch: back to back, the GPU idles from the count exchange's end to
    // that launch (benchmarks/results/host_cost.md). The host waits for host_counts[0] == ticket (the notify
    // kernel writes it last, NOTE [notify]) without the GIL, polling as waiting.wait_until does (for `poll_s`
    // without a pause, then with pauses of `sleep_s`), up to `timeout_s`; `reads` (a run's scalar slot, an index
    // of host_counts) set the run's scalars from the counts. -> the second plan's outputs, or None with the call
    // still open where the counts did not come clean (a failure recorded, the input verdict, the deadline): the
    // host's own wait (counts_arrived) then says which.
    void set_host_counts(int64_t host_counts, int64_t verdict_at, double poll_s, double sleep_s) {
        host_counts_ = reinterpret_cast<const volatile int32_t*>(host_counts);
        verdict_at_ = verdict_at;
        poll_ = std::chrono::duration<double>(poll_s);
        sleep_ = std::chrono::duration<double>(sleep_s);
    }

    py::object finish_counted(py::object plan, const py::tuple& inputs, std::vector<int64_t> scalars,
                              bool async_finish, int64_t ticket, double timeout_s,
                              const std::vector<std::pair<int64_t, int64_t>>& reads) {
        if (host_counts_ == nullptr || !counts_came(static_cast<uint32_t>(ticket), timeout_s))
            return py::none();
        for (const auto& [slot, at] : reads)
            scalars.at(slot) = host_counts_[at];
        return finish(std::move(plan), inputs, scalars, async_finish);
    }

    void abandon() {
        const int64_t compute = open_compute_;
        open_compute_ = -1;
        if (compute < 0 || !open_on_comm_)
            return;
        const Driver& d = driver();
        void* event = reinterpret_cast<void*>(exit_event_);
        check(d.record(event, reinterpret_cast<void*>(comm_)), "cuEventRecord");
        check(d.wait(reinterpret_cast<void*>(compute), event, 0), "cuStreamWaitEvent");
        joined_ = compute;
    }

    // A recorded call that Python runs itself (the low-latency combine, a fresh dispatch): its `extra` where it
    // may run now (`ready`), else None.
    py::object take(const py::tuple& key_items) {
        Entry* found = find(key_items);
        if (found == nullptr || !ready())
            return py::none();
        return found->extra;
    }

    // Whether a fast path may run now (counted in `hits`): the Buffer's device is the current one and no kernel
    // recorded a failure (where one did, the full path raises it).
    bool ready() {
        if (host_record_[0] != 0) {
            py::object method = check_failures_();  // a weak method: the backend, if it still lives, raises
            if (!method.is_none())
                method();
            return false;
        }
        if (!device_.is_cpu() && guard_->getDevice() != device_)
            return false;
        ++hits_;
        return true;
    }

    int64_t next_ticket() {
        tickets_ = (tickets_ + 1) & 0xffffffffLL;
        return tickets_;
    }

    // The half of the low-latency buffer the next dispatch uses; they alternate, from half 1 after a reset
    // (LowLatencyKernels.clean, which every rank makes together).
    int64_t next_low_latency_half() {
        low_latency_calls_ = (low_latency_calls_ + 1) & 0xffffffffLL;
        return low_latency_calls_ % 2;
    }
    int64_t latest_low_latency_half() const { return low_latency_calls_ % 2; }
    void reset_low_latency_halves() { low_latency_calls_ = 0; }

    // NOTE [joined stream]: whether a call on `compute` runs its kernels there (noted in `ran_on` when it does).
    bool runs_straight(int64_t compute, bool waits_for_event, bool async_finish) {
        if (async_finish || waits_for_event || joined_ != compute)
            return false;
        ran_on_ = compute;
        return true;
    }

    // Before work goes to the comm stream: the stream it must wait for first (-1: none), the one that ran kernels
    // straight, unless the work waits for `compute` anyway and that was the stream.
    int64_t catch_up(int64_t compute, bool waits_for_compute) {
        const int64_t ran_on = ran_on_;
        ran_on_ = -1;
        return ran_on < 0 || (waits_for_compute && ran_on == compute) ? -1 : ran_on;
    }

    void set_joined(int64_t compute) { joined_ = compute; }
    int64_t ran_on() const { return ran_on_; }
    int64_t hits() const { return hits_; }

private:
    // A plan's run on the stream NOTE [joined stream] picks; `close`: the streams left as the call's end leaves them
    // (else the call stays open on that stream, `open_on_comm_`, for `finish`).
    py::tuple launch(Plan& plan, const py::tuple& inputs, const std::vector<int64_t>& scalars, int64_t compute,
                     int64_t waited, bool async_finish, bool close) {
        if (runs_straight(compute, waited != 0, async_finish)) {
            open_on_comm_ = false;
            return plan.run(inputs, scalars, compute, 0, 0, 0, 0, false, false, 0);
        }
        const int64_t behind = catch_up(compute, waited == 0);
        if (behind >= 0) {
            const Driver& d = driver();
            void* event = reinterpret_cast<void*>(enter_event_);  // a wait takes the event's state when made
            check(d.record(event, reinterpret_cast<void*>(behind)), "cuEventRecord");
            check(d.wait(reinterpret_cast<void*>(comm_), event, 0), "cuStreamWaitEvent");
        }
        open_on_comm_ = true;
        py::tuple outputs = plan.run(inputs, scalars, compute, comm_, waited, enter_event_, exit_event_,
                                     close && !async_finish, async_finish, comm_id_);
        if (close)
            joined_ = async_finish ? -1 : compute;
        return outputs;
    }

    // NOTE [counted finish]: whether call `ticket`'s counts came with no verdict and no failure recorded.
    bool counts_came(uint32_t ticket, double timeout_s) {
        py::gil_scoped_release released;
        const auto start = std::chrono::steady_clock::now();
        const auto deadline = start + std::chrono::duration<double>(timeout_s), pauses_from = start + poll_;
        while (true) {
            if (host_record_[0] != 0)
                return false;
            if (static_cast<uint32_t>(host_counts_[0]) == ticket) {
                std::atomic_thread_fence(std::memory_order_acquire);  // the counts after their ticket
                return host_counts_[verdict_at_] == 0;
            }
            const auto now = std::chrono::steady_clock::now();
            if (now > pauses_from) {
                if (now > deadline)
                    return false;
                std::this_thread::sleep_for(sleep_);
            }
        }
    }

    struct Entry {
        py::object plan;  // holds `native`
        Plan* native;
        py::object extra;
        std::vector<int64_t> scalars;
        bool ticketed;
        int64_t round_tokens;
        std::vector<std::vector<int64_t>> scalars_by_half;
    };

    static bool signature_of(const py::tuple& items, std::string& out) {
        out.reserve(512);
        return append_signature(out, items.ptr());
    }

    // The recorded call of this signature, or nullptr (nothing recorded, or an argument without a signature).
    Entry* find(const py::tuple& key_items) {
        std::string key;
        if (!signature_of(key_items, key))
            return nullptr;
        const auto found = entries_.find(key);
        return found == entries_.end() ? nullptr : &found->second;
    }

    // A DeepEP-style `previous_event` (EventOverlap -> EventHandle -> torch.cuda.Event): its CUDA event, 0 if
    // never recorded; false where there is none to read.
    static bool read_event(py::handle previous_event, int64_t& event) {
        py::object handle = previous_event.attr("event");
        if (handle.is_none())
            return false;
        py::object cuda_event = handle.attr("event");
        if (cuda_event.is_none() || !py::hasattr(cuda_event, "cuda_event"))
            return false;
        event = cuda_event.attr("cuda_event").cast<int64_t>();
        return true;
    }

    c10::Device device_;
    const c10::impl::DeviceGuardImplInterface* guard_;
    const volatile int32_t* host_record_;  // the kernels' failure record, host-mapped
    const volatile int32_t* host_counts_ = nullptr;  // NOTE [counted finish]: the notify kernel's, host-mapped
    int64_t verdict_at_ = 0;
    std::chrono::duration<double> poll_{0}, sleep_{0};
    py::object check_failures_;
    int64_t comm_ = 0, comm_id_ = 0, enter_event_ = 0, exit_event_ = 0;
    int64_t joined_ = -1, ran_on_ = -1;
    int64_t open_compute_ = -1;  // NOTE [fresh calls]: the caller's stream of the open call, else -1
    bool open_on_comm_ = false;
    int64_t tickets_ = 0, hits_ = 0, low_latency_calls_ = 0;
    std::unordered_map<std::string, Entry> entries_;
};

}  // namespace tokenyard::host

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using tokenyard::host::Calls;
    using tokenyard::host::Plan;
    m.def("set_driver", &tokenyard::host::set_driver);
    m.def("signature", &tokenyard::host::signature);
    m.def("set_profiling", &tokenyard::host::set_profiling);
    m.def("take_profile", &tokenyard::host::take_profile);
    using tokenyard::host::OutputArena;
    py::class_<OutputArena, std::shared_ptr<OutputArena>>(m, "OutputArena")
        .def(py::init<c10::Device, int64_t, int64_t, int64_t>())
        .def("free_bytes", &OutputArena::free_bytes);
    py::class_<Plan>(m, "Plan")
        .def(py::init<c10::Device>())
        .def("set_arena", &Plan::set_arena)
        .def("add_output", &Plan::add_output)
        .def("add_launch", &Plan::add_launch)
        .def("num_outputs", &Plan::num_outputs)
        .def("run", &Plan::run);
    py::class_<Calls>(m, "Calls")
        .def(py::init<c10::Device, int64_t, py::object>())
        .def("set_streams", &Calls::set_streams)
        .def("learn", &Calls::learn)
        .def("run", &Calls::run)
        .def("run_first", &Calls::run_first)
        .def("finish", &Calls::finish)
        .def("abandon", &Calls::abandon)
        .def("set_host_counts", &Calls::set_host_counts)
        .def("finish_counted", &Calls::finish_counted)
        .def("take", &Calls::take)
        .def("forget", &Calls::forget)
        .def("next_ticket", &Calls::next_ticket)
        .def("next_low_latency_half", &Calls::next_low_latency_half)
        .def("latest_low_latency_half", &Calls::latest_low_latency_half)
        .def("reset_low_latency_halves", &Calls::reset_low_latency_halves)
        .def("runs_straight", &Calls::runs_straight)
        .def("catch_up", &Calls::catch_up)
        .def("set_joined", &Calls::set_joined)
        .def_property_readonly("ran_on", &Calls::ran_on)
        .def_property_readonly("hits", &Calls::hits);
}
