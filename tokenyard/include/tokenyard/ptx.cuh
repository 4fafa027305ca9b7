// Memory-ordering primitives in inline PTX. The scope (.gpu or .sys) and the order (relaxed, acquire,
// release) are part of every name, so a reader sees what each cross-GPU access promises.
#pragma once

#include "types.cuh"

namespace tokenyard::ptx {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* ptr) {
    uint32_t value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* ptr) {
    uint32_t value;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ int ld_relaxed_sys(const int* ptr) {
    int value;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_release_sys(uint32_t* ptr, uint32_t value) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int* ptr, int value) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* ptr, uint32_t value) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* ptr, uint64_t value) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_gpu(uint32_t* ptr, uint32_t value) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t atomic_add_release_sys(uint32_t* ptr, uint32_t value) {
    uint32_t old;
    asm volatile("atom.add.release.sys.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

__device__ __forceinline__ int atomic_cas_relaxed_sys(int* ptr, int expected, int desired) {
    int old;
    asm volatile("atom.cas.relaxed.sys.global.b32 %0, [%1], %2, %3;"
                 : "=r"(old) : "l"(ptr), "r"(expected), "r"(desired) : "memory");
    return old;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ uint32_t atomic_add_acq_rel_gpu(uint32_t* ptr, uint32_t value) {
    uint32_t old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

// atom.inc wraps: the word becomes 0 where it was >= limit, else it grows by one; -> its value before.
__device__ __forceinline__ uint32_t atomic_inc_acq_rel_gpu(uint32_t* ptr, uint32_t limit) {
    uint32_t old;
    asm volatile("atom.inc.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(limit) : "memory");
    return old;
}

__device__ __forceinline__ int ld_relaxed_gpu(const int* ptr) {
    int value;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Nanoseconds from the GPU's global timer (coarse, but monotonic and the same on every SM).
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

// 16-byte accesses. Rows are 16-byte aligned by construction (workspace.py pads every part).
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// For data other GPUs wrote into this GPU's buffer during this kernel: read through L2, never L1.
__device__ __forceinline__ int4 ld_na_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ float ld_na_f32(const float* ptr) {
    float value;
    asm volatile("ld.global.L1::no_allocate.f32 %0, [%1];" : "=f"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ int ld_na_s32(const int* ptr) {
    int v;
    asm volatile("ld.global.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_na_v4(int4* ptr, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

}  // namespace tokenyard::ptx
