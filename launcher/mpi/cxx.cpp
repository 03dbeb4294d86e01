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
// and its progress thread); here the backend's operations and the module.

#include "cxx_queue.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace {

int64_t g_slice_bytes = 4 << 20;  // all_reduce works through larger buffers in slices

// -- the backend ------------------------------------------------------------------------------

class MpiBackend : public c10d::Backend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout,
             std::chrono::microseconds spin, py::function overdue)
      : Backend(rank, size), comm_(comm), timeout_(timeout), spin_(spin),
        overdue_(shareOverdue(std::move(overdue))),
        queue_(" on a group of " + std::to_string(size) + " ranks", spin, overdue_) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }

  ~MpiBackend() override { queue_.stop(); }

  const std::string getBackendName() const override { return kName; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  void shutdown() override {
    queue_.stop();
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  // -- reductions ---------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    Op op = newOp("all_reduce", tensors, opts.timeout);
    for (const auto& t : tensors) addAllreduce(op, t, opts.reduceOp);
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::ALLREDUCE);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return allreduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const int root = static_cast<int>(opts.rootRank);
    Op op = newOp("reduce to root rank " + std::to_string(root), tensors, opts.timeout);
    const bool atRoot = rank_ == root;
    for (const auto& t : tensors) {
      Reduction r = reduction(t.scalar_type(), opts.reduceOp);
      Tensor buf = prepared(t, r, !atRoot);
      const int n = count(buf.numel(), "reduce");
      const auto dt = datatype(buf.scalar_type());
      if (n) {
        op.stages.push_back([=, this](MPI_Request* q) {
          void* p = buf.data_ptr();
          return MPI_Ireduce(atRoot ? MPI_IN_PLACE : p, atRoot ? p : nullptr, n, dt, r.op, root,
                             comm_, q);
        });
      }
      if (atRoot) chain(op, [=, this] { averaged(buf, r); writeBack(t, buf); });
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::REDUCE);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<Tensor>& outputs, std::vector<std::vector<Tensor>>& inputLists,
      const c10d::ReduceScatterOptions& opts) override {
    Op op = newOp("reduce_scatter", outputs, opts.timeout);
    TORCH_CHECK(outputs.size() == inputLists.size(), kName, ": reduce_scatter needs one list "
                "of inputs per output");
    for (size_t i = 0; i < outputs.size(); ++i) {
      Reduction r = reduction(outputs[i].scalar_type(), opts.reduceOp);
      Tensor in = flat(inputLists[i], r.compute);
      premultiply(in, r);
      addReduceScatter(op, outputs[i], in, r);
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::REDUCE_SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      Tensor& output, Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<Tensor> outputs{output}, inputs{input};
    return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<Tensor>& outputs, std::vector<Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    Op op = newOp("reduce_scatter", outputs, opts.timeout);
    for (size_t i = 0; i < outputs.size(); ++i) {
      Reduction r = reduction(outputs[i].scalar_type(), opts.reduceOp);
      addReduceScatter(op, outputs[i], prepared(inputs[i], r, true), r);
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  // -- data movement ------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const int root = static_cast<int>(opts.rootRank);
    Op op = newOp("broadcast from root rank " + std::to_string(root), tensors, opts.timeout);
    for (const auto& t : tensors) {
      Tensor buf = addressable(t);
      const int n = count(buf.numel(), "broadcast");
      const auto dt = datatype(buf.scalar_type());
      if (n) {
        op.stages.push_back([=, this](MPI_Request* q) {
          return MPI_Ibcast(buf.data_ptr(), n, dt, root, comm_, q);
        });
      }
      if (rank_ != root) chain(op, [=] { writeBack(t, buf); });
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::BROADCAST);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<Tensor>>& outputLists,
                                           std::vector<Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    Op op = newOp("all_gather", flatten(outputLists), opts.timeout);
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor buf = addressable(inputs[i]);
      Tensor all = at::empty({buf.numel() * size_}, buf.options());
      const int n = count(buf.numel(), "all_gather");
      const auto dt = datatype(buf.scalar_type());
      if (n) {
        op.stages.push_back([=, this](MPI_Request* q) {
          return MPI_Iallgather(buf.data_ptr(), n, dt, all.data_ptr(), n, dt, comm_, q);
        });
      }
      auto outputs = outputLists[i];
      chain(op, [=] { unflat(all, outputs); });
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::ALLGATHER);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<Tensor>>& outputLists, std::vector<Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return allgather(outputLists, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(Tensor& output, Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    std::vector<Tensor> outputs{output}, inputs{input};
    return allgather_into_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<Tensor>& outputs, std::vector<Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    Op op = newOp("all_gather_into_tensor", outputs, opts.timeout);
    for (size_t i = 0; i < outputs.size(); ++i) {
      Tensor out = addressable(outputs[i]);
      Tensor buf = addressable(inputs[i]);
      const int n = count(buf.numel(), "all_gather_into_tensor");
      const auto dt = datatype(buf.scalar_type());
      // FSDP gathers in place: the input is this rank's block of the output
      const bool inPlace = reinterpret_cast<char*>(buf.data_ptr()) ==
                           reinterpret_cast<char*>(out.data_ptr()) + rank_ * buf.nbytes();
      if (n) {
        op.stages.push_back([=, this](MPI_Request* q) {
          return MPI_Iallgather(inPlace ? MPI_IN_PLACE : buf.data_ptr(), n, dt, out.data_ptr(),
                                n, dt, comm_, q);
        });
      }
      Tensor target = outputs[i];
      chain(op, [=] { writeBack(target, out); });
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::_ALLGATHER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<Tensor>>& outputLists,
                                        std::vector<Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const int root = static_cast<int>(opts.rootRank);
    const bool atRoot = rank_ == root;
    Op op = newOp("gather to root rank " + std::to_string(root), flatten(outputLists),
                  opts.timeout);
    Tensor buf = addressable(inputs.at(0));
    Tensor all = at::empty({atRoot ? buf.numel() * size_ : 0}, buf.options());
    const int n = count(buf.numel(), "gather");
    const auto dt = datatype(buf.scalar_type());
    if (n) {
      op.stages.push_back([=, this](MPI_Request* q) {
        return MPI_Igather(buf.data_ptr(), n, dt, atRoot ? all.data_ptr() : nullptr, n, dt,
                           root, comm_, q);
      });
    }
    if (atRoot) {
      auto outputs = outputLists.at(0);
      chain(op, [=] { unflat(all, outputs); });
    }
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<Tensor>& outputs,
                                         std::vector<std::vector<Tensor>>& inputLists,
                                         const c10d::ScatterOptions& opts) override {
    const int root = static_cast<int>(opts.rootRank);
    const bool atRoot = rank_ == root;
    Op op = newOp("scatter from root rank " + std::to_string(root), outputs, opts.timeout);
    Tensor out = addressable(outputs.at(0));
    Tensor all = atRoot ? flat(inputLists.at(0), out.scalar_type()) : Tensor();
    const int n = count(out.numel(), "scatter");
    const auto dt = datatype(out.scalar_type());
    if (n) {
      op.stages.push_back([=, this](MPI_Request* q) {
        return MPI_Iscatter(atRoot ? all.data_ptr() : nullptr, n, dt, out.data_ptr(), n, dt,
                            root, comm_, q);
      });
    }
    Tensor target = outputs[0];
    chain(op, [=] { writeBack(target, out); });
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::SCATTER);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(Tensor& output, Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override {
    Op op = newOp("all_to_all", {output}, opts.timeout);
    Tensor out = addressable(output), in = addressable(input);
    addAlltoallv(op, out, counts(out, outputSplits), in, counts(in, inputSplits));
    Tensor target = output;
    chain(op, [=] { writeBack(target, out); });
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::ALLTOALL_BASE);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<Tensor>& outputs,
                                          std::vector<Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    Op op = newOp("all_to_all", outputs, opts.timeout);
    const auto dtype = outputs.at(0).scalar_type();
    std::vector<int> recvCounts, sendCounts;
    int64_t total = 0;
    for (const auto& t : outputs) {
      recvCounts.push_back(count(t.numel(), "all_to_all"));
      total += t.numel();
    }
    for (const auto& t : inputs) sendCounts.push_back(count(t.numel(), "all_to_all"));
    Tensor out = at::empty({total}, outputs[0].options().device(at::kCPU));
    addAlltoallv(op, out, recvCounts, flat(inputs, dtype), sendCounts);
    auto targets = outputs;
    chain(op, [=] { unflat(out, targets); });
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::ALLTOALL);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    Op op = newOp("barrier", {}, opts.timeout);
    op.stages.push_back([this](MPI_Request* q) { return MPI_Ibarrier(comm_, q); });
    return queue_.submit(std::move(op), opts.asyncOp, c10d::OpType::BARRIER);
  }

  // -- point to point -----------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> send(std::vector<Tensor>& tensors, int dst, int tag) override {
    Tensor buf = addressable(tensors.at(0));
    MPI_Request q;
    check(MPI_Isend(buf.data_ptr(), count(buf.numel(), "send"), datatype(buf.scalar_type()),
                    dst, tag, comm_, &q), "send");
    return p2p(q, buf, std::nullopt, "send to rank " + std::to_string(dst), c10d::OpType::SEND);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<Tensor>& tensors, int src, int tag) override {
    return irecv(tensors.at(0), src, tag, "recv from rank " + std::to_string(src),
                 c10d::OpType::RECV);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<Tensor>& tensors, int tag) override {
    return irecv(tensors.at(0), MPI_ANY_SOURCE, tag, "recv from any rank",
                 c10d::OpType::RECVANYSOURCE);
  }

 private:
  // -- building ops -------------------------------------------------------------------------

  Op newOp(std::string name, std::vector<Tensor> outputs, std::chrono::milliseconds timeout) {
    Op op;
    op.name = std::move(name);
    op.outputs = std::move(outputs);
    op.timeout = timeout == c10d::kUnsetTimeout ? timeout_ : timeout;
    return op;
  }

  static std::vector<Tensor> flatten(const std::vector<std::vector<Tensor>>& lists) {
    std::vector<Tensor> all;
    for (const auto& l : lists) all.insert(all.end(), l.begin(), l.end());
    return all;
  }

  static void chain(Op& op, std::function<void()> next) {
    if (!op.finish) {
      op.finish = std::move(next);
      return;
    }
    op.finish = [first = std::move(op.finish), next = std::move(next)] { first(); next(); };
  }

  // ``t`` in the compute dtype, premultiplied for PREMUL_SUM; ``copy``: never ``t`` itself
  // when premultiplying (a reduce's non-root input, a reduce_scatter's input stay unchanged).
  Tensor prepared(const Tensor& t, const Reduction& r, bool copy) {
    Tensor buf = addressable(t, r.compute);
    if ((r.premul || r.premulTensor) && copy && buf.is_same(t)) buf = buf.clone();
    at::NoGradGuard noGrad;
    premultiply(buf, r);
    return buf;
  }

  void averaged(const Tensor& buf, const Reduction& r) {
    if (r.average) buf.div_(size_);
  }

  void addAllreduce(Op& op, const Tensor& t, const ReduceOp& rop) {
    Reduction r = reduction(t.scalar_type(), rop);
    Tensor buf = prepared(t, r, false);
    const auto dt = datatype(buf.scalar_type());
    const int64_t total = buf.numel();
    const int64_t step = std::max<int64_t>(1, g_slice_bytes / buf.element_size());
    char* base = static_cast<char*>(buf.data_ptr());
    for (int64_t start = 0; start < total; start += step) {
      const int n = count(std::min(step, total - start), "all_reduce");
      char* p = base + start * buf.element_size();
      op.stages.push_back([=, this](MPI_Request* q) {
        (void)buf;  // keeps the buffer alive as long as the stage
        return MPI_Iallreduce(MPI_IN_PLACE, p, n, dt, r.op, comm_, q);
      });
    }
    chain(op, [=, this] { averaged(buf, r); writeBack(t, buf); });
  }

  void addReduceScatter(Op& op, const Tensor& output, const Tensor& in, const Reduction& r) {
    Tensor out = addressable(output, r.compute);
    const int n = count(out.numel(), "reduce_scatter");
    const auto dt = datatype(out.scalar_type());
    if (n) {
      op.stages.push_back([=, this](MPI_Request* q) {
        return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), n, dt, r.op, comm_, q);
      });
    }
    chain(op, [=, this] { averaged(out, r); writeBack(output, out); });
  }

  std::vector<int> counts(const Tensor& t, const std::vector<int64_t>& splits) {
    std::vector<int> c(size_);
    if (splits.empty()) {
      std::fill(c.begin(), c.end(), count(t.numel() / size_, "all_to_all"));
    } else {
      const int64_t row = t.dim() && t.size(0) ? t[0].numel() : 0;
      for (int i = 0; i < size_; ++i) c[i] = count(splits.at(i) * row, "all_to_all");
    }
    return c;
  }

  void addAlltoallv(Op& op, const Tensor& out, std::vector<int> recvCounts, const Tensor& in,
                    std::vector<int> sendCounts) {
    std::vector<int> sendDispls(size_, 0), recvDispls(size_, 0);
    for (int i = 1; i < size_; ++i) {
      sendDispls[i] = sendDispls[i - 1] + sendCounts[i - 1];
      recvDispls[i] = recvDispls[i - 1] + recvCounts[i - 1];
    }
    const auto dt = datatype(out.scalar_type());
    // MPI reads the count arrays until the op completes: the stage owns them
    auto arrays = std::make_shared<std::vector<std::vector<int>>>(
        std::vector<std::vector<int>>{sendCounts, sendDispls, recvCounts, recvDispls});
    op.stages.push_back([=, this](MPI_Request* q) {
      auto& a = *arrays;
      return MPI_Ialltoallv(in.data_ptr(), a[0].data(), a[1].data(), dt, out.data_ptr(),
                            a[2].data(), a[3].data(), dt, comm_, q);
    });
  }

  c10::intrusive_ptr<c10d::Work> irecv(const Tensor& t, int src, int tag, std::string what,
                                       c10d::OpType type) {
    Tensor buf = addressable(t);
    MPI_Request q;
    check(MPI_Irecv(buf.data_ptr(), count(buf.numel(), "recv"), datatype(buf.scalar_type()),
                    src, tag, comm_, &q), what);
    return p2p(q, buf, t, std::move(what), type);
  }

  c10::intrusive_ptr<c10d::Work> p2p(MPI_Request q, Tensor buf, std::optional<Tensor> target,
                                     std::string what, c10d::OpType type) {
    return c10::make_intrusive<P2PWork>(q, std::move(buf), std::move(target), std::move(what),
                                        timeout_, spin_, overdue_, type);
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  Overdue overdue_;
  OpQueue queue_;
};

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
