// Status and Result<T>: the error type of every fallible ckptfs call.
//
// No exception crosses a module boundary or a FUSE callback. A Status carries a
// code and a message; only fs/ turns a status into an errno for a caller, through
// Status::ToErrno (the one mapping).
#pragma once

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ckptfs {

enum class Code {
  kOk = 0,
  kNotFound,
  kExists,
  kInvalid,
  kPermission,
  kNoSpace,
  kIo,
  kBusy,
  kNotEmpty,
  kNotDir,
  kIsDir,
  kUnsupported,
  kCorrupt,
  kTimeout,
  kAborted,
  kInternal,
  kNameTooLong,
  // The daemon ran out of file descriptors (EMFILE, ENFILE): transient, clears when
  // files are closed. Distinct from kBusy so callers see EMFILE, not EBUSY.
  kTooManyOpenFiles,
  // POSIX's "operation not permitted" (EPERM): the caller is not the owner (chown, chmod,
  // explicit utimes, a sticky directory). Distinct from kPermission (EACCES: mode bits).
  kNotPermitted,
  // EMLINK: a file with several hard links cannot be rewritten (see docs/SEMANTICS.md).
  kTooManyLinks,
  // A commit that a later save into the same directory replaced before it could be
  // published (docs/SEMANTICS.md, "Superseded saves"): not a failure of anything.
  kSuperseded,
  // Given up because a node it waits for was declared dead (issue 39, docs/SEMANTICS.md,
  // "A lost node"): a commit whose shards were that node's, a tracker naming such a
  // checkpoint. Skipped without halting publication; the checkpoint is failed.
  kNodeLost,
  // EXDEV: a rename between a memory-only tree (issue 42) and the rest of the mount.
  kCrossDevice,
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  // Maps an errno value to a Status, keeping `context` (a path, an op) in the message.
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;
  // The errno an OS call would have produced for this status.
  int ToErrno() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
inline Status Invalid(std::string m) { return Status(Code::kInvalid, std::move(m)); }
inline Status Corrupt(std::string m) { return Status(Code::kCorrupt, std::move(m)); }
inline Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }
inline Status Unsupported(std::string m) { return Status(Code::kUnsupported, std::move(m)); }

// Holds either a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status(Code::kInternal, "Result built from ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  // By value, not T&&: `for (auto& x : Make().value())` must not bind to a dead temporary.
  T value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ckptfs

#define CKPT_CONCAT_INNER(a, b) a##b
#define CKPT_CONCAT(a, b) CKPT_CONCAT_INNER(a, b)

#define CKPT_RETURN_IF_ERROR(expr)           \
  do {                                       \
    ::ckptfs::Status _st = (expr);           \
    if (!_st.ok()) return _st;               \
  } while (0)

#define CKPT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL(CKPT_CONCAT(_res_, __LINE__), lhs, expr)
