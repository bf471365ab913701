// The host-side proxy of the doorbell fabrics' graphed exchange (rocket_mpi/fabric/slots.py DoorbellSlots): one
// native thread per rank that watches the ready records our GPU writes and, for each new one, has our block put into
// every peer's region and rings the peer's doorbell words. Plain C++ (no CUDA, no Python): it is compiled into the
// extension and called through ctypes (rocket_mpi/fabric/proxy.py); the CPU tests compile this file alone.
//
// Ready records: two of 8 uint64 in host memory, record seq & 1 = {seq, rows, ...}; the GPU's stage kernel writes
// rows, then seq with release order (csrc/proxy_bells.cu). The GPU runs at most one exchange ahead of this thread
// (it stages seq+2 only after the peers rang seq+1, which they did only after our doorbell for seq), so two records
// suffice, and the one with the lower new seq goes first.
//
// Transports: native (shm: the GPU's stage kernel has already put the rows into every peer's segment, before the
// ready record, so the proxy only rings: a release store of seq into each doorbell word, mapped in this process), or a
// callback (verbs: pyverbs posts the RDMA writes from our staging, then the doorbells; ctypes takes the GIL for each
// call). Errors stop the thread and are kept for the fabric to raise.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <new>
#include <thread>

#include <sched.h>
#include <time.h>

#define ROCKET_PROXY_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxRanks = 64;      // kPlanMaxRanks (rocket.h)
constexpr int kRecordWords = 8;    // a ready record: 64 bytes

// Field order and types: rocket_mpi/fabric/proxy.py ProxyArgs.
struct ProxyArgs {
  uint64_t* ready;                   // [2][8]: {seq, rows, ...} of the last two exchanges our GPU staged
  uint64_t* bell[kMaxRanks];         // native: our doorbell word of rail 0 on rank r (rails follow it)
  int (*post)(void* ctx, uint64_t seq, int64_t rows);  // callback transport, else null: 0 = done
  void* ctx;
  int64_t row_bytes, slot_bytes, max_rows;
  uint64_t last;                     // every seq up to this one is done (exchanges before the proxy started)
  int32_t rank, n_ranks, rails, idle_sleep_us;
};

struct Proxy {
  ProxyArgs a;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> handled{0};  // the last seq put and rung
  std::atomic<uint64_t> count{0};    // exchanges handled
  std::atomic<int> failed{0};
  char error[512] = {0};
  std::thread thread;
};

inline bool ahead(uint64_t seq, uint64_t last) { return static_cast<int64_t>(seq - last) > 0; }

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

void fail(Proxy& p, const char* what) {
  std::snprintf(p.error, sizeof p.error, "%s", what);
  p.failed.store(1, std::memory_order_release);
}

// One exchange: our block of `seq` (rows rows) to every peer (verbs), then its doorbells.
bool put_and_ring(Proxy& p, uint64_t seq, int64_t rows) {
  const ProxyArgs& a = p.a;
  if (a.post) {
    if (a.post(a.ctx, seq, rows) != 0) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "the transport failed posting seq %llu", static_cast<unsigned long long>(seq));
      fail(p, msg);
      return false;
    }
    return true;
  }
  for (int k = 1; k < a.n_ranks; ++k) {  // start with the next rank, as DoorbellFabric.send
    const int peer = (a.rank + k) % a.n_ranks;
    for (int rail = 0; rail < a.rails; ++rail) __atomic_store_n(a.bell[peer] + rail, seq, __ATOMIC_RELEASE);
  }
  return true;
}

