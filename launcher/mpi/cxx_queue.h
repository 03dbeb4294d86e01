// Part of the compiled mpi backend (launcher/mpi/cxx.cpp includes it): a group's collectives
// in the order they were called, a FIFO and the progress thread that starts them one after
// another, so that every rank starts them in the same order, as MPI requires.
#pragma once

#include "cxx_work.h"

#include <condition_variable>
#include <deque>
#include <exception>

namespace {

class OpQueue {
 public:
  // ``where``: how an error names the group (" on a group of N ranks")
  OpQueue(std::string where, std::chrono::microseconds spin, Overdue overdue)
      : where_(std::move(where)), spin_(spin), overdue_(std::move(overdue)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~OpQueue() { stop(); }
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Runs ``op`` in this thread when the caller waits for it anyway and the group is idle, else
  // queues it for the progress thread.
  c10::intrusive_ptr<c10d::Work> submit(Op op, bool asyncOp, c10d::OpType type) {
    op.future = newFuture();
    auto work = c10::make_intrusive<CollectiveWork>(op.future, op.outputs, type);
    std::unique_lock<std::mutex> lock(mu_);
    if (failure_) std::rethrow_exception(failure_);
    if (!asyncOp && queue_.empty() && !busy_) {
      if (auto error = runBusy(op, lock)) std::rethrow_exception(error);
      return work;
    }
    queue_.push_back(std::move(op));
    if (!busy_) work_.notify_one();
    return work;
  }

  // Lets the queued ops finish (each is bounded by its timeout), then ends the thread.
  void stop() {
    std::optional<py::gil_scoped_release> release;
    if (Py_IsInitialized() && PyGILState_Check()) release.emplace();  // a timeout needs it
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
      stop_ = true;
      work_.notify_one();
    }
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference went in one of this thread's callbacks
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  void run(Op& op) {
    for (size_t i = 0; i < op.stages.size(); ++i) {
      MPI_Request q = MPI_REQUEST_NULL;
      check(op.stages[i](&q), op.name);
      poll(&q, MPI_STATUS_IGNORE, op.name + where_, op.timeout, spin_, *overdue_);
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
      work_.wait(lock, [this] { return stop_ || (!queue_.empty() && !busy_); });
      if (stop_) return;
      Op op = std::move(queue_.front());
      queue_.pop_front();
      if (failure_) {  // failed unstarted, its callbacks run without the lock, as run's do
        const std::exception_ptr error = failure_;
        lock.unlock();
        op.future->setError(error);
        lock.lock();
        handOn();
        continue;
      }
      runBusy(op, lock);
    }
  }

  // Runs ``op`` with ``lock`` let go and the queue marked busy; its error, if any, fails its
  // future and every op after it.
  std::exception_ptr runBusy(Op& op, std::unique_lock<std::mutex>& lock) {
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
    handOn();
    return error;
  }

  // After an op, with the lock held: stop() is told when none is left to run, the progress
  // thread when one waits for it.
  void handOn() {
    if (busy_) return;
    if (queue_.empty()) {
      idle_.notify_all();
    } else {
      work_.notify_one();
    }
  }

  const std::string where_;
  const std::chrono::microseconds spin_;
  const Overdue overdue_;
  std::mutex mu_;
  // two, so that the end of each op run in the caller's thread wakes nobody where nothing
  // waits (one shared with the idle progress thread cost a wake-up and a context switch per
  // call: ~14 % of a solo all_reduce's time in perf, a core taken from MPI on a full node)
  std::condition_variable work_;  // the progress thread: an op to start, or stop
  std::condition_variable idle_;  // stop(): every op done
  std::deque<Op> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace
