#include "common/status.h"

namespace ckptfs {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kNotFound: return "NotFound";
    case Code::kExists: return "Exists";
    case Code::kInvalid: return "Invalid";
    case Code::kPermission: return "Permission";
    case Code::kNoSpace: return "NoSpace";
    case Code::kIo: return "IO";
    case Code::kBusy: return "Busy";
    case Code::kNotEmpty: return "NotEmpty";
    case Code::kNotDir: return "NotDir";
    case Code::kIsDir: return "IsDir";
    case Code::kUnsupported: return "Unsupported";
    case Code::kCorrupt: return "Corrupt";
    case Code::kTimeout: return "Timeout";
    case Code::kAborted: return "Aborted";
    case Code::kInternal: return "Internal";
    case Code::kNameTooLong: return "NameTooLong";
    case Code::kTooManyOpenFiles: return "TooManyOpenFiles";
    case Code::kNotPermitted: return "NotPermitted";
    case Code::kTooManyLinks: return "TooManyLinks";
    case Code::kSuperseded: return "Superseded";
    case Code::kNodeLost: return "NodeLost";
    case Code::kCrossDevice: return "CrossDevice";
  }
  return "Unknown";
}

Status Status::FromErrno(int err, std::string_view context) {
  Code code;
  switch (err) {
    case 0: return Status();
    case ENOENT: code = Code::kNotFound; break;
    case EEXIST: code = Code::kExists; break;
    case ENAMETOOLONG: code = Code::kNameTooLong; break;
    case EINVAL: case ELOOP: case EXDEV: code = Code::kInvalid; break;
    case EACCES: case EPERM: case EROFS: code = Code::kPermission; break;
    case ENOSPC: case EDQUOT: code = Code::kNoSpace; break;
    case EBUSY: code = Code::kBusy; break;
    case ENOTEMPTY: code = Code::kNotEmpty; break;
    case ENOTDIR: code = Code::kNotDir; break;
    case EISDIR: code = Code::kIsDir; break;
    case ENOTSUP: case ENOSYS: code = Code::kUnsupported; break;
    case EMFILE: case ENFILE: code = Code::kTooManyOpenFiles; break;
    case EMLINK: code = Code::kTooManyLinks; break;
    default: code = Code::kIo; break;
  }
  std::string msg(context);
  msg += ": ";
  msg += std::strerror(err);
  return Status(code, std::move(msg));
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

int Status::ToErrno() const {
  switch (code_) {
    case Code::kOk: return 0;
    case Code::kNoSpace: return ENOSPC;
    case Code::kNotFound: return ENOENT;
    case Code::kExists: return EEXIST;
    case Code::kInvalid: return EINVAL;
    case Code::kPermission: return EACCES;
    case Code::kBusy: return EBUSY;
    case Code::kNotEmpty: return ENOTEMPTY;
    case Code::kNotDir: return ENOTDIR;
    case Code::kIsDir: return EISDIR;
    case Code::kUnsupported: return ENOTSUP;
    case Code::kNameTooLong: return ENAMETOOLONG;
    // The message keeps which of EMFILE and ENFILE it was; the caller sees EMFILE.
    case Code::kTooManyOpenFiles: return EMFILE;
    case Code::kNotPermitted: return EPERM;
    case Code::kTooManyLinks: return EMLINK;
    case Code::kCrossDevice: return EXDEV;
    default: return EIO;
  }
}

}  // namespace ckptfs
