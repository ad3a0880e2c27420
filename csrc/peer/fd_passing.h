// Handing a file descriptor to another process of the same user, over a Unix socket
// (SCM_RIGHTS), as CUDA's virtual-memory allocations are shared: the exporter offers the
// allocation's descriptor and publishes the ticket; the importer connects, proves who it is
// and receives a descriptor of its own.
//
// Both ends check the other with SO_PEERCRED: the exporter answers only processes of its own
// user, the importer accepts a descriptor only from the process the ticket names. A ticket also
// carries a random token per descriptor, so that one offered descriptor does not open the
// others. Nothing else of the process is opened (no ptrace permission, no /proc access).
//
// The socket lives in the abstract namespace (nothing on disk to clean up) under a random name,
// which no other process can take first.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace pimhbm::peer::fd_passing {

// How an importer finds and names one offered descriptor.
struct Ticket {
  char socket[48];    // the exporter's socket, NUL-terminated (abstract namespace)
  uint8_t token[16];  // which descriptor
};
static_assert(sizeof(Ticket) == 64, "a ticket is part of the protocol between processes");

// The descriptor could not be handed over (the reason is the message).
class Refused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Offers `fd` (it stays the caller's: it must stay open until withdraw_all) to processes of
// this user; starts this process's server on the first offer. Throws std::runtime_error when the
// socket cannot be made.
Ticket offer(int fd);

// Takes the descriptor `ticket` names from process `exporter_pid`, waiting at most
// `timeout_ms` for each exchange; returns a new descriptor (the caller closes it). Throws
// Refused when the exporter is gone, is not `exporter_pid`, or does not know the token.
int take(const Ticket& ticket, int32_t exporter_pid, int timeout_ms);

// Stops the server and forgets every offer (the descriptors themselves are the callers').
// Processes that took a descriptor keep theirs.
void withdraw_all();

}  // namespace pimhbm::peer::fd_passing
