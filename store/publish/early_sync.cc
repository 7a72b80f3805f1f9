#include "store/publish/early_sync.h"

#include <spdlog/spdlog.h>

#include "common/thread_name.h"

namespace ckptfs::store {

EarlySyncs::EarlySyncs(BackingDir* dir, int threads) : dir_(dir) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      NameThisThread("ckptfs-presync");
      Run();
    });
  }
}

EarlySyncs::~EarlySyncs() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void EarlySyncs::Submit(std::shared_ptr<FlushTarget> target) {
  if (threads_.empty() || !target) return;
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(target));
  }
  cv_.notify_one();
}

void EarlySyncs::Run() {
  MutexLock lock(&mu_);
  for (;;) {
    cv_.wait(lock.native(), [&] {
      mu_.AssertHeld();  // the predicate runs under the lock
      return stop_ || !queue_.empty();
    });
    if (stop_) return;
    std::shared_ptr<FlushTarget> target = std::move(queue_.front());
    queue_.pop_front();
    lock.Unlock();
    // The publisher may have synced it first (and published it): a second fsync would only
    // cost a flush, and a failure of it would mark bytes lost that are published.
    Status st = target->Sync(dir_, /*unless_synced=*/true);
    if (st.ok()) {
      done_.fetch_add(1, std::memory_order_relaxed);
    } else {
      spdlog::debug("journal: early sync of file {}: {}", target->id(), st.ToString());
    }
    target.reset();
    lock.Lock();
  }
}

}  // namespace ckptfs::store
