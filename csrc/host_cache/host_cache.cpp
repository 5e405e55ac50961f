// A host (CPU) allocator that keeps large freed blocks for the next request of the same size,
// without ever holding more than the rank's own high-water mark.
//
// A training step allocates and frees the same large tensors in the same order every step:
// activations, their gradients, each parameter's gradient, ZeRO-3's gathered units, the logits.
// glibc hands each freed block of at least its mmap threshold back to the OS, and serves smaller
// ones from a heap that fragments, so every step touches fresh pages again (tens of thousands of
// page faults per step on a 21M GPT; see bench/RESULTS.md). This allocator sits in front of
// torch's CPU allocator (c10::SetCPUAllocator) and keeps every freed block of at least
// `min_bytes`, keyed by its exact size; the next allocation of that size takes it back, pages
// already mapped.
//
// The bound. Let `live` be the bytes of large blocks in use, `peak` the most `live` has ever been,
// and `cached` the bytes kept. A free moves bytes from live to cached; a hit moves them back; a
// miss first frees the oldest kept blocks while live + n + cached exceeds max(peak, live + n) +
// `slack`. So live + cached never exceeds the high-water mark of live plus `slack`: with no slack
// the cache never raises a rank's peak memory, it only keeps what the rank already needed at its
// peak. The price of no slack: a block freed before the peak and needed after it cannot be kept
// across the peak, so those sizes are allocated afresh every step. `empty()` hands everything
// back and restarts the high-water mark (a strategy calls it when its set-up is done).
//
// Blocks of at least `min_bytes` are anonymous mappings of their own (mmap), so a block the cache
// lets go of leaves the rank's resident memory at once and the bound holds for what the OS counts
// (from glibc's heap, a freed block can stay resident; measured on the 118M GPT's zero3: peak RSS
// 1.99 GB through glibc, 1.91 GB with mappings, 1.94 GB without the cache). Smaller blocks go to
// the allocator that was installed before (torch's default), with its own deleter; so do all
// blocks while the cache is not installed.
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Block = std::pair<size_t, void*>;  // (bytes, address)

// Large blocks get their own anonymous mapping, so a block the cache lets go of (munmap) really
// leaves the rank's resident memory; from glibc's heap it could stay resident there, and the
// bound below would not hold for what the OS counts.
void* map_block(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "zerotrain host cache: can't allocate memory: you tried to "
                   "allocate ", n, " bytes (mmap: ", std::strerror(errno), ")");
  return p;
}

void unmap_blocks(const std::vector<Block>& blocks) {
  for (const Block& b : blocks) {
    munmap(b.second, b.first);
  }
}

