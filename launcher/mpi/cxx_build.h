// Part of the compiled mpi backend (launcher/mpi/cxx.cpp includes it): how an operation's
// tensors become an Op, the MPI calls its stages start and what ``finish`` does after them
// (copies back, the average); the backend's operations (cxx_backend.h) are made of these.
#pragma once

#include "cxx_work.h"

#include <algorithm>

namespace {

int64_t g_slice_bytes = 4 << 20;  // all_reduce works through larger buffers in slices

std::vector<Tensor> flatten(const std::vector<std::vector<Tensor>>& lists) {
  std::vector<Tensor> all;
  for (const auto& l : lists) all.insert(all.end(), l.begin(), l.end());
  return all;
}

// ``next`` to run after what ``op`` already does when it completes
void chain(Op& op, std::function<void()> next) {
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

void averaged(const Tensor& buf, const Reduction& r, int size) {
  if (r.average) buf.div_(size);
}

void addAllreduce(Op& op, const Tensor& t, const ReduceOp& rop, MPI_Comm comm, int size) {
  Reduction r = reduction(t.scalar_type(), rop);
  Tensor buf = prepared(t, r, false);
  const auto dt = datatype(buf.scalar_type());
  const int64_t total = buf.numel();
  const int64_t step = std::max<int64_t>(1, g_slice_bytes / buf.element_size());
  char* base = static_cast<char*>(buf.data_ptr());
  for (int64_t start = 0; start < total; start += step) {
    const int n = count(std::min(step, total - start), "all_reduce");
    char* p = base + start * buf.element_size();
    op.stages.push_back([=](MPI_Request* q) {
      (void)buf;  // keeps the buffer alive as long as the stage
      return MPI_Iallreduce(MPI_IN_PLACE, p, n, dt, r.op, comm, q);
    });
  }
  chain(op, [=] { averaged(buf, r, size); writeBack(t, buf); });
}

void addReduceScatter(Op& op, const Tensor& output, const Tensor& in, const Reduction& r,
                      MPI_Comm comm, int size) {
  Tensor out = addressable(output, r.compute);
  const int n = count(out.numel(), "reduce_scatter");
  const auto dt = datatype(out.scalar_type());
  if (n) {
    op.stages.push_back([=](MPI_Request* q) {
      return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), n, dt, r.op, comm, q);
    });
  }
  chain(op, [=] { averaged(out, r, size); writeBack(output, out); });
}

// what each of ``size`` ranks sends or receives of ``t``: equal blocks, or ``splits`` rows
std::vector<int> counts(const Tensor& t, const std::vector<int64_t>& splits, int size) {
  std::vector<int> c(size);
  if (splits.empty()) {
    std::fill(c.begin(), c.end(), count(t.numel() / size, "all_to_all"));
  } else {
    const int64_t row = t.dim() && t.size(0) ? t[0].numel() : 0;
    for (int i = 0; i < size; ++i) c[i] = count(splits.at(i) * row, "all_to_all");
  }
  return c;
}

void addAlltoallv(Op& op, const Tensor& out, std::vector<int> recvCounts, const Tensor& in,
                  std::vector<int> sendCounts, MPI_Comm comm) {
  const size_t size = sendCounts.size();
  std::vector<int> sendDispls(size, 0), recvDispls(size, 0);
  for (size_t i = 1; i < size; ++i) {
    sendDispls[i] = sendDispls[i - 1] + sendCounts[i - 1];
    recvDispls[i] = recvDispls[i - 1] + recvCounts[i - 1];
  }
  const auto dt = datatype(out.scalar_type());
  // MPI reads the count arrays until the op completes: the stage owns them
  auto arrays = std::make_shared<std::vector<std::vector<int>>>(
      std::vector<std::vector<int>>{sendCounts, sendDispls, recvCounts, recvDispls});
  op.stages.push_back([=](MPI_Request* q) {
    auto& a = *arrays;
    return MPI_Ialltoallv(in.data_ptr(), a[0].data(), a[1].data(), dt, out.data_ptr(),
                          a[2].data(), a[3].data(), dt, comm, q);
  });
}

}  // namespace
