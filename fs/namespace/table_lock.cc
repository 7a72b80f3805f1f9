// RaceRetry's I/O tokens (fs/namespace/table_lock.h).
#include "fs/namespace/table_lock.h"

#include <algorithm>

namespace ckptfs::fs {

void RaceRetry::Enter(NodeTable& table, const std::shared_ptr<Node>& node) {
  if (!node || thread_token_ != nullptr) return;
  // The holder's I/O goes first: a try of this call (a copy, an open) could make it lose.
  if (HeldLocked(table, node.get(), Change::kTry)) {
    const Node* n = node.get();
    TableLock::Await(table, table.io_token_cv_, [&table, n]() REQUIRES(table.mu()) {
      return !HeldLocked(table, n, Change::kTry);
    });
  }
  if (lost_ < kRaceTries) return;
  table.io_tokens_.push_back({node.get()});
  table_ = &table;
  token_node_ = node;
  thread_token_ = node.get();
}

void RaceRetry::EnterUnlocked(NodeTable& table, const std::shared_ptr<Node>& node) {
  if (lost_ < kRaceTries || !node || thread_token_ != nullptr) return;
  TableLock lock(table);
  Enter(table, node);
}

bool RaceRetry::AwaitTokenHolders(NodeTable& table, const Node* node, Change change) {
  if (thread_token_ != nullptr || !HeldLocked(table, node, change)) return false;
  TableLock::Await(table, table.io_token_cv_, [&table, node, change]() REQUIRES(table.mu()) {
    return !HeldLocked(table, node, change);
  });
  return true;
}

bool RaceRetry::HeldLocked(const NodeTable& table, const Node* node, Change change) {
  const bool below = change == Change::kMove;
  for (const NodeTable::IoToken& held : table.io_tokens_) {
    if (change == Change::kPublish && held.awaiting_journal) continue;
    for (const Node* n = held.node; n != nullptr; n = below ? n->parent : nullptr) {
      if (n == node) return true;
    }
  }
  return false;
}

void RaceRetry::MarkAwaitingJournal(NodeTable& table, bool awaiting) {
  if (!token_node_) return;
  for (NodeTable::IoToken& held : table.io_tokens_) {
    if (held.node == token_node_.get()) held.awaiting_journal = awaiting;
  }
  if (awaiting) table.io_token_cv_.notify_all();
}

void RaceRetry::GiveBack() {
  if (!token_node_) return;
  {
    MutexLock lock(&table_->mu_);
    auto& held = table_->io_tokens_;
    // Always there (Enter pushes it before token_node_ is set); checked all the same.
    auto it = std::find_if(held.begin(), held.end(), [this](const NodeTable::IoToken& t) {
      return t.node == token_node_.get();
    });
    if (it != held.end()) held.erase(it);
    table_->io_token_cv_.notify_all();
  }
  thread_token_ = nullptr;
  token_node_.reset();
}

}  // namespace ckptfs::fs
