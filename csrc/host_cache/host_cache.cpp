// A host (CPU) allocator that keeps large freed blocks and hands their pages to the next large
// allocations, without ever holding more than the rank's own high-water mark.
//
// A training step allocates and frees the same large tensors every step: activations, their
// gradients, each parameter's gradient, ZeRO-3's gathered units, the logits. glibc hands each
// freed block of at least its mmap threshold back to the OS, and serves smaller ones from a heap
// that fragments, so every step touches fresh pages again (tens of thousands of page faults per
// step on a 21M GPT; see bench/RESULTS.md). This allocator sits in front of torch's CPU allocator
// (c10::SetCPUAllocator) and keeps every freed block of at least `min_bytes`. An allocation takes,
// in this order:
//   - a kept block of its size (in pages), the most recently freed one: a hit;
//   - else the first pages of the smallest larger kept block, whose rest stays kept (carved);
//   - else a new mapping into which the largest kept blocks move their pages (mremap: the page
//     tables change hands, nothing is copied or faulted), fresh pages only where they run out
//     (assembled).
// So pages are faulted in only when the blocks in use reach a new high, not when the sizes of a
// step's allocations differ from those freed before them.
//
// The bound. Let `live` be the bytes of large blocks in use, `peak` the most `live` has ever been,
// and `cached` the bytes kept. A free moves bytes from live to cached; an allocation moves kept
// pages back to live and maps fresh ones only for what the kept ones lack, so live + cached never
// exceeds the high-water mark of live. An assembled block takes pages from fewer than kMaxSegs
// mappings; if that leaves pages kept, the oldest kept blocks are freed while live + n + cached
// would exceed max(peak, live + n) + `slack`. With no slack the cache never raises a rank's peak
// memory: it only keeps what the rank already needed at its peak. `empty()` hands everything back
// and restarts the high-water mark (a strategy calls it when its set-up is done).
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
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t round_to_pages(size_t n) {
  const size_t page = page_size();
  return (n + page - 1) / page * page;
}

// A run of a block's pages that lies inside one kernel mapping. mremap moves a range that lies
// inside one mapping, and a block made of moved pages spans several, so it remembers its runs.
struct Seg {
  size_t off, len;
};

struct Block {
  char* p = nullptr;
  size_t n = 0;  // bytes, a whole number of pages
  std::vector<Seg> segs;
};

// An assembled block takes pages from fewer than kMaxSegs runs, and none once the blocks in use
// and kept hold kMaxRuns runs in all; the rest of it is mapped afresh. This bounds the mappings a
// rank holds (vm.max_map_count is 65530 by default). On the 118M GPT's zero2, 16 runs per block
// left 53 MiB per step to be mapped afresh, 64 none (660 mappings in the process).
constexpr size_t kMaxSegs = 64;
constexpr size_t kMaxRuns = 16384;

