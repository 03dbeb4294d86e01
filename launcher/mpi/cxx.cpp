// The mpi backend as compiled code: a c10d::Backend on an MPI communicator that Python made
// (launcher/mpi/cxx.py builds, loads and registers it; launcher/mpi/backend.py makes the
// communicator and checks the world and the transport, as for its own Python backend).
//
// Collectives go into a FIFO per group and a progress thread starts them, non-blocking, one
// after another (every rank then starts them in the same order, as MPI requires;
// cxx_queue.h) and completes their futures, so DDP's buckets are reduced while backward goes
// on. A synchronous call (async_op=False) on an idle group runs in the calling thread instead:
// no thread hand-off for the latency-bound small messages. Point-to-point ops start in the
// calling thread and are driven by Work::wait. Completion is found with MPI_Test; the GIL is
// never held while MPI works (torch's bindings release it; only the timeout callback takes it).
//
// Past the group's timeout the Python callback decides (launcher.faults.heartbeat.overdue): it
// raises PeerLost naming the silent ranks, or returns while every peer still beats, and the
// wait goes on. A raised error fails the op, and every op after it on this group, with that
// exception.
//
// The parts, each included once into this translation unit: cxx_types.h (errors, dtypes and
// reductions, tensors as MPI buffers), cxx_work.h (ops, works, polling), cxx_queue.h (the FIFO
// and its progress thread), cxx_build.h (tensors into ops), cxx_backend.h (the backend's
// operations); here the module.

#include "cxx_backend.h"

namespace {

// ``handle``: mpi4py's ``Comm.handle``, MPICH's int handle as an unsigned 64-bit number
c10::intrusive_ptr<c10d::Backend> create(uint64_t handle, int rank, int size, double timeoutS,
                                         double spinS, py::function overdue) {
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(std::llround(timeoutS * 1000)));
  const auto spin = std::chrono::microseconds(static_cast<int64_t>(std::llround(spinS * 1e6)));
  const auto comm = static_cast<MPI_Comm>(static_cast<uint32_t>(handle));
  return c10::make_intrusive<MpiBackend>(comm, rank, size, timeout, spin, std::move(overdue));
}

// The library this module runs on, as MPI names it: launcher/mpi/cxx.py compares it with
// mpi4py's, so that the two never run on different libraries.
std::string libraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  return std::string(text, len);
}

// Whether MPIX_C_FLOAT16/MPIX_BFLOAT16 are types of this library (MPICH's; another MPICH-ABI
// library, e.g. Intel MPI, may not know them): then 16-bit floats are reduced natively, else in
// float32. Needs MPI initialised (mpi4py does that on import).
bool useNativeHalf(bool wanted) {
#if defined(MPIX_C_FLOAT16) && defined(MPIX_BFLOAT16)
  int a = 0, b = 0;
  g_native_half = wanted && MPI_Type_size(MPIX_C_FLOAT16, &a) == MPI_SUCCESS && a == 2 &&
                  MPI_Type_size(MPIX_BFLOAT16, &b) == MPI_SUCCESS && b == 2;
#else
  (void)wanted;
  g_native_half = false;
#endif
  return g_native_half;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("create", &create, "a backend on the MPI communicator with this handle",
        py::arg("handle"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
        py::arg("spin_s"), py::arg("overdue"));
  m.def("library_version", &libraryVersion);
  m.def("use_native_half", &useNativeHalf, py::arg("wanted"));
  m.def("set_slice_bytes", [](int64_t n) { g_slice_bytes = std::max<int64_t>(1, n); });
  m.def("slice_bytes", [] { return g_slice_bytes; });
  // the torch this module was compiled for: c10d has no stable ABI across versions
  m.attr("TORCH_VERSION") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
}
