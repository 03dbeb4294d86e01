// The UCX worker address handed to MPICH, zero-padded to the 4 KiB MPICH reads from it.
//
// MPICH 5.0.2's UCX netmod puts MPID_MAX_BC_SIZE (4,096) bytes from the address's start into
// the PMI ("FIXME: use the actual addrname_len", ch4/netmod/ucx/ucx_init.c), though UCX
// allocated only the address (~300-700 bytes): the rest is whatever the heap held after it.
// Under Slurm's pmi2 server, which reads a PMI-1 line in one read of at most 1,024 bytes, a
// segment of that garbage too varied to compress is misread ("mpi/pmi2: invalid client
// request", "value not properly terminated") and MPI_Init fails or hangs on every rank.
//
// Loaded into the global scope before libmpi (launcher/mpi/ucx_address.py), these two
// definitions come before libucp's in libmpi's lookups: the address is copied into a zeroed
// 4 KiB buffer, which MPICH's encoding shrinks to runs (a rank's PMI lines went from ~5.4 KB,
// the longest 820 bytes, to ~1.1 KB, the longest the address itself; 3 ranks, 2026-11-28).
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr size_t kPadded = 4096;  // MPID_MAX_BC_SIZE
constexpr int kKept = 64;         // one address per worker (MPICH: one per VCI)
constexpr int kNoElement = -12;   // UCS_ERR_NO_ELEM

using Get = int (*)(void*, void**, size_t*);
using Release = void (*)(void*, void*);

// MPICH asks for its addresses in MPI_Init and releases them in MPI_Finalize, each on one
// thread at a time: no lock
void* kept[kKept];
int padded = 0;

void* libucp(const char* name) {
    void* found = dlsym(RTLD_NEXT, name);
    if (found == nullptr) {  // libmpi loaded RTLD_LOCAL: libucp is not after us in the scope
        void* handle = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);
        found = handle == nullptr ? nullptr : dlsym(handle, name);
    }
    return found;
}

}  // namespace

extern "C" {

int ucp_worker_get_address(void* worker, void** address, size_t* length) {
    auto get = reinterpret_cast<Get>(libucp("ucp_worker_get_address"));
    auto release = reinterpret_cast<Release>(libucp("ucp_worker_release_address"));
    if (get == nullptr || release == nullptr) return kNoElement;
    int status = get(worker, address, length);
    if (status != 0 || *length >= kPadded) return status;
    for (void*& slot : kept) {
        if (slot != nullptr) continue;
        void* zeroed = calloc(1, kPadded);
        if (zeroed == nullptr) return status;  // unpadded, as without this file
        memcpy(zeroed, *address, *length);
        release(worker, *address);
        slot = *address = zeroed;
        ++padded;
        return status;
    }
    return status;
}

void ucp_worker_release_address(void* worker, void* address) {
    for (void*& slot : kept) {
        if (slot != nullptr && slot == address) {
            slot = nullptr;
            free(address);
            return;
        }
    }
    auto release = reinterpret_cast<Release>(libucp("ucp_worker_release_address"));
    if (release != nullptr) release(worker, address);
}

// how many addresses this process padded (the tests read it)
int ddp_ucx_addresses_padded(void) { return padded; }

}  // extern "C"
