// The mpi backend as compiled code: a c10d::Backend on an MPI communicator that Python made
// (launcher/mpi/cxx.py builds, loads and registers it; launcher/mpi/backend.py makes the
// communicator and checks the world and the transport, as for its own Python backend).
//
// Collectives go into a FIFO per group and a progress thread starts them, non-blocking, one
// after another (every rank then starts them in the same order, as MPI requires) and completes
// their futures, so DDP's buckets are reduced while backward goes on. A synchronous call
// (async_op=False) on an idle group runs in the calling thread instead: no thread hand-off for
// the latency-bound small messages. Point-to-point ops start in the calling thread and are
// driven by Work::wait. Completion is found with MPI_Test; the GIL is never held while MPI
// works (torch's bindings release it; only the timeout callback takes it).
//
// Past the group's timeout the Python callback decides (launcher.faults.heartbeat.overdue): it raises
// PeerLost naming the silent ranks, or returns while every peer still beats, and the wait goes
// on. A raised error fails the op, and every op after it on this group, with that exception.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mpi.h>
#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

namespace py = pybind11;

namespace {

using at::Tensor;
using c10d::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr const char* kName = "mpi_cxx";
// polls of a request before each further poll gives up the CPU (MPICH spins about as long)
constexpr int kPollsBeforeYield = 50;
// a wait longer than its group's spin (waiting.spin_s: 10 ms, none where a node's ranks
// outnumber its CPUs) sleeps between polls, at most kMaxPause, not to burn a shared core
constexpr auto kMaxPause = std::chrono::microseconds(200);
// how often the timeout callback is asked again while every peer still beats
constexpr auto kOverdueEvery = std::chrono::seconds(1);

int64_t g_slice_bytes = 4 << 20;  // all_reduce works through larger buffers in slices
bool g_native_half = false;       // the library reduces MPIX_C_FLOAT16 / MPIX_BFLOAT16

[[noreturn]] void raiseLaunchError(const std::string& message, const std::string& hint) {
  py::gil_scoped_acquire gil;
  auto error = py::module_::import("launcher.core.errors").attr("LaunchError")(message, hint);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

void check(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  TORCH_CHECK(false, kName, ": MPI failed in ", what, ": ", std::string(text, len));
}

int count(int64_t n, const char* op) {
  TORCH_CHECK(n <= std::numeric_limits<int>::max(), kName, ": ", op, " of ", n,
              " elements is more than an MPI count holds");
  return static_cast<int>(n);
}

// -- dtypes and reductions --------------------------------------------------------------------

bool isHalf(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// as Python writes it, for errors (torch's own table is not exported to extensions)
std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kByte: return "torch.uint8";
    case at::kUInt16: return "torch.uint16";
    case at::kUInt32: return "torch.uint32";
    case at::kUInt64: return "torch.uint64";
    case at::kBool: return "torch.bool";
    default: return c10::toString(t);
  }
}

MPI_Datatype datatype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
#if defined(MPIX_C_FLOAT16) && defined(MPIX_BFLOAT16)
    case at::kHalf: return g_native_half ? MPIX_C_FLOAT16 : MPI_UINT16_T;
    case at::kBFloat16: return g_native_half ? MPIX_BFLOAT16 : MPI_UINT16_T;
#else
    case at::kHalf: case at::kBFloat16: return MPI_UINT16_T;
#endif
    case at::kComplexFloat: return MPI_C_FLOAT_COMPLEX;
    case at::kComplexDouble: return MPI_C_DOUBLE_COMPLEX;
    case at::kChar: return MPI_INT8_T;
    case at::kShort: return MPI_INT16_T;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kUInt16: return MPI_UINT16_T;
    case at::kUInt32: return MPI_UINT32_T;
    case at::kUInt64: return MPI_UINT64_T;
    case at::kBool: return MPI_C_BOOL;
    default:
      raiseLaunchError(std::string("the ") + kName + " backend cannot move " + dtypeName(t) +
                           " tensors",
                       "cast the tensor to a float, integer, bool or complex dtype");
  }
}

