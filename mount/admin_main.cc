// ckptfs-admin: see mount/admin.h.
#include <iostream>
#include <string>
#include <vector>

#include "mount/admin.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return ckptfs::admin::RunAdmin(args, ckptfs::admin::SystemEnv(), std::cout, std::cerr);
}
