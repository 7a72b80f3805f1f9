// LinkGroups: the names of one inode (hard links). Each name is a node of its own (a FUSE
// inode of its own); a group ties them so that a link, unlink or chmod through one name
// reaches the others, and a name loaded from the backing store joins the group of the
// other names of its backing inode.
//
// Not thread-safe by itself: NodeTable owns it under its lock (NodeTable::links()).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fs/namespace/node.h"

namespace ckptfs::fs {

class LinkGroups {
 public:
  // A name loaded from the backing store with several links joins the group of the other
  // names of its backing inode (`st`).
  void Adopt(const std::shared_ptr<Node>& node, const struct stat& st);
  // Adds `node` to group `group` (made for a new hard link).
  void Join(uint64_t group, const std::shared_ptr<Node>& node);
  // The live names of `group` other than `except`; forgets dead ones.
  std::vector<std::shared_ptr<Node>> Peers(uint64_t group, const Node* except);
  // `node` loses a name: the other names of its group count one link less. Journal entry
  // `seq` makes that true on the backing store: until then the others' attributes are not
  // refreshed from it.
  void Unlink(Node* node, uint64_t seq);
  // Gives the other names of `node`'s group its inode attributes (one inode), as entry
  // `seq` will on the backing store.
  void Sync(const Node* node, uint64_t seq);

 private:
  // Group -> its names (Node::link_group), and the backing inode it was found under, if any.
  struct Group {
    std::vector<std::weak_ptr<Node>> members;
    std::pair<dev_t, ino_t> backing{0, 0};
  };
  std::unordered_map<uint64_t, Group> groups_;
  std::map<std::pair<dev_t, ino_t>, uint64_t> backing_links_;
};

}  // namespace ckptfs::fs