// What a reduction needs: the MPI op, the dtype to compute in, and what to do around it.
struct Reduction {
  MPI_Op op;
  at::ScalarType compute;
  bool average = false;
  std::optional<c10::Scalar> premul;  // PREMUL_SUM: multiply the inputs before summing
  std::optional<Tensor> premulTensor;
};

const char* opName(ReduceOp::RedOpType k) {
  switch (k) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::PRODUCT: return "PRODUCT";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::BAND: return "BAND";
    case ReduceOp::BOR: return "BOR";
    case ReduceOp::BXOR: return "BXOR";
    case ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

Reduction reduction(at::ScalarType t, const ReduceOp& rop) {
  const auto k = rop.op_;
  const bool isBool = t == at::kBool;
  const bool isFloat = at::isFloatingType(t) || at::isComplexType(t);
  const bool isComplex = at::isComplexType(t);
  Reduction r{MPI_OP_NULL, t};
  bool ok = true;
  if (isBool) {
    switch (k) {
      case ReduceOp::SUM: case ReduceOp::MAX: case ReduceOp::BOR: r.op = MPI_LOR; break;
      case ReduceOp::PRODUCT: case ReduceOp::MIN: case ReduceOp::BAND: r.op = MPI_LAND; break;
      case ReduceOp::BXOR: r.op = MPI_LXOR; break;
      default: ok = false;
    }
  } else {
    switch (k) {
      case ReduceOp::SUM: r.op = MPI_SUM; break;
      case ReduceOp::AVG: r.op = MPI_SUM; r.average = true; ok = isFloat; break;
      case ReduceOp::PREMUL_SUM: {
        r.op = MPI_SUM;
        ok = isFloat;
        // the name every torch since 2.4 has (2.13 made it an alias of PreMulSumSupplement)
        auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
        if (s == nullptr) {
          ok = false;
        } else if (s->tensor_factor.defined()) {
          r.premulTensor = s->tensor_factor;
        } else {
          r.premul = s->double_factor;
        }
        break;
      }
      case ReduceOp::PRODUCT: r.op = MPI_PROD; break;
      case ReduceOp::MIN: r.op = MPI_MIN; ok = !isComplex; break;
      case ReduceOp::MAX: r.op = MPI_MAX; ok = !isComplex; break;
      case ReduceOp::BAND: r.op = MPI_BAND; ok = !isFloat; break;
      case ReduceOp::BOR: r.op = MPI_BOR; ok = !isFloat; break;
      case ReduceOp::BXOR: r.op = MPI_BXOR; ok = !isFloat; break;
      default: ok = false;
    }
  }
  // MPICH sums its 16-bit float types natively but fails an assertion on MIN/MAX/PROD of them
  if (isHalf(t) && !(g_native_half && r.op == MPI_SUM)) r.compute = at::kFloat;
  if (!ok) {
    raiseLaunchError(std::string("the ") + kName + " backend cannot reduce " + dtypeName(t) +
                         " tensors with ReduceOp." + opName(k),
                     "use SUM/PRODUCT/MIN/MAX, AVG and PREMUL_SUM only for floating dtypes, "
                     "BAND/BOR/BXOR only for integer and bool dtypes, no MIN/MAX for complex; "
                     "cast the tensor if needed");
  }
  return r;
}

// -- tensors as MPI buffers -------------------------------------------------------------------

// ``t`` as a contiguous CPU tensor of ``dtype`` MPI can read by address: ``t`` itself when it is
// one already, else a copy (CUDA tensors are staged through host memory: the .to() waits).
Tensor addressable(const Tensor& t, at::ScalarType dtype) {
  if (t.is_cpu() && t.scalar_type() == dtype && t.is_contiguous()) return t;
  return t.detach().to(at::kCPU, dtype).contiguous();
}
Tensor addressable(const Tensor& t) { return addressable(t, t.scalar_type()); }

void writeBack(const Tensor& dst, const Tensor& src) {
  if (!dst.is_same(src)) dst.detach().copy_(src);
}

Tensor flat(const std::vector<Tensor>& ts, at::ScalarType dtype) {
  std::vector<Tensor> parts;
  parts.reserve(ts.size());
  for (const auto& t : ts) parts.push_back(t.detach().reshape(-1).to(at::kCPU, dtype));
  return at::cat(parts);
}

void unflat(const Tensor& flat, const std::vector<Tensor>& ts) {
  int64_t offset = 0;
  for (const auto& t : ts) {
    const int64_t n = t.numel();
    t.detach().copy_(flat.narrow(0, offset, n).view(t.sizes()));
    offset += n;
  }
}

void premultiply(Tensor& buf, const Reduction& r) {
  if (r.premulTensor) buf.mul_(r.premulTensor->to(buf.device()));
  if (r.premul) buf.mul_(*r.premul);
}

// -- operations and works ---------------------------------------------------------------------

using Start = std::function<int(MPI_Request*)>;

// One collective: MPI calls started one after another (all_reduce's slices), then ``finish``
// (copies back, the average) and the future completed with ``outputs``.
struct Op {
  std::string name;
  std::vector<Start> stages;
  std::function<void()> finish;
  std::vector<Tensor> outputs;
  std::chrono::milliseconds timeout;
  c10::intrusive_ptr<c10::ivalue::Future> future;
};

c10::intrusive_ptr<c10::ivalue::Future> newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

class CollectiveWork : public c10d::Work {
 public:
  CollectiveWork(c10::intrusive_ptr<c10::ivalue::Future> future, std::vector<Tensor> outputs,
                 c10d::OpType type)
      : Work(-1, type), future_(std::move(future)), outputs_(std::move(outputs)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds /* timeout: the group's governs */) override {
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<Tensor> outputs_;
};

// The timeout callback, shared by a group and its works without taking the GIL for each
// copy; the last owner lets go of it with the GIL (at interpreter exit it is left to leak).
using Overdue = std::shared_ptr<py::function>;

Overdue shareOverdue(py::function f) {
  return Overdue(new py::function(std::move(f)), [](py::function* p) {
    if (!Py_IsInitialized()) {
      p->release();
    } else {
      py::gil_scoped_acquire gil;
      p->dec_ref();
      p->release();
    }
    delete p;
  });
}

// Polls ``request`` until done, asking ``overdue`` past the timeout (see the file comment).
void poll(MPI_Request* request, MPI_Status* status, const std::string& what,
          std::chrono::milliseconds timeout, std::chrono::microseconds spin,
          const py::function& overdue) {
  const auto start = Clock::now();
  auto pause = std::chrono::microseconds(1);
  auto nextAsk = start + timeout;
  for (int polls = 0;; ++polls) {
    int done = 0;
    check(MPI_Test(request, &done, status), what);
    if (done) return;
    if (polls < kPollsBeforeYield) continue;
    const auto now = Clock::now();
    if (now - start < spin) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxPause));
    }
    if (now >= nextAsk) {
      const double elapsed = std::chrono::duration<double>(now - start).count();
      py::gil_scoped_acquire gil;
      overdue(what, elapsed);  // raises (PeerLost) or returns: every peer still beats
      nextAsk = Clock::now() + kOverdueEvery;
    }
  }
}

