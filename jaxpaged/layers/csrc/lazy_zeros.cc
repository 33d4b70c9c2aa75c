// A zero-filled buffer whose memory the kernel commits only as it is written: the KV pool on
// a CPU, as an XLA FFI custom call with no inputs.
//
// jnp.zeros writes every byte, so a 4 GiB pool costs 4 GiB of resident memory from the start
// whatever the requests use. Here the page-aligned interior of the output is handed back with
// madvise(MADV_DONTNEED), after which Linux reads it as zeros and backs a page with memory
// only when a step first writes it (anonymous private memory; madvise(2)); the unaligned
// head and tail bytes are set with memset. Where madvise fails (another OS, or memory it does
// not apply to), the whole buffer is set with memset, as jnp.zeros would.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error LazyZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  auto* begin = static_cast<char*>(out->untyped_data());
  const size_t size = out->size_bytes();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + size) / page * page;
  if (last <= first ||
      madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    std::memset(begin, 0, size);
    return ffi::Error::Success();
  }
  std::memset(begin, 0, first - reinterpret_cast<uintptr_t>(begin));
  std::memset(reinterpret_cast<char*>(last), 0, reinterpret_cast<uintptr_t>(begin) + size - last);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLazyZeros, LazyZerosImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
