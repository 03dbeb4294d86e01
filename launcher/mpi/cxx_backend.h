// Part of the compiled mpi backend (launcher/mpi/cxx.cpp includes it): the c10d::Backend,
// each of torch's operations as an Op (cxx_build.h) for the group's queue (cxx_queue.h), or
// as a point-to-point Work the caller's wait drives.
#pragma once

#include "cxx_build.h"
#include "cxx_queue.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace {

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
    for (const auto& t : tensors) addAllreduce(op, t, opts.reduceOp, comm_, size_);
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
      if (atRoot) chain(op, [=, this] { averaged(buf, r, size_); writeBack(t, buf); });
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
      addReduceScatter(op, outputs[i], in, r, comm_, size_);
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
      addReduceScatter(op, outputs[i], prepared(inputs[i], r, true), r, comm_, size_);
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
    addAlltoallv(op, out, counts(out, outputSplits, size_), in, counts(in, inputSplits, size_),
                 comm_);
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
    addAlltoallv(op, out, recvCounts, flat(inputs, dtype), sendCounts, comm_);
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
  Op newOp(std::string name, std::vector<Tensor> outputs, std::chrono::milliseconds timeout) {
    Op op;
    op.name = std::move(name);
    op.outputs = std::move(outputs);
    op.timeout = timeout == c10d::kUnsetTimeout ? timeout_ : timeout;
    return op;
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

}  // namespace
