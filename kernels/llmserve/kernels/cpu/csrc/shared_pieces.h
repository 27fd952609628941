// Parallel loops whose items the intra-op threads take a piece at a time from one shared
// counter, instead of at::parallel_for's one fixed share per thread.
//
// Why: the threads of one loop do not run at one speed on the hosts we serve from. A
// small cluster's router, scheduler and clients share the worker's cores, and a VM's
// vCPUs share their physical cores (caches, memory, AMX units) with other guests. With
// fixed shares a loop ends when its slowest thread does while the others wait at its
// barrier; taken pieces let them run a slowed thread's remaining items meanwhile. Items
// of unequal cost (decode attention over sequences of different lengths, a causal
// chunk's query tiles) balance the same way.
//
// NOTE: on a 2-core Xeon VM (AMX) whose vCPUs ran one matmul thread at 310 and 520-720
// GFLOP/s in the same minute, pieces against fixed shares: the bfloat16 reference workload
// 1.25x (median of 12 paired runs, 0.95-1.30x), decode steps at batch 8 and 64 1.03-1.25x,
// and less slowdown beside a process waking on the cores (docs/benchmarks.md, "Work
// taken in pieces").
//
// Pieces are consecutive items taken in ascending order, so the threads together still
// walk memory front to back, and an item's result never depends on the thread that
// computes it: the bits are those of a fixed split. A thread prefetches the item it runs
// next (Walk): not simply the following item, which another thread may have taken.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace llmserve_pieces {

// Items [0, items) in pieces of `piece` consecutive items, each taken once.
class Pieces {
 public:
  Pieces(int64_t items, int64_t piece) : items_(items), piece_(std::max<int64_t>(piece, 1)) {}

  // The next piece not yet taken, [begin, end); false once every item is.
  bool take(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(piece_, std::memory_order_relaxed);
    if (begin >= items_) return false;
    end = std::min(items_, begin + piece_);
    return true;
  }

  // The next item not yet taken, where pieces are single items.
  bool take(int64_t& item) {
    int64_t end;
    return take(item, end);
  }

 private:
  const int64_t items_, piece_;
  std::atomic<int64_t> next_{0};
};

// One thread's items, in the order it runs them, one item ahead: the piece after its
// current one is taken as its current piece's last item starts, so the item it runs
// after that one is known while it runs (what its prefetches read).
class Walk {
 public:
  explicit Walk(Pieces& pieces) : pieces_(pieces) { more_ = pieces_.take(next_, end_); }

  // The item to run now, and `ahead`: the one this thread runs after it (-1: none).
  // False once none is left.
  bool next(int64_t& item, int64_t& ahead) {
    if (!more_) return false;
    item = next_++;
    if (next_ == end_) more_ = pieces_.take(next_, end_);
    ahead = more_ ? next_ : -1;
    return true;
  }

 private:
  Pieces& pieces_;
  int64_t next_ = 0, end_ = 0;
  bool more_ = false;
};

// The intra-op threads a loop of `items` uses when each should get at least `grain`
// items (at::parallel_for's rule: a fork costs ~10 us, so small loops stay on one thread).
inline int64_t threads_for(int64_t items, int64_t grain) {
  const int64_t most = (items + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(most, 1));
}

// A piece size giving each of `threads` threads about 8 pieces, and at least `grain`
// items: small enough that a slowed thread's last piece is a small part of the loop,
// large enough that taking it (a cache line passed between cores) is not.
// NOTE: pieces of one W8A8 column pair (~2 us at 8 rows) made int8 decode steps at batch
// 8 ~15% slower than fixed shares; of `grain` pairs (the fork's own threshold) they were not.
inline int64_t piece_for(int64_t items, int64_t threads, int64_t grain) {
  return std::max<int64_t>({1, grain, items / std::max<int64_t>(threads * 8, 1)});
}

// Runs work(pieces) on `threads` threads (inline when one); each call takes pieces until
// none is left.
template <typename Work>
void run_on_threads(int64_t threads, Pieces& pieces, const Work& work) {
  if (threads == 1) {
    work(pieces);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { work(pieces); });
}

// Runs work(pieces) on each thread of threads_for(items, grain), pieces sized by
// piece_for. Per-thread state (tile configurations, scratch buffers) lives in `work`, set
// up once per thread.
template <typename Work>
void parallel_pieces(int64_t items, int64_t grain, const Work& work) {
  const int64_t threads = threads_for(items, grain);
  Pieces pieces(items, piece_for(items, threads, grain));
  run_on_threads(threads, pieces, work);
}

// The same with pieces of one item each, every thread given at least one: for items of
// tens of microseconds or more, and of unequal cost (attention over sequences).
template <typename Work>
void parallel_single_items(int64_t items, const Work& work) {
  Pieces pieces(items, 1);
  run_on_threads(threads_for(items, 1), pieces, work);
}

}  // namespace llmserve_pieces
