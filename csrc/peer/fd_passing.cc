#include "peer/fd_passing.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace pimhbm::peer::fd_passing {
namespace {

using Token = std::array<uint8_t, 16>;

// The exporter's side: its listening socket, the thread that answers on it, the offers.
struct Server {
  std::mutex mu;
  int listen_fd = -1;
  Ticket base{};  // the socket's name; tokens are filled per offer
  std::map<Token, int> offers;
  std::thread thread;
  std::shared_ptr<std::atomic<bool>> stop;  // the running thread's own: a new one per start
};

Server& server() {
  static auto* s = new Server();  // never destroyed: its thread may outlive static teardown
  return *s;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("pimhbm descriptor hand-off: " + what + ": " + std::strerror(errno));
}

void random_bytes(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("getrandom");
    p += got;
    n -= static_cast<size_t>(got);
  }
}

// The abstract-namespace address of `name` (a leading NUL, then the name, not terminated).
socklen_t address_of(const char* name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const size_t n = strnlen(name, sizeof(Ticket::socket));
  std::memcpy(addr->sun_path + 1, name, n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

void set_timeouts(int fd, int timeout_ms) {
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool peer_of(int fd, ucred* cred) {
  socklen_t len = sizeof(*cred);
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cred, &len) == 0 && len == sizeof(*cred);
}

// One status byte, with the descriptor attached when there is one (fd >= 0).
void send_answer(int conn, int fd) {
  char status = fd >= 0 ? 1 : 0;
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
}

// One request: a process of another user gets nothing, not even an answer.
void answer(Server& s, int conn) {
  ucred cred{};
  if (!peer_of(conn, &cred) || cred.uid != geteuid()) return;
  set_timeouts(conn, 1000);
  Token token;
  if (recv(conn, token.data(), token.size(), MSG_WAITALL) != static_cast<ssize_t>(token.size())) {
    return;
  }
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (auto it = s.offers.find(token); it != s.offers.end()) fd = it->second;
  }
  send_answer(conn, fd);
}

void serve(Server& s, int listen_fd, std::shared_ptr<std::atomic<bool>> stop) {
  while (!stop->load()) {
    pollfd p{listen_fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;  // wakes up to see `stop`
    const int conn = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(s, conn);
    close(conn);
  }
}

// The listening socket under a fresh random name, and its thread. Called with s.mu held.
void start(Server& s) {
  uint8_t name_bits[12];
  random_bytes(name_bits, sizeof(name_bits));
  char name[sizeof(Ticket::socket)] = {};
  int n = std::snprintf(name, sizeof(name), "pimhbm-fd-%d-", static_cast<int>(getpid()));
  for (uint8_t b : name_bits) n += std::snprintf(name + n, sizeof(name) - n, "%02x", b);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket");
  sockaddr_un addr;
  const socklen_t len = address_of(name, &addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    fail(std::string("cannot listen on @") + name);
  }
  std::memcpy(s.base.socket, name, sizeof(name));
  s.listen_fd = fd;
  s.stop = std::make_shared<std::atomic<bool>>(false);
  s.thread = std::thread(serve, std::ref(s), fd, s.stop);
}

// The exporter behind `conn` must be `pid`, of this user.
void check_exporter(int conn, int32_t pid) {
  ucred cred{};
  if (!peer_of(conn, &cred)) fail("SO_PEERCRED");
  if (cred.uid != geteuid() || cred.pid != pid) {
    throw Refused("pimhbm descriptor hand-off: the socket is served by process " +
                  std::to_string(cred.pid) + " of uid " + std::to_string(cred.uid) +
                  ", not by the exporting process " + std::to_string(pid) + " of uid " +
                  std::to_string(geteuid()) + ": refused");
  }
}

// The answer to a request: the descriptor, or -1 when the exporter does not know the token.
int receive_answer(int conn) {
  char status = 0;
  iovec iov{&status, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
  if (got != 1) {
    throw Refused(std::string("pimhbm descriptor hand-off: no answer from the exporter (") +
                  (got < 0 ? std::strerror(errno) : "connection closed") + ")");
  }
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0 || (status == 1) != (fd >= 0)) {
    if (fd >= 0) close(fd);
    throw Refused("pimhbm descriptor hand-off: a malformed answer from the exporter");
  }
  return fd;
}

}  // namespace

Ticket offer(int fd) {
  Server& s = server();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.listen_fd < 0) start(s);
  Ticket t = s.base;
  Token token;
  random_bytes(token.data(), token.size());
  std::memcpy(t.token, token.data(), token.size());
  s.offers[token] = fd;
  return t;
}

int take(const Ticket& ticket, int32_t exporter_pid, int timeout_ms) {
  const int conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (conn < 0) fail("socket");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{conn};
  set_timeouts(conn, timeout_ms);
  sockaddr_un addr;
  const socklen_t len = address_of(ticket.socket, &addr);
  if (connect(conn, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    throw Refused(std::string("pimhbm descriptor hand-off: cannot reach the exporter (") +
                  std::strerror(errno) + ")");
  }
  check_exporter(conn, exporter_pid);
  if (send(conn, ticket.token, sizeof(ticket.token), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(ticket.token))) {
    throw Refused(std::string("pimhbm descriptor hand-off: cannot ask the exporter (") +
                  std::strerror(errno) + ")");
  }
  const int fd = receive_answer(conn);
  if (fd < 0) {
    throw Refused("pimhbm descriptor hand-off: the exporter offers no descriptor under this "
                  "token (withdrawn, or never offered)");
  }
  return fd;
}

void withdraw_all() {
  Server& s = server();
  std::thread thread;
  int listen_fd;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.offers.clear();
    if (s.stop) *s.stop = true;
    thread = std::move(s.thread);
    listen_fd = s.listen_fd;
    s.listen_fd = -1;
  }
  if (thread.joinable()) thread.join();
  if (listen_fd >= 0) close(listen_fd);
}

}  // namespace pimhbm::peer::fd_passing
