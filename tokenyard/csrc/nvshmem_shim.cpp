// The NVSHMEM host calls tokenyard makes, as plain C functions for ctypes (NOTE [NVSHMEM host shim] in
// tokenyard/jit/nvshmem.py). Every function returns NVSHMEM's status (0 = success) or the value asked for.
#include <cuda.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

extern "C" {

int tokenyard_nvshmem_uid_bytes() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

int tokenyard_nvshmem_uid(void* out) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    const int status = nvshmemx_get_uniqueid(&id);
    std::memcpy(out, &id, sizeof(id));
    return status;
}

// The unique-id bootstrap: every rank passes rank 0's id. nvshmemx_init_attr is inline in the headers and
// needs libnvshmem.a, which the wheel lacks; this is its body against the shared host library.
int tokenyard_nvshmem_init(int rank, int num_ranks, const void* uid) {
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, uid, sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    const int status = nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr);
    if (status != 0)
        return status;
    nvshmemx_init_init_attr_ver_only(attr);
    return nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
}

int tokenyard_nvshmem_my_pe() { return nvshmem_my_pe(); }

int tokenyard_nvshmem_n_pes() { return nvshmem_n_pes(); }

int tokenyard_nvshmem_version(int* major, int* minor) {
    nvshmem_info_get_version(major, minor);
    return 0;
}

// Symmetric memory, zeroed: every PE must make the same calls in the same order.
void* tokenyard_nvshmem_calloc(size_t bytes) { return nvshmem_calloc(bytes, 1); }

void tokenyard_nvshmem_free(void* ptr) { nvshmem_free(ptr); }

// The address of `ptr` on `pe` where this GPU can load and store it directly (NVLink, or the same GPU),
// else null.
void* tokenyard_nvshmem_ptr(void* ptr, int pe) { return nvshmem_ptr(ptr, pe); }

void tokenyard_nvshmem_barrier_all() { nvshmem_barrier_all(); }

int tokenyard_nvshmem_cumodule_init(void* module) { return nvshmemx_cumodule_init(static_cast<CUmodule>(module)); }

int tokenyard_nvshmem_cumodule_finalize(void* module) {
    return nvshmemx_cumodule_finalize(static_cast<CUmodule>(module));
}

void tokenyard_nvshmem_finalize() { nvshmemx_hostlib_finalize(); }

}  // extern "C"