class P2PWork : public c10d::Work {
 public:
  P2PWork(MPI_Request request, Tensor buf, std::optional<Tensor> target, std::string what,
          std::chrono::milliseconds timeout, std::chrono::microseconds spin, Overdue overdue,
          c10d::OpType type)
      : Work(-1, type), request_(request), buf_(std::move(buf)), target_(std::move(target)),
        what_(std::move(what)), timeout_(timeout), spin_(spin), overdue_(std::move(overdue)) {}

  bool wait(std::chrono::milliseconds /* timeout */) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      poll(&request_, &status_, what_, timeout_, spin_, *overdue_);
      finishLocked();
    }
    return true;
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      int flag = 0;
      check(MPI_Test(&request_, &flag, &status_), what_);
      if (flag) finishLocked();
    }
    return done_;
  }
  bool isSuccess() const override { return done_; }
  int sourceRank() const override {
    const_cast<P2PWork*>(this)->wait(std::chrono::milliseconds(0));
    return status_.MPI_SOURCE;
  }
  std::vector<Tensor> result() override { return {target_ ? *target_ : buf_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait(std::chrono::milliseconds(0));
    auto future = newFuture();
    future->markCompleted(c10::IValue(result()));
    return future;
  }

 private:
  void finishLocked() {
    if (target_) {
      at::NoGradGuard noGrad;
      writeBack(*target_, buf_);
    }
    done_ = true;
  }

  std::mutex mu_;
  MPI_Request request_;
  MPI_Status status_{};
  Tensor buf_;
  std::optional<Tensor> target_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  Overdue overdue_;
  bool done_ = false;
};

