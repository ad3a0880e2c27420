#include <cstring>

#include "update/restore.h"

namespace pimhbm::update {

void restore_cpu(const int32_t* commit, const std::vector<CopyPair>& pairs) {
  if (*commit != 0) return;
  for (const CopyPair& p : pairs) {
    if (p.bytes > 0 && p.src != p.dst) std::memcpy(p.dst, p.src, static_cast<size_t>(p.bytes));
  }
}

}  // namespace pimhbm::update
