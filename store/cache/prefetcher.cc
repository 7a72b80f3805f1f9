#include "store/cache/prefetcher.h"

#include <system_error>
#include <utility>

#include "common/thread_name.h"

namespace ckptfs::store {

Result<std::unique_ptr<Prefetcher>> Prefetcher::Create(int threads, size_t max_queued,
                                                       Fetch fetch) {
  if (threads < 0) return Invalid("prefetcher: negative thread count");
  if (!fetch) return Invalid("prefetcher: no fetch function");
  std::unique_ptr<Prefetcher> p(new Prefetcher(max_queued, std::move(fetch)));
  try {
    for (int i = 0; i < threads; ++i) {
      p->threads_.emplace_back([raw = p.get()] {
        NameThisThread("ckptfs-prefetch");
        raw->Loop();
      });
    }
  } catch (const std::system_error& e) {
    return Status(Code::kInternal, std::string("prefetcher: cannot start threads: ") + e.what());
  }
  return p;
}

Prefetcher::~Prefetcher() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    dropped_ += queue_.size();
    queue_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool Prefetcher::Enqueue(PrefetchRequest request, bool urgent) {
  {
    MutexLock lock(&mu_);
    if (stop_ || threads_.empty() || queue_.size() >= max_queued_) {
      ++dropped_;
      return false;
    }
    if (urgent) {
      queue_.push_front(std::move(request));
    } else {
      queue_.push_back(std::move(request));
    }
  }
  cv_.notify_all();  // several threads may share one long request
  return true;
}

uint64_t Prefetcher::dropped() const {
  MutexLock lock(&mu_);
  return dropped_;
}

void Prefetcher::Loop() {
  MutexLock lock(&mu_);
  while (true) {
    while (!stop_ && queue_.empty()) cv_.wait(lock.native());
    if (stop_) return;
    PrefetchRequest& req = queue_.front();
    const BlockId id = req.id;
    const uint64_t index = req.next++;
    const uint64_t tick = req.tick;
    if (req.next > req.last) queue_.pop_front();
    lock.Unlock();
    const bool fetched = fetch_(id, index, tick);
    lock.Lock();
    if (!fetched) {
      // The cache is full of blocks in use: drop the rest of this request.
      if (!queue_.empty() && queue_.front().tick == tick && queue_.front().id == id) {
        queue_.pop_front();
      }
      ++dropped_;
    }
  }
}

}  // namespace ckptfs::store
