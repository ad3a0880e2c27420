#include "peer/rendezvous.h"

#include <map>
#include <utility>

namespace pimhbm::peer {

std::string Group::exchange(int rank, Phase phase, const Payload& mine, std::vector<Payload>* all,
                            std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  Slot& me = slots_[rank];
  const uint64_t gen = ++me.generation[phase];
  me.payload[phase] = mine;
  cv_.notify_all();
  auto arrived = [&] {
    for (const Slot& s : slots_) {
      if (s.generation[phase] < gen) return false;
    }
    return true;
  };
  if (!cv_.wait_for(lock, timeout, arrived)) {
    std::string missing;
    for (int r = 0; r < size_; ++r) {
      if (slots_[r].generation[phase] < gen)
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    return "rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
           " ms for rank(s) " + missing + " of " + std::to_string(size_) +
           (phase == kReady ? " to publish their buffers" : " to finish reading") + " (call " +
           std::to_string(gen) + "); a peer device is stuck or failed";
  }
  // A rank can overwrite its payload for the next call only after every rank has met it in the
  // other phase of this call, which each does after copying this phase's payloads: safe.
  all->resize(size_);
  for (int r = 0; r < size_; ++r) (*all)[r] = slots_[r].payload[phase];
  return "";
}

Group* group_for(int64_t tag, int64_t group, int size, std::string* error) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Group>> groups;
  std::lock_guard<std::mutex> lock(mu);
  auto& g = groups[{tag, group}];
  if (!g) g = std::make_unique<Group>(size);
  if (g->size() != size) {
    *error = "call site " + std::to_string(tag) + " was used with groups of " +
             std::to_string(g->size()) + " and now " + std::to_string(size) + " devices";
    return nullptr;
  }
  return g.get();
}

bool find_rank(const int64_t* ordinals, int64_t count, int64_t size, int64_t ordinal,
               int64_t* group, int* rank) {
  for (int64_t i = 0; i < count; ++i) {
    if (ordinals[i] == ordinal) {
      *group = i / size;
      *rank = static_cast<int>(i % size);
      return true;
    }
  }
  return false;
}

}  // namespace pimhbm::peer
