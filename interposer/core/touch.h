// SPDX-License-Identifier: Apache-2.0
// Which device memory a gated call names, for the lost-memory check of the gate (gate.h): after a
// resume that could not restore some allocations, a call that names one of them follows
// TMSDISK_ON_TOUCH and every other call proceeds. Each gated hook is classified by its name into a
// Shape, which says where its arguments carry addresses and lengths; gated.cpp refuses to compile a
// hook left unclassified. Ranges are bounding ranges (a 2D copy's whole pitch span): holding a call
// that only comes near lost memory is safer than letting one through that reads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <tuple>

#include "cuda_api.h"
#include "gate.h"

namespace tmsdisk::shim::touch {

enum class Shape : uint8_t {
  Unknown,       // not classified: gated.cpp does not compile
  Unseen,        // kernel and graph launches, stream capture: the memory used is not in the arguments
  Dst0Len2,      // cuMemcpyHtoD*(dst, host, bytes)
  Src1Len2,      // cuMemcpyDtoH*(host, src, bytes)
  Dst0Src1Len2,  // cuMemcpyDtoD*, cuMemcpy, cuMemcpyAsync(dst, src, bytes)
  Src2Len3,      // cuMemcpyDtoA*(array, offset, src, bytes)
  Dst0Len3,      // cuMemcpyAtoD*(dst, array, offset, bytes)
  Peer,          // cuMemcpyPeer*(dst, dst ctx, src, src ctx, bytes)
  Copy2D,        // cuMemcpy2D*(const CUDA_MEMCPY2D*)
  Copy3D,        // cuMemcpy3D*(const CUDA_MEMCPY3D*)
  Copy3DPeer,    // cuMemcpy3DPeer*(const CUDA_MEMCPY3D_PEER*)
  Batch,         // cuMemcpyBatchAsync*(dsts, srcs, sizes, count, ...)
  Batch3D,       // cuMemcpy3DBatchAsync*(count, ops, ...)
  Set1,          // cuMemsetD8*(dst, value, count): element bytes 1, 2, 4
  Set2,
  Set4,
  Set2D1,  // cuMemsetD2D8*(dst, pitch, value, width, height)
  Set2D2,
  Set2D4,
  Prefetch,    // cuMemPrefetchAsync*(ptr, bytes, ...)
  Value4,      // cuStreamWrite/WaitValue32*(stream, addr, ...)
  Value8,      // cuStreamWrite/WaitValue64*
  BatchMemOp,  // cuStreamBatchMemOp*(stream, count, params, flags)
};

constexpr Shape shape_of(std::string_view name) noexcept {
  auto starts = [&](std::string_view prefix) { return name.substr(0, prefix.size()) == prefix; };
  if (starts("cuLaunch") || starts("cuGraphLaunch") || starts("cuStreamBeginCapture") || starts("cuStreamEndCapture"))
    return Shape::Unseen;
  if (starts("cuMemcpyHtoD")) return Shape::Dst0Len2;
  if (starts("cuMemcpyDtoH")) return Shape::Src1Len2;
  if (starts("cuMemcpyDtoD")) return Shape::Dst0Src1Len2;
  if (starts("cuMemcpyDtoA")) return Shape::Src2Len3;
  if (starts("cuMemcpyAtoD")) return Shape::Dst0Len3;
  if (starts("cuMemcpy2D")) return Shape::Copy2D;
  if (starts("cuMemcpy3DPeer")) return Shape::Copy3DPeer;
  if (starts("cuMemcpy3DBatch")) return Shape::Batch3D;
  if (starts("cuMemcpy3D")) return Shape::Copy3D;
  if (starts("cuMemcpyPeer")) return Shape::Peer;
  if (starts("cuMemcpyBatch")) return Shape::Batch;
  if (name == "cuMemcpy" || name == "cuMemcpy_ptds" || starts("cuMemcpyAsync")) return Shape::Dst0Src1Len2;
  if (starts("cuMemsetD2D8")) return Shape::Set2D1;
  if (starts("cuMemsetD2D16")) return Shape::Set2D2;
  if (starts("cuMemsetD2D32")) return Shape::Set2D4;
  if (starts("cuMemsetD8")) return Shape::Set1;
  if (starts("cuMemsetD16")) return Shape::Set2;
  if (starts("cuMemsetD32")) return Shape::Set4;
  if (starts("cuMemPrefetchAsync")) return Shape::Prefetch;
  if (starts("cuStreamWriteValue32") || starts("cuStreamWaitValue32")) return Shape::Value4;
  if (starts("cuStreamWriteValue64") || starts("cuStreamWaitValue64")) return Shape::Value8;
  if (starts("cuStreamBatchMemOp")) return Shape::BatchMemOp;
  return Shape::Unknown;
}

namespace detail {

// a * b + c, or UINT64_MAX when it overflows: a bounding range may only grow.
inline uint64_t span(uint64_t a, uint64_t b, uint64_t c) noexcept {
  uint64_t p = 0, s = 0;
  if (__builtin_mul_overflow(a, b, &p) || __builtin_add_overflow(p, c, &s)) return UINT64_MAX;
  return s;
}

inline bool device_side(CUmemorytype t) noexcept {
  return t == CU_MEMORYTYPE_DEVICE || t == CU_MEMORYTYPE_UNIFIED;
}

// One operand of a 2D/3D copy: its first byte, and the bytes up to its last row's end.
inline bool lost_2d(CUmemorytype type, CUdeviceptr base, std::size_t x, std::size_t y, std::size_t pitch,
                    std::size_t width, std::size_t rows) noexcept {
  if (!device_side(type) || width == 0 || rows == 0) return false;
  const uint64_t first = span(y, pitch, x);
  if (first == UINT64_MAX || first > UINT64_MAX - base) return gate::lost(base, UINT64_MAX);
  return gate::lost(base + first, span(rows - 1, pitch, width));
}

inline bool lost_copy_2d(const CUDA_MEMCPY2D* c) noexcept {
  if (!c) return false;
  return lost_2d(c->srcMemoryType, c->srcDevice, c->srcXInBytes, c->srcY, c->srcPitch, c->WidthInBytes, c->Height) ||
         lost_2d(c->dstMemoryType, c->dstDevice, c->dstXInBytes, c->dstY, c->dstPitch, c->WidthInBytes, c->Height);
}

// A 3D operand as rows of `pitch` bytes: layer z starts `height` rows after layer z-1.
template <class C>
bool lost_copy_3d(const C* c) noexcept {
  if (!c || c->Depth == 0 || c->Height == 0) return false;
  const uint64_t src_rows = span(c->srcHeight, c->Depth - 1, c->Height);
  const uint64_t dst_rows = span(c->dstHeight, c->Depth - 1, c->Height);
  return lost_2d(c->srcMemoryType, c->srcDevice, c->srcXInBytes, span(c->srcZ, c->srcHeight, c->srcY), c->srcPitch,
                 c->WidthInBytes, src_rows) ||
         lost_2d(c->dstMemoryType, c->dstDevice, c->dstXInBytes, span(c->dstZ, c->dstHeight, c->dstY), c->dstPitch,
                 c->WidthInBytes, dst_rows);
}

// A pointer operand of a 3D batch copy (elements of 1 byte between pointers; up to 16 bytes, the
// widest array element, when the other side is an array).
inline bool lost_operand(const CUmemcpy3DOperand& o, const CUextent3D& e, uint64_t element) noexcept {
  if (o.type != CU_MEMCPY_OPERAND_TYPE_POINTER || e.width == 0 || e.height == 0 || e.depth == 0) return false;
  const uint64_t row = span(o.op.ptr.rowLength ? o.op.ptr.rowLength : e.width, element, 0);
  const uint64_t layer_rows = o.op.ptr.layerHeight ? o.op.ptr.layerHeight : e.height;
  const uint64_t rows = span(layer_rows, e.depth - 1, e.height);
  return gate::lost(o.op.ptr.ptr, span(rows - 1, row, span(e.width, element, 0)));
}

inline bool lost_batch_3d(std::size_t count, const CUDA_MEMCPY3D_BATCH_OP* ops) noexcept {
  for (std::size_t i = 0; ops && i < count; ++i) {
    const bool pointers =
        ops[i].src.type == CU_MEMCPY_OPERAND_TYPE_POINTER && ops[i].dst.type == CU_MEMCPY_OPERAND_TYPE_POINTER;
    const uint64_t element = pointers ? 1 : 16;
    if (lost_operand(ops[i].src, ops[i].extent, element) || lost_operand(ops[i].dst, ops[i].extent, element))
      return true;
  }
  return false;
}

inline bool lost_mem_ops(unsigned int count, const CUstreamBatchMemOpParams* ops) noexcept {
  for (unsigned int i = 0; ops && i < count; ++i) {
    switch (ops[i].operation) {
      case CU_STREAM_MEM_OP_WAIT_VALUE_32:
      case CU_STREAM_MEM_OP_WAIT_VALUE_64:
        if (gate::lost(ops[i].waitValue.address, 8)) return true;
        break;
      case CU_STREAM_MEM_OP_WRITE_VALUE_32:
      case CU_STREAM_MEM_OP_WRITE_VALUE_64:
        if (gate::lost(ops[i].writeValue.address, 8)) return true;
        break;
      default: break;
    }
  }
  return false;
}

}  // namespace detail

// Whether a call of shape S with arguments `args` touches lost memory.
template <Shape S, class... Args>
gate::Touch check(const Args&... args) noexcept {
  using gate::Touch;
  [[maybe_unused]] const auto a = std::tie(args...);
  [[maybe_unused]] auto touch = [](bool lost) { return lost ? Touch::Lost : Touch::Clear; };
  if constexpr (S == Shape::Unseen) {
    return Touch::Unseen;
  } else if constexpr (S == Shape::Dst0Len2) {
    return touch(gate::lost(std::get<0>(a), std::get<2>(a)));
  } else if constexpr (S == Shape::Src1Len2) {
    return touch(gate::lost(std::get<1>(a), std::get<2>(a)));
  } else if constexpr (S == Shape::Dst0Src1Len2) {
    return touch(gate::lost(std::get<0>(a), std::get<2>(a)) || gate::lost(std::get<1>(a), std::get<2>(a)));
  } else if constexpr (S == Shape::Src2Len3) {
    return touch(gate::lost(std::get<2>(a), std::get<3>(a)));
  } else if constexpr (S == Shape::Dst0Len3) {
    return touch(gate::lost(std::get<0>(a), std::get<3>(a)));
  } else if constexpr (S == Shape::Peer) {
    return touch(gate::lost(std::get<0>(a), std::get<4>(a)) || gate::lost(std::get<2>(a), std::get<4>(a)));
  } else if constexpr (S == Shape::Copy2D) {
    return touch(detail::lost_copy_2d(std::get<0>(a)));
  } else if constexpr (S == Shape::Copy3D || S == Shape::Copy3DPeer) {
    return touch(detail::lost_copy_3d(std::get<0>(a)));
  } else if constexpr (S == Shape::Batch) {
    const auto* dsts = std::get<0>(a);
    const auto* srcs = std::get<1>(a);
    const auto* sizes = std::get<2>(a);
    for (std::size_t i = 0; dsts && srcs && sizes && i < std::get<3>(a); ++i)
      if (gate::lost(dsts[i], sizes[i]) || gate::lost(srcs[i], sizes[i])) return Touch::Lost;
    return Touch::Clear;
  } else if constexpr (S == Shape::Batch3D) {
    return touch(detail::lost_batch_3d(std::get<0>(a), std::get<1>(a)));
  } else if constexpr (S == Shape::Set1 || S == Shape::Set2 || S == Shape::Set4) {
    constexpr uint64_t element = S == Shape::Set1 ? 1 : S == Shape::Set2 ? 2 : 4;
    return touch(gate::lost(std::get<0>(a), detail::span(std::get<2>(a), element, 0)));
  } else if constexpr (S == Shape::Set2D1 || S == Shape::Set2D2 || S == Shape::Set2D4) {
    constexpr uint64_t element = S == Shape::Set2D1 ? 1 : S == Shape::Set2D2 ? 2 : 4;
    const std::size_t height = std::get<4>(a);
    if (height == 0) return Touch::Clear;
    return touch(
        gate::lost(std::get<0>(a), detail::span(height - 1, std::get<1>(a), detail::span(std::get<3>(a), element, 0))));
  } else if constexpr (S == Shape::Prefetch) {
    return touch(gate::lost(std::get<0>(a), std::get<1>(a)));
  } else if constexpr (S == Shape::Value4) {
    return touch(gate::lost(std::get<1>(a), 4));
  } else if constexpr (S == Shape::Value8) {
    return touch(gate::lost(std::get<1>(a), 8));
  } else if constexpr (S == Shape::BatchMemOp) {
    return touch(detail::lost_mem_ops(std::get<1>(a), std::get<2>(a)));
  } else {
    static_assert(S != S, "unclassified gated call");
  }
}

}  // namespace tmsdisk::shim::touch
