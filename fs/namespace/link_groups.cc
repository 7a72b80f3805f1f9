#include "fs/namespace/link_groups.h"

#include <algorithm>

#include "fs/fs_util.h"

namespace ckptfs::fs {

void LinkGroups::Join(uint64_t group, const std::shared_ptr<Node>& node) {
  groups_[group].members.push_back(node);
}

void LinkGroups::Adopt(const std::shared_ptr<Node>& node, const struct stat& st) {
  if (node->type == NodeType::kDir || st.st_nlink <= 1 || node->link_group != 0) return;
  const std::pair<dev_t, ino_t> key{st.st_dev, st.st_ino};
  auto [it, fresh] = backing_links_.emplace(key, node->ino);
  // A group whose names all went away may have left its key behind.
  if (!fresh && groups_.count(it->second) == 0) it->second = node->ino;
  node->link_group = it->second;
  Group& group = groups_[node->link_group];
  group.backing = key;
  group.members.push_back(node);
}

std::vector<std::shared_ptr<Node>> LinkGroups::Peers(uint64_t group, const Node* except) {
  std::vector<std::shared_ptr<Node>> peers;
  auto it = groups_.find(group);
  if (it == groups_.end()) return peers;
  auto& members = it->second.members;
  for (auto m = members.begin(); m != members.end();) {
    std::shared_ptr<Node> node = m->lock();
    if (!node) {
      m = members.erase(m);
      continue;
    }
    if (node.get() != except && node->parent != nullptr) peers.push_back(std::move(node));
    ++m;
  }
  if (members.empty()) {
    if (it->second.backing.second != 0) backing_links_.erase(it->second.backing);
    groups_.erase(it);
  }
  return peers;
}

void LinkGroups::Unlink(Node* node, uint64_t seq) {
  if (node->link_group == 0) return;
  for (const auto& other : Peers(node->link_group, node)) {
    if (other->attr.st_nlink > 1) other->attr.st_nlink--;
    other->attr.st_ctim = Now();
    other->pending_seq = std::max(other->pending_seq, seq);
  }
}

void LinkGroups::Sync(const Node* node, uint64_t seq) {
  if (node->link_group == 0) return;
  for (const auto& other : Peers(node->link_group, node)) {
    other->pending_seq = std::max(other->pending_seq, seq);
    other->attr.st_mode = node->attr.st_mode;
    other->attr.st_uid = node->attr.st_uid;
    other->attr.st_gid = node->attr.st_gid;
    other->attr.st_atim = node->attr.st_atim;
    other->attr.st_mtim = node->attr.st_mtim;
    other->attr.st_ctim = node->attr.st_ctim;
  }
}

}  // namespace ckptfs::fs
