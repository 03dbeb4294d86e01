// Part of the compiled mpi backend (launcher/mpi/cxx.cpp includes it): one collective as the
// progress thread runs it (``Op``), the Works torch is handed, and the polling that every wait
// goes through (the timeout and the heartbeats' verdict: see cxx.cpp's comment).
#pragma once

#include "cxx_types.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <sched.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

// polls of a request before each further poll gives up the CPU (MPICH spins about as long)
constexpr int kPollsBeforeYield = 50;
// a wait longer than its group's spin (waiting.spin_s: 10 ms, none where a node's ranks
// outnumber its CPUs) sleeps between polls, at most kMaxPause, not to burn a shared core
constexpr auto kMaxPause = std::chrono::microseconds(200);
// how often the timeout callback is asked again while every peer still beats
constexpr auto kOverdueEvery = std::chrono::seconds(1);

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

}  // namespace
