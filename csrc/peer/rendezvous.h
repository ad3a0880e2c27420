// A host-side meeting point for the devices of one group inside one process.
//
// The peer-pointer ops run once per device (XLA calls each device's handler on that device's
// own thread). Before a device may read its peers' buffers it must know where they are and
// that they are ready; before it may go on writing its own buffers it must know that its peers
// finished reading them. Each op call therefore meets its peers twice (phase kReady, phase
// kDone), publishing a small payload (buffer addresses, an event) each time.
//
// Every wait is bounded: a peer that does not arrive within the timeout gives an error that
// names the ranks that are missing, never a hang. Only handler invocations meet here (host
// threads); the devices' work is ordered by events, so no device waits for the host.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pimhbm::peer {

constexpr int kMaxGroup = 8;  // peers per group (one host's GPUs)

struct Payload {
  const void* in = nullptr;     // what peers read (input tensor)
  const void* extra = nullptr;  // a second readable buffer (a digest table), or null
  void* event = nullptr;        // a cudaEvent_t recorded on the publisher's stream, or null
};

enum Phase : int { kReady = 0, kDone = 1 };

class Group {
 public:
  explicit Group(int size) : size_(size), slots_(size) {}
  int size() const { return size_; }

  // Publishes `mine` for `rank` in `phase` and waits (at most `timeout`) until every rank of
  // the group has published for the same call; fills `all` (indexed by rank). Returns "" or
  // an error message.
  std::string exchange(int rank, Phase phase, const Payload& mine, std::vector<Payload>* all,
                       std::chrono::milliseconds timeout);

  // The per-rank events of this group (created by the rank's own device on first use).
  void*& event_slot(int rank, Phase phase) { return slots_[rank].events[phase]; }

 private:
  struct Slot {
    uint64_t generation[2] = {0, 0};
    Payload payload[2];
    void* events[2] = {nullptr, nullptr};
  };
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
};

// The group of (op call site `tag`, group index), created on first use. Errors when the same
// key is asked for with another size.
Group* group_for(int64_t tag, int64_t group, int size, std::string* error);

// The rank and group of `ordinal` in `ordinals` (ngroups x size, row-major). False if absent.
bool find_rank(const int64_t* ordinals, int64_t count, int64_t size, int64_t ordinal,
               int64_t* group, int* rank);

}  // namespace pimhbm::peer