// Large blocks get their own anonymous mapping, so a block the cache lets go of (munmap) really
// leaves the rank's resident memory; from glibc's heap it could stay resident there, and the
// bound below would not hold for what the OS counts.
char* map_block(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

void unmap_blocks(const std::vector<Block>& blocks) {
  for (const Block& b : blocks) {
    munmap(b.p, b.n);
  }
}

// The first m bytes of b and the rest, each with its runs.
std::pair<Block, Block> split(Block b, size_t m) {
  Block head{b.p, m, {}}, tail{b.p + m, b.n - m, {}};
  for (const Seg& s : b.segs) {
    if (s.off + s.len <= m) {
      head.segs.push_back(s);
    } else if (s.off >= m) {
      tail.segs.push_back({s.off - m, s.len});
    } else {
      head.segs.push_back({s.off, m - s.off});
      tail.segs.push_back({0, s.off + s.len - m});
    }
  }
  return {std::move(head), std::move(tail)};
}

// A new mapping of m bytes whose first pages are the pages of `pieces`, moved (mremap: page-table
// entries change hands, nothing is copied or faulted); the rest is fresh. Null if mmap fails.
// `unmoved`: the bytes of pieces whose move failed (fresh pages stand in for them).
Block assemble(std::vector<Block>& pieces, size_t m, size_t& unmoved) {
  unmoved = 0;
  Block out{map_block(m), m, {}};
  if (out.p == nullptr) {
    const int error = errno;
    unmap_blocks(pieces);
    errno = error;
    return out;
  }
  std::vector<std::pair<Seg, bool>> runs;  // (run, moved); unmoved runs stay in out's first mapping
  size_t base = 0;
  for (const Block& b : pieces) {
    for (const Seg& s : b.segs) {
      void* moved = mremap(b.p + s.off, s.len, s.len, MREMAP_MAYMOVE | MREMAP_FIXED, out.p + base + s.off);
      if (moved == MAP_FAILED) {
        munmap(b.p + s.off, s.len);  // those pages are lost; out keeps fresh ones there
        unmoved += s.len;
      }
      runs.push_back({{base + s.off, s.len}, moved != MAP_FAILED});
    }
    base += b.n;
  }
  if (base < m) {
    runs.push_back({{base, m - base}, false});
  }
  // Each moved run is a mapping of its own; adjacent unmoved runs are one piece of out's mapping.
  bool last_moved = true;
  for (const auto& [run, moved] : runs) {
    if (!moved && !last_moved && !out.segs.empty()) {
      out.segs.back().len += run.len;
    } else {
      out.segs.push_back(run);
    }
    last_moved = moved;
  }
  return out;
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
    const size_t m = round_to_pages(n);
    std::vector<Block> pieces, evicted;
    size_t have = 0;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto same = by_size_.find(m);
      if (same != by_size_.end()) {  // the most recently freed block of this size
        ++hits_;
        return in_use(take(same->second.back()));
      }
      ++misses_;
      auto larger = by_size_.lower_bound(m);
      if (larger != by_size_.end()) {  // the smallest larger block: its first m bytes, no system call
        auto [head, tail] = split(take(larger->second.back()), m);
        keep(std::move(tail));
        ++carved_;
        return in_use(std::move(head));
      }
      // Every kept block is smaller: the largest ones give their pages to a new mapping.
      size_t runs = 0;
      while (have < m && !by_size_.empty()) {
        Aged::iterator pos = std::prev(by_size_.end())->second.back();
        // runs_ + runs: every block's runs, the ones moved so far included (take() moved them
        // off runs_); moving more leaves that total as it is.
        if (runs + pos->segs.size() >= kMaxSegs || runs_ + runs >= kMaxRuns) {
          break;
        }
        Block b = take(pos);
        if (have + b.n > m) {
          auto [head, tail] = split(std::move(b), m - have);
          keep(std::move(tail));
          b = std::move(head);
        }
        have += b.n;
        runs += b.segs.size();
        pieces.push_back(std::move(b));
      }
      // Fresh pages only where the kept ones ran out, so this binds only when kMaxSegs or
      // kMaxRuns stopped the loop above with pages still kept.
      const size_t need = live_ + m;
      const size_t limit = (need > peak_ ? need : peak_) + slack_;
      while (cached_ > 0 && need + cached_ > limit) {
        evicted.push_back(take(aged_.begin()));
        ++evicted_;
      }
      if (!pieces.empty()) {
        ++assembled_;
      }
      fresh_ += m - have;
      live_ += m;  // booked now, so that the bound holds for another thread meanwhile
    }
    unmap_blocks(evicted);
    size_t unmoved = 0;
    const bool assembling = !pieces.empty();
    Block b = assemble(pieces, m, unmoved);
    const int error = errno;
    std::lock_guard<std::mutex> guard(mu_);
    live_ -= m;
    if (b.p == nullptr) {  // nothing was mapped: un-book what the lock above counted
      fresh_ -= m - have;
      assembled_ -= assembling ? 1 : 0;
    } else {
      fresh_ += unmoved;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, b.p != nullptr, "zerotrain host cache: can't allocate memory: you tried "
                     "to allocate ", n, " bytes (mmap: ", std::strerror(error), ")");
    return in_use(std::move(b));
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
      freed = take_all();
    }
    unmap_blocks(freed);
  }

  int64_t empty() {
    std::vector<Block> freed;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> guard(mu_);
      bytes = static_cast<int64_t>(cached_);
      freed = take_all();
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
            {"misses", misses_},                        {"carved", carved_},
            {"assembled", assembled_},                  {"evicted", evicted_},
            {"fresh_bytes", fresh_},                    {"cached_blocks", static_cast<int64_t>(aged_.size())},
            {"runs", static_cast<int64_t>(runs_)}};
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  using Aged = std::list<Block>;

  HostCache() = default;

  static void release(void* p) {
    get().give_back(p);
  }

  void give_back(void* p) {
    enum { kKept, kFree, kForeign } what = kFree;
    c10::DeleterFnPtr foreign = nullptr;
    Block b;
    {
      std::lock_guard<std::mutex> guard(mu_);
      auto it = in_use_.find(p);
      if (it == in_use_.end()) {
        // A small block from the previous allocator, handed back through raw_deallocate
        // (raw_allocate keeps the context and drops the DataPtr's own deleter).
        what = kForeign;
        foreign = previous_ != nullptr ? previous_->raw_deleter() : nullptr;
      } else {
        b = std::move(it->second);
        in_use_.erase(it);
        runs_ -= b.segs.size();
        live_ -= b.n;
        if (installed_) {
          keep(std::move(b));
          what = kKept;
        }
      }
    }
    if (what == kForeign) {
      TORCH_CHECK(foreign != nullptr, "zerotrain host cache: a block it did not allocate, and no deleter for it");
      foreign(p);
    } else if (what == kFree) {
      munmap(b.p, b.n);
    }
  }

  // With mu_ held: book `b` as in use and hand it out.
  c10::DataPtr in_use(Block b) {
    void* p = b.p;
    runs_ += b.segs.size();
    live_ += b.n;
    if (live_ > peak_) {
      peak_ = live_;
    }
    in_use_[p] = std::move(b);
    return {p, p, &HostCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  // With mu_ held: keep `b` as the newest block of its size.
  void keep(Block b) {
    const size_t n = b.n;
    runs_ += b.segs.size();
    aged_.push_back(std::move(b));
    by_size_[n].push_back(std::prev(aged_.end()));
    cached_ += n;
  }

  // With mu_ held: take the kept block at `pos` off the books.
  Block take(Aged::iterator pos) {
    const size_t n = pos->n;
    auto same = by_size_.find(n);
    auto& list = same->second;
    list.erase(std::find(list.begin(), list.end(), pos));
    if (list.empty()) {
      by_size_.erase(same);
    }
    Block b = std::move(*pos);
    runs_ -= b.segs.size();
    aged_.erase(pos);
    cached_ -= n;
    return b;
  }

  // With mu_ held: take every kept block off the books (to be unmapped unlocked).
  std::vector<Block> take_all() {
    std::vector<Block> all;
    while (!aged_.empty()) {
      all.push_back(take(aged_.begin()));
    }
    return all;
  }

  std::mutex mu_;
  c10::Allocator* previous_ = nullptr;
  std::atomic<bool> installed_{false};     // read unlocked on every allocation
  std::atomic<size_t> min_bytes_{1 << 20};
  size_t slack_ = 0;  // bytes the kept blocks may add above the high-water mark
  std::unordered_map<void*, Block> in_use_;  // blocks in use that came from this cache
  Aged aged_;                                 // kept blocks, oldest first
  std::map<size_t, std::vector<Aged::iterator>> by_size_;  // kept blocks by size, each oldest first
  size_t live_ = 0, cached_ = 0, peak_ = 0;
  size_t runs_ = 0;  // runs of the blocks in use and kept (each at least one mapping)
  int64_t hits_ = 0, misses_ = 0, carved_ = 0, assembled_ = 0, evicted_ = 0;
  int64_t fresh_ = 0;  // bytes mapped afresh (pages not taken from kept blocks)
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
