// The descriptor hand-off: a descriptor offered here is taken by another process (a child),
// which reads the same file through it; a wrong token, a wrong exporter and a withdrawn offer
// are refused with a message.
#include "peer/fd_passing.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <random>
#include <string>

namespace pimhbm::peer::fd_passing {
namespace {

// A memory file holding `text`, as a CUDA allocation's descriptor would be (any file will do).
int file_with(const std::string& text) {
  const int fd = memfd_create("fd_passing_test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

std::string contents(int fd, size_t n) {
  std::string out(n, '\0');
  EXPECT_EQ(pread(fd, out.data(), n, 0), static_cast<ssize_t>(n));
  return out;
}

std::string fresh_text() {
  std::random_device rd;
  return "offered " + std::to_string(rd()) + std::to_string(rd());
}

class FdPassing : public ::testing::Test {
 protected:
  void TearDown() override { withdraw_all(); }
};

TEST_F(FdPassing, AnotherProcessTakesTheOfferedDescriptor) {
  const std::string text = fresh_text(), other = fresh_text();
  const int fd = file_with(text), fd2 = file_with(other);
  const Ticket ticket = offer(fd);
  offer(fd2);  // a second offer on the same socket: the token picks one
  const pid_t me = getpid();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the importer: a descriptor of its own on the same file
    int code = 1;
    try {
      const int got = take(ticket, me, 2000);
      code = contents(got, text.size()) == text && got != fd ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  close(fd);
  close(fd2);
}

TEST_F(FdPassing, TakenInThisProcessItIsANewDescriptorOfTheSameFile) {
  const std::string text = fresh_text();
  const int fd = file_with(text);
  const int got = take(offer(fd), getpid(), 2000);
  EXPECT_NE(got, fd);
  EXPECT_EQ(contents(got, text.size()), text);
  close(got);
  close(fd);
}

// take() is refused with a message that holds `why`.
void expect_refused(const Ticket& ticket, int32_t pid, const std::string& why) {
  try {
    const int fd = take(ticket, pid, 2000);
    close(fd);
    ADD_FAILURE() << "a descriptor was handed over; expected a refusal: " << why;
  } catch (const Refused& err) {
    EXPECT_NE(std::string(err.what()).find(why), std::string::npos) << err.what();
  }
}

TEST_F(FdPassing, AnUnknownTokenIsRefused) {
  const int fd = file_with(fresh_text());
  Ticket ticket = offer(fd);
  ticket.token[5] ^= 1;
  expect_refused(ticket, getpid(), "no descriptor under this token");
  close(fd);
}

TEST_F(FdPassing, ASocketServedByAnotherProcessIsRefused) {
  const int fd = file_with(fresh_text());
  // The ticket claims another exporter than the process serving the socket.
  expect_refused(offer(fd), getpid() + 1, "not by the exporting process");
  close(fd);
}

TEST_F(FdPassing, AWithdrawnOfferIsRefused) {
  const int fd = file_with(fresh_text());
  const Ticket ticket = offer(fd);
  withdraw_all();
  EXPECT_THROW(take(ticket, getpid(), 2000), Refused);
  // Offers made after a withdrawal are served again, under a new socket name.
  const Ticket again = offer(fd);
  EXPECT_NE(std::string(again.socket), std::string(ticket.socket));
  const int got = take(again, getpid(), 2000);
  EXPECT_GE(got, 0);
  close(got);
  close(fd);
}

// The exporter's side of the check: a process of another user that connects and sends a valid
// token (bypassing take's own check of the exporter) gets no answer; the same raw request from
// this user gets the descriptor (the positive control).
int raw_request(const Ticket& ticket) {
  const int conn = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = strnlen(ticket.socket, sizeof(ticket.socket));
  std::memcpy(addr.sun_path + 1, ticket.socket, n);
  if (connect(conn, reinterpret_cast<sockaddr*>(&addr),
              static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) != 0) {
    return -2;
  }
  timeval tv{2, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)send(conn, ticket.token, sizeof(ticket.token), MSG_NOSIGNAL);
  char status = 0;
  const ssize_t got = recv(conn, &status, 1, 0);  // the descriptor, if any, is dropped
  close(conn);
  return got == 1 ? status : -1;
}

TEST_F(FdPassing, AProcessOfAnotherUserGetsNoAnswer) {
  const int fd = file_with(fresh_text());
  const Ticket ticket = offer(fd);
  EXPECT_EQ(raw_request(ticket), 1);
  if (geteuid() != 0) GTEST_SKIP() << "changing to another user needs root";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(9);
    _exit(raw_request(ticket) == -1 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  close(fd);
}

}  // namespace
}  // namespace pimhbm::peer::fd_passing
