// The low-latency kernels with ranks on other nodes, reached through the transport (NOTE [internode
// low-latency] in sync.cuh): the same device functions, given tokenyard::transport::Remote; an NVSHMEM unit.
#pragma once

#include "../transport.cuh"
#include "low_latency_combine.cuh"
#include "low_latency_dispatch.cuh"