void run(Proxy* self) {
  Proxy& p = *self;
  const ProxyArgs& a = p.a;
  uint64_t last = a.last;
  uint64_t polls = 0;
  bool sleepy = false;
  auto idle_since = std::chrono::steady_clock::now();
  while (!p.stop.load(std::memory_order_acquire)) {
    uint64_t s0 = __atomic_load_n(a.ready, __ATOMIC_ACQUIRE);
    uint64_t s1 = __atomic_load_n(a.ready + kRecordWords, __ATOMIC_ACQUIRE);
    if (!ahead(s0, last) && !ahead(s1, last)) {
      // idle: spin, then yield, and once idle for idle_sleep_us sleep 50 us between polls (a server between
      // requests does not burn a core; a decode keeps the proxy busy)
      if (++polls < 4096) {
        cpu_relax();
        continue;
      }
      if ((polls & 255) == 0)
        sleepy = std::chrono::steady_clock::now() - idle_since > std::chrono::microseconds(a.idle_sleep_us);
      if (sleepy) {
        const timespec nap{0, 50 * 1000};
        nanosleep(&nap, nullptr);
      } else {
        sched_yield();
      }
      continue;
    }
    // Both again, after the acquire that saw a new seq: a record the GPU wrote before that one is visible now.
    s0 = __atomic_load_n(a.ready, __ATOMIC_ACQUIRE);
    s1 = __atomic_load_n(a.ready + kRecordWords, __ATOMIC_ACQUIRE);
    int rec;
    if (ahead(s0, last) && ahead(s1, last))
      rec = static_cast<int64_t>(s0 - s1) < 0 ? 0 : 1;
    else
      rec = ahead(s0, last) ? 0 : 1;
    const uint64_t seq = rec ? s1 : s0;
    const int64_t rows = static_cast<int64_t>(__atomic_load_n(a.ready + rec * kRecordWords + 1, __ATOMIC_RELAXED));
    if ((seq & 1) != static_cast<uint64_t>(rec) || rows < 0 || rows > a.max_rows) {
      char msg[200];
      std::snprintf(msg, sizeof msg, "ready record %d holds seq %llu with %lld rows (the slots hold %lld): a stray "
                    "write into the staging", rec, static_cast<unsigned long long>(seq),
                    static_cast<long long>(rows), static_cast<long long>(a.max_rows));
      fail(p, msg);
      return;
    }
    if (!put_and_ring(p, seq, rows)) return;
    last = seq;
    p.handled.store(seq, std::memory_order_release);
    p.count.fetch_add(1, std::memory_order_relaxed);
    polls = 0;
    sleepy = false;
    idle_since = std::chrono::steady_clock::now();
  }
}

}  // namespace

// Starts the proxy thread; null with a message in err where the arguments are unusable.
ROCKET_PROXY_API void* rocket_proxy_start(const ProxyArgs* args, char* err, int errlen) {
  const ProxyArgs& a = *args;
  const char* why = nullptr;
  if (a.n_ranks < 2 || a.n_ranks > kMaxRanks || a.rank < 0 || a.rank >= a.n_ranks)
    why = "rank or rank count out of range (2..64 ranks)";
  else if (!a.ready || a.rails < 1 || a.row_bytes <= 0 || a.max_rows < 0 || a.slot_bytes < a.max_rows * a.row_bytes)
    why = "no ready records, no rails, or slots smaller than max_rows rows";
  else if (!a.post)
    for (int r = 0; r < a.n_ranks && !why; ++r)
      if (r != a.rank && !a.bell[r]) why = "a peer without mapped doorbell words";
  if (why) {
    std::snprintf(err, static_cast<size_t>(errlen), "%s", why);
    return nullptr;
  }
  Proxy* p = new (std::nothrow) Proxy;
  if (!p) {
    std::snprintf(err, static_cast<size_t>(errlen), "out of memory");
    return nullptr;
  }
  p->a = a;
  p->handled.store(a.last);
  try {
    p->thread = std::thread(run, p);
  } catch (const std::exception& e) {
    std::snprintf(err, static_cast<size_t>(errlen), "cannot start the proxy thread: %s", e.what());
    delete p;
    return nullptr;
  }
  return p;
}

// Stops and joins the thread (idempotent). Called without the GIL (ctypes), so a callback in flight finishes.
ROCKET_PROXY_API void rocket_proxy_stop(void* proxy) {
  Proxy* p = static_cast<Proxy*>(proxy);
  p->stop.store(true, std::memory_order_release);
  if (p->thread.joinable()) p->thread.join();
}

// Frees a stopped proxy.
ROCKET_PROXY_API void rocket_proxy_free(void* proxy) {
  Proxy* p = static_cast<Proxy*>(proxy);
  rocket_proxy_stop(p);
  delete p;
}

// 0 while healthy, 1 once the thread stopped on an error (its message in msg); handled: the last seq put and rung,
// count: exchanges handled.
ROCKET_PROXY_API int rocket_proxy_status(void* proxy, uint64_t* handled, uint64_t* count, char* msg, int msglen) {
  Proxy* p = static_cast<Proxy*>(proxy);
  *handled = p->handled.load(std::memory_order_acquire);
  *count = p->count.load(std::memory_order_relaxed);
  if (!p->failed.load(std::memory_order_acquire)) return 0;
  std::snprintf(msg, static_cast<size_t>(msglen), "%s", p->error);
  return 1;
}

// sizeof(ProxyArgs): the Python side checks its ctypes layout against it.
ROCKET_PROXY_API int64_t rocket_proxy_args_size() { return static_cast<int64_t>(sizeof(ProxyArgs)); }
