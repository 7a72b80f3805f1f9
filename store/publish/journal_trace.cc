// The journal's trace file (store/publish/journal_trace.h).
#include "store/publish/journal_trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <utility>

namespace ckptfs::store {

Result<std::unique_ptr<JournalTrace>> JournalTrace::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, "journal trace " + path);
  return std::unique_ptr<JournalTrace>(new JournalTrace(UniqueFd(fd)));
}

void JournalTrace::Start(uint64_t epoch) const { Write("start " + std::to_string(epoch) + "\n"); }

void JournalTrace::Recovered(const char* what, const JournalEntry& e) const {
  Write(std::string(what) + " " + std::to_string(e.seq) + " " + OpName(e.op) + " " + e.path +
        "\n");
}

void JournalTrace::Done(const JournalEntry& e, bool applied) const {
  Write("done " + std::to_string(e.seq) + " " + OpName(e.op) + " " + (applied ? "1 " : "0 ") +
        e.path + "\n");
}

void JournalTrace::Write(const std::string& line) const {
  // A diagnosis: a failed or short write loses a line, never the entry.
  (void)!::write(fd_.get(), line.data(), line.size());
}

}  // namespace ckptfs::store