// -- the backend ------------------------------------------------------------------------------

class MpiBackend : public c10d::Backend {
 public:
  MpiBackend(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout,
             std::chrono::microseconds spin, py::function overdue)
      : Backend(rank, size), comm_(comm), timeout_(timeout), spin_(spin),
        overdue_(shareOverdue(std::move(overdue))) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    thread_ = std::thread([this] { loop(); });
  }

  ~MpiBackend() override { stop(); }

  const std::string getBackendName() const override { return kName; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  void shutdown() override {
    stop();
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  // -- reductions ---------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    Op op = newOp("all_reduce", tensors, opts.timeout);
    for (const auto& t : tensors) addAllreduce(op, t, opts.reduceOp);
    return submit(std::move(op), opts.asyncOp, c10d::OpType::ALLREDUCE);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::REDUCE);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::REDUCE_SCATTER);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::_REDUCE_SCATTER_BASE);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::BROADCAST);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::ALLGATHER);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::_ALLGATHER_BASE);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::GATHER);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::SCATTER);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::ALLTOALL_BASE);
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
    return submit(std::move(op), opts.asyncOp, c10d::OpType::ALLTOALL);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    Op op = newOp("barrier", {}, opts.timeout);
    op.stages.push_back([this](MPI_Request* q) { return MPI_Ibarrier(comm_, q); });
    return submit(std::move(op), opts.asyncOp, c10d::OpType::BARRIER);
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

  // -- running ops --------------------------------------------------------------------------

  // Runs ``op`` in this thread when the caller waits for it anyway and the group is idle, else
  // queues it for the progress thread.
  c10::intrusive_ptr<c10d::Work> submit(Op op, bool asyncOp, c10d::OpType type) {
    op.future = newFuture();
    auto work = c10::make_intrusive<CollectiveWork>(op.future, op.outputs, type);
    std::unique_lock<std::mutex> lock(mu_);
    if (failure_) std::rethrow_exception(failure_);
    if (!asyncOp && queue_.empty() && !busy_) {
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        run(op);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      if (error) failure_ = error;
      cv_.notify_all();
      if (error) std::rethrow_exception(error);
      return work;
    }
    queue_.push_back(std::move(op));
    cv_.notify_all();
    return work;
  }

  void run(Op& op) {
    for (size_t i = 0; i < op.stages.size(); ++i) {
      MPI_Request q = MPI_REQUEST_NULL;
      check(op.stages[i](&q), op.name);
      poll(&q, MPI_STATUS_IGNORE, op.name + " on a group of " + std::to_string(size_) + " ranks",
           op.timeout, spin_, *overdue_);
    }
    if (op.finish) {
      at::NoGradGuard noGrad;  // the outputs may be leaves that require grad (parameters)
      op.finish();
    }
    op.future->markCompleted(c10::IValue(op.outputs));
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || (!queue_.empty() && !busy_); });
      if (stop_) return;
      Op op = std::move(queue_.front());
      queue_.pop_front();
      if (failure_) {
        op.future->setError(failure_);
        continue;
      }
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        run(op);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) op.future->setErrorIfNeeded(error);
      lock.lock();
      busy_ = false;
      if (error) failure_ = error;
      cv_.notify_all();
    }
  }

  // Lets the queued ops finish (each is bounded by its timeout), then ends the thread.
  void stop() {
    std::optional<py::gil_scoped_release> release;
    if (Py_IsInitialized() && PyGILState_Check()) release.emplace();  // a timeout needs it
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
      stop_ = true;
      cv_.notify_all();
    }
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference went in one of this thread's callbacks
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  Overdue overdue_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
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