class HostCache final : public c10::Allocator {
 public:
  static HostCache& get() {
    static HostCache* cache = new HostCache();  // never destroyed: tensors may outlive exit
    return *cache;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_.load(std::memory_order_relaxed) || !installed_.load(std::memory_order_relaxed)) {
      return previous_->allocate(n);
    }
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto it = by_size_.find(n);
      if (it != by_size_.end() && !it->second.empty()) {
        auto pos = it->second.back();  // the most recently freed block of this size
        it->second.pop_back();
        void* p = pos->second;
        aged_.erase(pos);
        cached_ -= n;
        ++hits_;
        return in_use(p, n);
      }
      ++misses_;
      const size_t need = live_ + n;
      const size_t limit = (need > peak_ ? need : peak_) + slack_;
      while (cached_ > 0 && need + cached_ > limit) {
        evicted.push_back(take_oldest());
      }
    }
    unmap_blocks(evicted);
    void* p = map_block(n);  // throws on failure; nothing recorded yet
    std::lock_guard<std::mutex> guard(mu_);
    return in_use(p, n);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &HostCache::release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool install(int64_t min_bytes, int64_t slack_bytes) {
    std::lock_guard<std::mutex> guard(mu_);
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != this) {
      previous_ = current;
    }
    min_bytes_ = static_cast<size_t>(min_bytes < 1 ? 1 : min_bytes);  // before installing
    slack_ = static_cast<size_t>(slack_bytes < 0 ? 0 : slack_bytes);
    c10::SetCPUAllocator(this, /*priority=*/0);
    installed_ = c10::GetCPUAllocator() == this;
    return installed_;
  }

  void uninstall() {
    std::vector<Block> freed;
    {
      std::lock_guard<std::mutex> guard(mu_);
      if (installed_ && previous_ != nullptr) {
        c10::SetCPUAllocator(previous_, /*priority=*/0);
      }
      installed_ = false;
      while (cached_ > 0) {
        freed.push_back(take_oldest());
      }
    }
    unmap_blocks(freed);
  }

  int64_t empty() {
    std::vector<Block> freed;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> guard(mu_);
      bytes = static_cast<int64_t>(cached_);
      while (cached_ > 0) {
        freed.push_back(take_oldest());
      }
      peak_ = live_;  // the next phase sets its own high-water mark
    }
    unmap_blocks(freed);
    return bytes;
  }

  std::unordered_map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> guard(mu_);
    return {{"installed", installed_ ? 1 : 0},      {"min_bytes", static_cast<int64_t>(min_bytes_.load())},
            {"slack_bytes", static_cast<int64_t>(slack_)},
            {"live_bytes", static_cast<int64_t>(live_)}, {"cached_bytes", static_cast<int64_t>(cached_)},
            {"peak_bytes", static_cast<int64_t>(peak_)}, {"hits", hits_},
            {"misses", misses_},                        {"evicted", evicted_},
            {"cached_blocks", static_cast<int64_t>(aged_.size())}};
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  using Aged = std::list<std::pair<size_t, void*>>;

  HostCache() = default;

  static void release(void* p) {
    get().give_back(p);
  }

  void give_back(void* p) {
    enum { kKept, kFree, kForeign } what = kFree;
    c10::DeleterFnPtr foreign = nullptr;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto it = sizes_.find(p);
      if (it == sizes_.end()) {
        // A small block from the previous allocator, handed back through raw_deallocate
        // (raw_allocate keeps the context and drops the DataPtr's own deleter).
        what = kForeign;
        foreign = previous_ != nullptr ? previous_->raw_deleter() : nullptr;
      } else {
        n = it->second;
        sizes_.erase(it);
        live_ -= n;
        if (installed_) {
          aged_.emplace_back(n, p);
          by_size_[n].push_back(std::prev(aged_.end()));
          cached_ += n;
          what = kKept;
        }
      }
    }
    if (what == kForeign) {
      TORCH_CHECK(foreign != nullptr, "zerotrain host cache: a block it did not allocate, and no deleter for it");
      foreign(p);
    } else if (what == kFree) {
      munmap(p, n);
    }
  }

  // With mu_ held: book `p` (n bytes) as in use and hand it out.
  c10::DataPtr in_use(void* p, size_t n) {
    sizes_[p] = n;
    live_ += n;
    if (live_ > peak_) {
      peak_ = live_;
    }
    return {p, p, &HostCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  // With mu_ held: drop the oldest kept block from the books and return it (to be unmapped unlocked).
  Block take_oldest() {
    auto pos = aged_.begin();
    const size_t n = pos->first;
    void* p = pos->second;
    auto& same = by_size_[n];
    for (auto it = same.begin(); it != same.end(); ++it) {
      if (*it == pos) {
        same.erase(it);
        break;
      }
    }
    if (same.empty()) {
      by_size_.erase(n);
    }
    aged_.erase(pos);
    cached_ -= n;
    ++evicted_;
    return {n, p};
  }

  std::mutex mu_;
  c10::Allocator* previous_ = nullptr;
  std::atomic<bool> installed_{false};     // read unlocked on every allocation
  std::atomic<size_t> min_bytes_{1 << 20};
  size_t slack_ = 0;  // bytes the kept blocks may add above the high-water mark
  std::unordered_map<void*, size_t> sizes_;  // blocks in use that came from this cache
  Aged aged_;                                 // kept blocks, oldest first
  std::unordered_map<size_t, std::vector<Aged::iterator>> by_size_;
  size_t live_ = 0, cached_ = 0, peak_ = 0;
  int64_t hits_ = 0, misses_ = 0, evicted_ = 0;
};

// A fork (a DataLoader worker) must not copy the mutex while another thread holds it.
void before_fork() { HostCache::get().lock(); }
void after_fork() { HostCache::get().unlock(); }
const int kAtFork = pthread_atfork(before_fork, after_fork, after_fork);

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  (void)kAtFork;
  m.def("install", [](int64_t min_bytes, int64_t slack_bytes) { return HostCache::get().install(min_bytes, slack_bytes); },
        "Put the cache in front of torch's CPU allocator for blocks of at least min_bytes, keeping "
        "at most slack_bytes above the high-water mark of the blocks in use");
  m.def("uninstall", []() { HostCache::get().uninstall(); },
        "Restore the allocator that was there before and free every kept block");
  m.def("empty", []() { return HostCache::get().empty(); },
        "Free every kept block and restart the high-water mark; returns the bytes freed");
  m.def("stats", []() { return HostCache::get().stats(); }, "Counters and byte totals");
}
