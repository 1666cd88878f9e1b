// A busy machine: how many workers a parallel region should take, from what the regions
// before it saw, and the region that notes what it sees. Followed by the flash forward
// (flash_common.h's run_items), decoding's one-row products (row_product.h,
// int8_product.h), a prompt's products (decode.cpp) and the decoding step's attention
// (decode_step.cpp), and asked by generate's sampling (_native.one_thread_while_busy);
// one record per process, since a busy machine is busy for every kernel.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

namespace attnlab {

// A busy machine. A parallel region ends at a barrier that each of its workers must reach,
// and a worker the OS has put behind another process reaches it a time slice later
// (milliseconds), however short the call: beside a busy process per core a 0.74 ms
// causal forward at T=256 (two Zen 4 cores) took 3.3 ms on two workers, 2.8 ms on one.
// So parallel_region (below) notes when a region's last worker started late, and a call
// of less work than SMALL_CALL_FLOPS made within CONTENDED_NS of two such starts runs on
// one worker; once that long has passed without them, small calls take every worker again.
//
// It also notes when two of a region's workers started on the same core. Beside a busy
// process per core the OS may pair both of torch's threads on one core and both busy
// processes on the other (two threads a core looks balanced to it), for seconds at a
// time. Then the workers take turns on one core, and one that has run out of items spins
// through its turn (OpenMP's barrier) while the other holds the last: a T=512 causal
// forward took 12 ms there, where one worker alone takes 5. So for CONTENDED_NS after
// that is seen, every call runs on as many workers as there were distinct cores, and
// the next call after it probes with every worker again.
constexpr int64_t LATE_START_NS = 300'000, CONTENDED_NS = 100'000'000;
constexpr double SMALL_CALL_FLOPS = 2e8;  // about 2 ms of one core's products

inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// When something was last seen (steady_ns) and the time before, and, for shared cores,
// how many there were.
struct Seen {
  static constexpr int64_t NEVER = std::numeric_limits<int64_t>::min() / 2;
  std::atomic<int64_t> at{NEVER}, before{NEVER};
  std::atomic<int64_t> cores{0};
  void note(int64_t cores_seen = 0) {
    cores.store(cores_seen, std::memory_order_relaxed);
    before.store(at.load(std::memory_order_relaxed), std::memory_order_relaxed);
    at.store(steady_ns(), std::memory_order_relaxed);
  }
  void forget() {
    at.store(NEVER, std::memory_order_relaxed);
    before.store(NEVER, std::memory_order_relaxed);
  }
  bool recent() const { return steady_ns() - at.load(std::memory_order_relaxed) < CONTENDED_NS; }
  // Seen twice within CONTENDED_NS: a quiet machine's rare stall (a vCPU the host paused,
  // a worker woken late: 3-12 of 192 quiet tokens of SmolLM2 saw one) is not a busy one.
  bool twice() const {
    return steady_ns() - before.load(std::memory_order_relaxed) < CONTENDED_NS;
  }
};
inline Seen& late_start() {
  static Seen seen;
  return seen;
}
inline Seen& shared_cores() {
  static Seen seen;
  return seen;
}

// The core the calling thread runs on, or -1 where the OS does not say.
inline int current_core() {
#ifdef __linux__
  return sched_getcpu();
#else
  return -1;
#endif
}

// Workers for a call of `flops`: every thread, or fewer while the machine is seen busy.
inline int64_t workers_for(double flops) {
  const int64_t all = std::max<int64_t>(1, at::get_num_threads());
  if (all > 1 && shared_cores().recent())
    return std::clamp<int64_t>(shared_cores().cores.load(std::memory_order_relaxed), 1, all);
  if (all > 1 && flops < SMALL_CALL_FLOPS && late_start().twice()) return 1;
  return all;
}

// How many distinct cores the workers started on, and how many workers' cores are known
// (-1: not known): fewer distinct than known means two workers shared a core.
inline std::pair<int64_t, int64_t> cores_seen(const std::vector<int>& cores) {
  std::vector<int> known;
  for (int c : cores)
    if (c >= 0) known.push_back(c);
  std::sort(known.begin(), known.end());
  const int64_t distinct = std::unique(known.begin(), known.end()) - known.begin();
  return {distinct, static_cast<int64_t>(known.size())};
}

// Run `body(begin, end)` on `workers` threads (at::parallel_for over [0, workers) with a
// grain of 1: each thread one range), noting what a busy machine does to it: a late start
// of its last worker (late_start) and two workers started on one core (shared_cores).
template <typename F>
void parallel_region(int64_t workers, const F& body) {
  std::atomic<int64_t> latest{0};
  const int64_t t0 = steady_ns();
  // Each thread's core as its range began (one thread may run several workers' ranges
  // where OpenMP gives fewer threads: only the first of its range is counted).
  std::vector<int> cores(std::max<int64_t>(workers, 0), -1);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    const int64_t started = steady_ns() - t0;
    cores[begin] = current_core();
    for (int64_t seen = latest.load(); started > seen &&
                                       !latest.compare_exchange_weak(seen, started);) {
    }
    body(begin, end);
  });
  if (workers < 2) return;
  if (latest.load() > LATE_START_NS) late_start().note();
  const auto [distinct, known] = cores_seen(cores);
  if (distinct < known) shared_cores().note(distinct);
}

// `body(begin, end)` over [0, items) cut into one contiguous range per worker, on as
// many workers as workers_for(flops) gives (at most `items`), in a parallel_region: for
// kernels whose threads take fixed ranges (a range of bands fetches its next band ahead).
template <typename F>
void split_region(int64_t items, double flops, const F& body) {
  const int64_t workers = std::max<int64_t>(1, std::min(workers_for(flops), items));
  parallel_region(workers, [&](int64_t w0, int64_t w1) {
    body(items * w0 / workers, items * w1 / workers);
  });
}

}  // namespace attnlab
