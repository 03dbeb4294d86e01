// Part of the compiled mpi backend (launcher/mpi/cxx.cpp includes it: one translation unit):
// MPI's errors as torch's, tensors' dtypes and reductions as MPI's, tensors as MPI buffers.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <mpi.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using at::Tensor;
using c10d::ReduceOp;

constexpr const char* kName = "mpi_cxx";
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

}  // namespace
