// hvd_topk's CPU selection kernel: top-k by magnitude in about one pass over memory.
//
// 1. Sample: fresh random positions on every call: single entries in tensors that fit in cache,
//    runs of 32 (two cache lines of fp32) in larger ones, prefetched ahead, so sampling costs a
//    few thousand overlapping cache misses, not S memory latencies.
// 2. Threshold: the sample's r-th largest magnitude, r chosen so that the expected number of
//    entries at or above it is k plus a few standard deviations (so it is rarely too few).
// 3. One pass: collect the positions with |x| >= threshold, in ascending order, with their values.
//    With error feedback's fold (g given: x += g), the fold is this pass: the sample is taken of
//    the sums x + g, and the pass stores x + g and collects from it (tensors small enough to stay
//    in cache are folded first instead, then sampled and collected from cache).
// 4. Keep exactly k: the k-th largest candidate magnitude (a radix select over the candidates'
//    range), then a scan of the candidates in position order, using the values collected with
//    them (x is out of cache by then). Output indices are ascending.
// 5. Too few candidates (rare): mode EXACT lowers the threshold and passes again, so the result
//    is the true top-k; mode SAMPLED does so only below 95% of k, and otherwise fills up with
//    the lowest positions not collected (real entries, never duplicates): exactly k distinct
//    pairs always go out, at least 95% of them from the true top-k.
//
// NaN counts as the largest magnitude (as in torch.topk) so it is always sent and reaches the
// average; any inf/nan in x is reported in flags[0].
//
// A fusion bucket's tensors are selected in one call (hvdtk_select_segments_*, k per segment),
// and the gathered pairs of every rank are added into the bucket's tensors in one call
// (hvdtk_scatter_segments_*, chunk by chunk, each rank's pairs in turn).
//
// Plain C ABI (called through ctypes with tensors' data pointers): no torch headers, so the
// build takes a second and the library works with any torch version.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRun = 32;          // sampled entries per random position (2 cache lines)
constexpr int64_t kSample = 65536;    // most entries sampled (and at most a quarter of x)
constexpr int64_t kSmall = 16384;     // at or below: every entry is a candidate
constexpr int64_t kSingles = 1 << 18; // at or below: sample single entries, not runs
constexpr int64_t kSampleShare = 128;  // sample about 1/128 of x (a model's many tensors each
constexpr int64_t kMinSample = 4096;   // pay in proportion), at least this many, at most kSample
constexpr int64_t kAhead = 64;        // positions prefetched ahead when visiting scattered ones

struct Rng {  // splitmix64: tiny, good enough for picking sample positions
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

template <typename T>
inline bool finite(T v) { return std::isfinite(static_cast<double>(v)); }

template <typename V>
struct Grow {  // growable array; entries past `size` may be written while collecting
  V* p = nullptr;
  int64_t size = 0, cap = 0;
  void reserve(int64_t need) {
    if (need <= cap) return;
    int64_t c = std::max(need, 2 * cap);
    V* q = new V[c];
    if (size) std::memcpy(q, p, size * sizeof(V));
    delete[] p;
    p = q;
    cap = c;
  }
  ~Grow() { delete[] p; }
};

struct Scratch {  // reused across calls (one per thread): no allocation in steady state
  std::vector<uint32_t> sample, keys;
  std::vector<int64_t> starts;  // sample positions
  Grow<int64_t> cand;           // candidates' positions, ascending
  Grow<float> cand_f;           // and their values
  template <typename T> Grow<T>& values() {
    static_assert(std::is_same<T, float>::value, "the kernel selects float32 only");
    return cand_f;
  }
};
thread_local Scratch scratch;

// Where collecting writes: candidates' positions and values side by side, so that trimming to
// k never goes back to x (out of cache by then).
template <typename T>
struct Sink {
  int64_t* pos;
  T* val;
};

template <typename T>
inline uint32_t key_bits(T v) {  // order-preserving integer key of |v|; NaN above inf
  float a = std::fabs(static_cast<float>(v));
  uint32_t b;
  std::memcpy(&b, &a, 4);
  return b;
}

// The k-th largest of keys (k >= 1), and how many keys are strictly larger: a radix select.
// Each level histograms the keys still in play by 12 bits of their offset from the smallest
// (the bins span exactly the keys' range, so a narrow range -- a selection's candidates all
// sit just above one threshold -- is split as finely as a wide one), finds the bin holding
// the k-th from the top, and keeps only that bin's keys. Few keys left: nth_element. Every
// level costs two passes over what is left and leaves about 1/4096 of it, so a few hundred
// thousand candidates take two levels, never the long introselect a dense bin would cost.
constexpr int kRadixBits = 12;
constexpr size_t kRadixMin = 2048;

struct Kth {
  uint32_t key;
  int64_t above;  // keys > key
};

inline Kth kth_largest(const uint32_t* keys, size_t n, int64_t k) {
  static thread_local std::vector<uint32_t> part, next;
  static thread_local std::vector<uint64_t> hist;  // counts: 2^32 candidates would wrap a uint32
  const uint32_t* in = keys;
  int64_t above = 0;  // keys known to be above those still in play
  while (n >= kRadixMin) {
    uint32_t lo = in[0], hi = in[0];
    for (size_t j = 1; j < n; ++j) {
      lo = std::min(lo, in[j]);
      hi = std::max(hi, in[j]);
    }
    if (lo == hi) return {lo, above};  // all equal: the k-th is that key, none above it
    int shift = 0;
    while (((hi - lo) >> shift) >= (1u << kRadixBits)) ++shift;
    hist.assign(((hi - lo) >> shift) + 1, 0);
    for (size_t j = 0; j < n; ++j) ++hist[(in[j] - lo) >> shift];
    int64_t bin = (int64_t)hist.size() - 1;
    while (above + (int64_t)hist[bin] < k) above += (int64_t)hist[bin--];
    next.clear();
    next.reserve(hist[bin]);
    for (size_t j = 0; j < n; ++j)
      if (((in[j] - lo) >> shift) == (uint32_t)bin) next.push_back(in[j]);
    part.swap(next);
    in = part.data();
    n = part.size();
  }
  if (in != part.data()) part.assign(in, in + n);
  int64_t need = k - above;  // 1 <= need <= n
  std::nth_element(part.begin(), part.begin() + (need - 1), part.end(), std::greater<uint32_t>());
  const uint32_t key = part[need - 1];
  for (int64_t j = 0; j < need - 1; ++j) above += part[j] > key;
  return {key, above};
}

// Threshold such that about `want` of the n entries are expected at or above it. With g, the
// entries are x + g (what a fold is about to write), so the fold's own pass can collect.
template <typename T>
float sample_threshold(const T* x, const T* g, int64_t n, double want, uint64_t seed) {
  std::vector<uint32_t>& s = scratch.sample;
  s.clear();
  s.reserve(kSample);
  Rng rng{seed ^ (uint64_t)n * 0x2545F4914F6CDD1Dull};
  // The positions follow from the seed alone, which the caller varies from step to step (a fixed
  // set could keep missing a structured gradient's large values, step after step) and derives
  // from the step counter, so that a run resumed from a checkpoint selects as the run that never
  // stopped (a shortfall's fill-up depends on the sample). Tensors up to kSingles entries sit in
  // cache: sample single entries (independent); larger ones in runs of kRun to keep the number
  // of cache misses small.
  int64_t step = n <= kSingles ? 1 : kRun;
  int64_t runs = std::min(n <= kSingles ? kSample / 4 : kSample,
                          std::min(n / 4, std::max(kMinSample, n / kSampleShare))) / step;
  // Positions first, then the reads with prefetches kPrefetch runs ahead: the reads are cache
  // misses (the tensor is not in cache), and issued one after another they would cost a
  // memory latency each; prefetched, many are in flight at once.
  std::vector<int64_t>& at = scratch.starts;
  at.resize(runs);
  const uint64_t range = (uint64_t)(n - step + 1);
  for (int64_t j = 0; j < runs; ++j)
    at[j] = (int64_t)(((unsigned __int128)rng.next() * range) >> 64);  // uniform in [0, range)
  constexpr int64_t kPrefetch = 16;
  for (int64_t j = 0; j < std::min(runs, kPrefetch); ++j) {
    __builtin_prefetch(x + at[j]);
    if (g) __builtin_prefetch(g + at[j]);
  }
  s.resize(runs * step);
  uint32_t* o = s.data();
  for (int64_t j = 0; j < runs; ++j) {
    if (j + kPrefetch < runs) {
      __builtin_prefetch(x + at[j + kPrefetch]);
      if (g) __builtin_prefetch(g + at[j + kPrefetch]);
    }
    const int64_t b = at[j];
    for (int64_t i = b; i < b + step; ++i)
      *o++ = key_bits(g ? static_cast<T>(x[i] + g[i]) : x[i]);
  }
  int64_t S = (int64_t)s.size();
  double expect = want * (double)S / (double)n;           // sample entries above the k-th
  double r = expect + 4.0 * std::sqrt(expect) + 8.0;       // margin: rarely too few
  if (r >= (double)S) return -INFINITY;                    // take everything
  uint32_t bits = kth_largest(s.data(), s.size(), (int64_t)r).key;
  float t;
  std::memcpy(&t, &bits, 4);
  return t == t ? t : INFINITY;
}

// Appends the positions b + j (j < 16) whose bit is set in `bits`, and lanes[j], in order.
// (pos and val are the caller's locals, so the compiler keeps them in registers.)
inline void emit(int64_t*& pos, float*& val, uint32_t bits, int64_t b, const float* lanes) {
  while (bits) {
    int j = __builtin_ctz(bits);
    *pos++ = b + j;
    *val++ = lanes[j];
    bits &= bits - 1;
  }
}

// The integer form of "key >= t" (or "> t" when strict) that every collecting path compares
// with: key_bits(v) > threshold_bits(t, strict). Keys are |v|'s bits, so a denormal compares
// right with denormals flushed to zero (torch.set_flush_denormal(True)), where a float compare
// took it for 0 and the scalar tail missed it; t <= 0 and -inf collect everything (or every
// non-zero).
inline int32_t threshold_bits(float t, bool strict) {
  if (!(t > 0.0f)) return strict ? 0 : -1;
  int32_t tb;
  std::memcpy(&tb, &t, 4);
  return strict ? tb : tb - 1;
}

// Generic block: collect key > tb (threshold_bits), after x += g when g is given. False if a
// value is not finite.
template <typename T>
bool collect_block(T* x, const T* g, int64_t b, int64_t e, int32_t tb, Sink<T>& out) {
  bool ok = true;
  for (int64_t i = b; i < e; ++i) {
    T v = x[i];
    if (g) x[i] = v = static_cast<T>(v + g[i]);
    ok &= finite(v);
    *out.pos = i;
    *out.val = v;
    bool take = (int32_t)key_bits(v) > tb;
    out.pos += take;
    out.val += take;
  }
  return ok;
}

#if defined(__x86_64__)
// float32, 16 entries at a time. The magnitude's bits (sign cleared) compare as integers in
// the same order as the floats, and inf/nan have the largest bits of all: one integer compare
// per lane collects NaN (which must be sent) along with the large values, and the running
// maximum of the bits tells whether anything was not finite. Candidates are packed with a
// table lookup and stored whole-vector, without a branch: at 1% density one 16-entry group in
// six holds a candidate, at random, and the mispredicted branches cost more than the packing.
//   tb: the threshold's bits; an entry is collected when bits > tb - 1 (>=) or bits > tb (>).
//   With g (a fold), x += g is stored first, in the same pass: the sum is what is compared.
// Left-packing 8 lanes by their mask without a branch per lane: perm[m] lists the lanes set in
// m, in order (8 KiB, built once).
struct PackTable {
  alignas(32) int32_t perm[256][8];
  PackTable() {
    for (int m = 0; m < 256; ++m) {
      int o = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) perm[m][o++] = l;
      while (o < 8) perm[m][o++] = 0;
    }
  }
};
const PackTable kPack;

// Appends the lanes of v set in m8 (positions base + lane) at pos/val: whole vectors are
// stored and the pointers advance by the count, so up to 8 entries past it are scratch.
__attribute__((target("avx2"))) inline void emit8(int64_t*& pos, float*& val, uint32_t m8, __m256 v,
                                                  int64_t base) {
  const __m256i p = _mm256_load_si256((const __m256i*)kPack.perm[m8]);
  _mm256_storeu_ps(val, _mm256_permutevar8x32_ps(v, p));
  const __m256i at = _mm256_add_epi32(p, _mm256_set1_epi32((int32_t)base));
  _mm256_storeu_si256((__m256i*)pos, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(at)));
  _mm256_storeu_si256((__m256i*)(pos + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(at, 1)));
  const int c = __builtin_popcount(m8);
  pos += c;
  val += c;
}

template <bool kFold>
__attribute__((target("avx2"))) bool collect_f32_avx2(float* x, const float* g, int64_t n, int32_t gt,
                                                      Sink<float>& out, int64_t& i) {
  const __m256i mag = _mm256_set1_epi32(0x7fffffff), thr = _mm256_set1_epi32(gt);
  __m256i hi = _mm256_setzero_si256();
  int64_t* pos = out.pos;
  float* val = out.val;
  for (; i + 16 <= n; i += 16) {
    __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    if (kFold) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(g + i));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(g + i + 8));
      _mm256_storeu_ps(x + i, v0);
      _mm256_storeu_ps(x + i + 8, v1);
    }
    __m256i a0 = _mm256_and_si256(_mm256_castps_si256(v0), mag);
    __m256i a1 = _mm256_and_si256(_mm256_castps_si256(v1), mag);
    hi = _mm256_max_epi32(hi, _mm256_max_epi32(a0, a1));
    uint32_t hit = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a0, thr))) |
                   ((uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a1, thr))) << 8);
    emit8(pos, val, hit & 0xff, v0, i);  // no branch on `hit`: it is taken at random
    emit8(pos, val, hit >> 8, v1, i + 8);
  }
  out.pos = pos;
  out.val = val;
  alignas(32) int32_t lanes[8];
  _mm256_store_si256((__m256i*)lanes, hi);
  int32_t m = 0;
  for (int l = 0; l < 8; ++l) m = std::max(m, lanes[l]);
  return m < 0x7f800000;
}

// The same with SSE2 (every x86-64 CPU): four lanes, non-finite checked by a compare.
inline bool collect_f32_sse2(float* x, const float* g, int64_t n, int32_t gt, Sink<float>& out, int64_t& i) {
  const __m128i mag = _mm_set1_epi32(0x7fffffff), thr = _mm_set1_epi32(gt);
  const __m128i big = _mm_set1_epi32(0x7f7fffff);
  uint32_t bad = 0;
  alignas(16) float lanes[16];
  int64_t* pos = out.pos;
  float* val = out.val;
  for (; i + 16 <= n; i += 16) {
    uint32_t hit = 0;
    for (int q = 0; q < 4; ++q) {
      __m128 v = _mm_loadu_ps(x + i + 4 * q);
      if (g) {
        v = _mm_add_ps(v, _mm_loadu_ps(g + i + 4 * q));
        _mm_storeu_ps(x + i + 4 * q, v);
      }
      _mm_store_ps(lanes + 4 * q, v);
      __m128i a = _mm_and_si128(_mm_castps_si128(v), mag);
      hit |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, thr))) << (4 * q);
      bad |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, big)));
    }
    if (hit) emit(pos, val, hit, i, lanes);
  }
  out.pos = pos;
  out.val = val;
  return bad == 0;
}

inline bool collect_f32(float* x, const float* g, int64_t n, float t, bool strict, Sink<float>& out) {
  const int32_t tb = threshold_bits(t, strict);
  static const bool avx2 = __builtin_cpu_supports("avx2");
  int64_t i = 0;
  bool ok = !avx2 ? collect_f32_sse2(x, g, n, tb, out, i)
            : g ? collect_f32_avx2<true>(x, g, n, tb, out, i) : collect_f32_avx2<false>(x, g, n, tb, out, i);
  if (i < n) ok &= collect_block(x, g, i, n, tb, out);
  return ok;
}
#endif

// One pass: collect ascending positions with key >= t (or > t when strict), folding x += g first
// where g is given. Returns whether every x was finite.
template <typename T>
bool collect(T* x, const T* g, int64_t n, float t, bool strict) {
  Grow<int64_t>& c = scratch.cand;
  Grow<T>& v = scratch.values<T>();
  c.size = v.size = 0;
  bool ok = true;
  constexpr int64_t B = 1 << 16;
  for (int64_t b = 0; b < n; b += B) {
    int64_t e = std::min(n, b + B);
    c.reserve(c.size + (e - b));  // room for every entry of the block
    v.reserve(v.size + (e - b));
    Sink<T> out{c.p + c.size, v.p + v.size};
    int64_t* start = out.pos;
#if defined(__x86_64__)
    if constexpr (std::is_same<T, float>::value) {
      ok &= collect_f32(x + b, g ? g + b : nullptr, e - b, t, strict, out);
      for (int64_t* q = start; q < out.pos; ++q) *q += b;
    } else
#endif
    {
      ok &= collect_block(x, g, b, e, threshold_bits(t, strict), out);
    }
    c.size += out.pos - start;
    v.size = c.size;
  }
  return ok;
}

// Keep the k largest candidates, in position order, into (idx, val).
template <typename T, typename I>
void keep_k(int64_t k, int64_t offset, I* idx, T* val) {
  const int64_t* c = scratch.cand.p;
  const T* cv = scratch.values<T>().p;
  int64_t m = scratch.cand.size;
  if (m == k) {
    for (int64_t j = 0; j < k; ++j) { idx[j] = (I)(c[j] + offset); val[j] = cv[j]; }
    return;
  }
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(m);
  for (int64_t j = 0; j < m; ++j) keys[j] = key_bits(cv[j]);
  const Kth kth_of = kth_largest(keys.data(), keys.size(), k);
  const uint32_t kth = kth_of.key;
  int64_t ties = k - kth_of.above;  // entries equal to the k-th to keep, first positions first
  int64_t o = 0;
  for (int64_t j = 0; j < m && o < k; ++j) {  // no branch on `take`: about k of m, at random
    const uint32_t key = keys[j];
    const bool tie = key == kth, take = (key > kth) | (tie & (ties > 0));
    ties -= tie & take;
    idx[o] = (I)(c[j] + offset);
    val[o] = cv[j];
    o += take;
  }
}

// Fewer than k candidates in SAMPLED mode: add the lowest positions not collected, merged so
// the output stays ascending.
template <typename T, typename I>
void fill_up(const T* x, int64_t n, int64_t k, int64_t offset, I* idx, T* val) {
  const int64_t* c = scratch.cand.p;
  int64_t m = scratch.cand.size, need = k - m, o = 0, j = 0;
  for (int64_t i = 0; i < n && o < k; ++i) {
    if (j < m && c[j] == i) { idx[o] = (I)(i + offset); val[o] = x[i]; ++o; ++j; }
    else if (need > 0) { idx[o] = (I)(i + offset); val[o] = x[i]; ++o; --need; }
  }
}

// g (may be null): fold first, x += g (error feedback: residual + gradient), in the same pass
// that collects: the sample is taken of the sums, so no pass over x is added to the fold's.
template <typename T, typename I>
int64_t select_impl(T* x, const T* g, int64_t n, int64_t k, int64_t offset, I* idx, T* val,
                    int exact, int zero_sent, uint64_t seed, int64_t* flags) {
  flags[0] = 0;  // non-finite seen
  flags[1] = 0;  // passes over x
  flags[2] = 0;  // entries filled up (SAMPLED shortfall)
  // Nothing to select, or small enough to stay in cache: fold, then sample and collect from
  // cache. Larger: sample the sums in runs, then fold and collect in one pass.
  if (g && (k <= 0 || n <= kSingles)) {
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(x[i] + g[i]);
    g = nullptr;
  }
  if (k <= 0 || n <= 0) return 0;
  if (k > n) k = n;
  // A threshold of zero in SAMPLED mode: mostly zeros, collect the non-zeros only (every pass:
  // otherwise a mostly-zero tensor, an embedding whose few touched rows outnumber k only
  // slightly, takes all n entries as candidates; benchmarks/selection_mostly_zero.py).
  const auto nonzeros_only = [exact](float th) { return th == 0.0f && !exact; };
  float t = (n <= kSmall) ? -INFINITY : sample_threshold(x, g, n, (double)k, seed);
  bool strict = nonzeros_only(t);
  bool ok = collect(x, g, n, t, strict);
  flags[1] = 1;
  double want = (double)k;
  // Too few collected: EXACT passes again until it has k; SAMPLED only when it has less than
  // 95% of k (then fills up the rest), so its recall is never below 95%.
  int64_t enough = exact ? k : k - k / 20;
  while (scratch.cand.size < enough && !strict) {  // strict: the rest are zeros (ties)
    want *= 4.0;  // too few: lower the threshold and pass again (rare)
    float t2 = want >= (double)n ? -INFINITY
                                 : sample_threshold(x, (const T*)nullptr, n, want, seed ^ 0xA0761D6478BD642Full);
    if (!(t2 < t)) t2 = -INFINITY;
    t = t2;
    strict = nonzeros_only(t);
    collect(x, (const T*)nullptr, n, t, strict);  // x is folded by now
    flags[1] += 1;
  }
  flags[0] = ok ? 0 : 1;
  if (scratch.cand.size >= k) {
    keep_k(k, offset, idx, val);
  } else {
    flags[2] = k - scratch.cand.size;
    fill_up(x, n, k, offset, idx, val);
  }
  if (zero_sent)
    for (int64_t j = 0; j < k; ++j) {
      if (j + kAhead < k) __builtin_prefetch(x + ((int64_t)idx[j + kAhead] - offset), 1);
      x[(int64_t)idx[j] - offset] = T(0);
    }
  return k;
}

template <typename T>
int64_t dispatch_index(T* x, const T* g, int64_t n, int64_t k, int64_t offset, void* idx,
                       int index_bytes, T* val, int exact, int zero_sent, uint64_t seed,
                       int64_t* flags) {
  if (index_bytes == 4)
    return select_impl(x, g, n, k, offset, (int32_t*)idx, val, exact, zero_sent, seed, flags);
  return select_impl(x, g, n, k, offset, (int64_t*)idx, val, exact, zero_sent, seed, flags);
}

// Segmented selection: for each segment s of x, [bounds[s], bounds[s+1]), the ks[s] largest
// |x| of that segment (positions relative to x, ascending), written one segment after another
// into (idx, val). nonfinite[s] is set to 1 where segment s held inf/nan. flags sums the
// per-segment passes and fill-ups; flags[0] counts segments with inf/nan.
template <typename T, typename I>
int64_t segments_impl(T* x, int64_t nseg, const int64_t* bounds, const int64_t* ks, I* idx,
                      T* val, int exact, int zero_sent, uint64_t seed, int64_t* flags,
                      uint8_t* nonfinite) {
  int64_t out = 0, f[3];
  flags[0] = flags[1] = flags[2] = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    int64_t b = bounds[s], n = bounds[s + 1] - b, k = std::min(ks[s], n);
    if (k <= 0) { if (nonfinite) nonfinite[s] = 0; continue; }
    select_impl(x + b, (const T*)nullptr, n, k, b, idx + out, val + out, exact, zero_sent,
                seed + (uint64_t)s, f);
    if (nonfinite) nonfinite[s] = (uint8_t)f[0];
    flags[0] += f[0];
    flags[1] += f[1];
    flags[2] += f[2];
    out += k;
  }
  return out;
}

template <typename T>
int64_t segments_dispatch(T* x, int64_t nseg, const int64_t* bounds, const int64_t* ks, void* idx,
                          int index_bytes, T* val, int exact, int zero_sent, uint64_t seed,
                          int64_t* flags, uint8_t* nonfinite) {
  if (index_bytes == 4)
    return segments_impl(x, nseg, bounds, ks, (int32_t*)idx, val, exact, zero_sent, seed, flags, nonfinite);
  return segments_impl(x, nseg, bounds, ks, (int64_t*)idx, val, exact, zero_sent, seed, flags, nonfinite);
}

// Decode a bucket's allgathered pairs into its tensors' own buffers: dest[s] holds positions
// [bounds[s], bounds[s+1]) of the bucket and is overwritten entirely. Each touched position
// gets the ranks' values times mul / div, added in rank order (zero, plus rank 0's, plus rank
// 1's, ...); every other position is zero. The factor is applied to each value as it is added
// -- one multiply, as Horovod's postscale does, where dividing each sum would cost a division
// per position (latency-bound: half the decode on the CPUs measured).
//
// Chunk by chunk (kChunk entries, 16 KiB of fp32: it stays in L1): zero the chunk, then add
// each rank's pairs that fall inside it, rank after rank -- every rank's positions are
// ascending (as the selection writes them), so one cursor per rank moves forwards only. No
// merge across ranks (a branch per pair that the CPU cannot predict), no separate zeroing
// pass over the tensors. Returns the number of pairs that were out of range or out of order
// (a rank's positions going down); non-zero means the ranks disagree on the message layout
// and the result is unusable.
//
// The values may be IEEE half (V = Half) while the tensors are fp32: TopK(fp16_values=True)
// sends 16-bit values, and each is widened exactly (every half is a float) as it is added.
//
// A bucket larger than the cache (kStreamBytes) is written with streaming stores: each chunk is
// built in a scratch buffer in L1 and copied out without reading the destination's lines first
// (an ordinary store fetches every line before overwriting it: twice the memory traffic).
constexpr int64_t kChunk = 4096;
constexpr int64_t kStreamBytes = int64_t(8) << 20;

// Copy n bytes (a multiple of the element size, at least 4-byte aligned) from an L1 buffer to
// memory with non-temporal stores where the destination is 16-byte aligned, plain ones at the
// edges. The caller fences once after the last chunk (stream_fence).
inline void stream_copy(void* to, const void* from, int64_t n) {
#if defined(__x86_64__)
  char* d = (char*)to;
  const char* s = (const char*)from;
  const int64_t head = std::min<int64_t>(n, (16 - ((uintptr_t)d & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128((const __m128i*)s), b = _mm_loadu_si128((const __m128i*)(s + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(s + 32)), e = _mm_loadu_si128((const __m128i*)(s + 48));
    _mm_stream_si128((__m128i*)d, a);
    _mm_stream_si128((__m128i*)(d + 16), b);
    _mm_stream_si128((__m128i*)(d + 32), c);
    _mm_stream_si128((__m128i*)(d + 48), e);
  }
  std::memcpy(d, s, n);
#else
  std::memcpy(to, from, n);
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

struct Half {
  uint16_t bits;
};

// The float of an IEEE half, exactly: sign, exponent rebiased 15 -> 127, mantissa shifted;
// subnormals (exponent 0) are mantissa x 2^-24, inf/nan keep their mantissa bits.
inline float widen(Half h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu, mantissa = h.bits & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;  // 2^-24, exact
    std::memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float widen(float v) { return v; }

template <typename T, typename I, typename V = T>
int64_t scatter_segments_impl(T* const* dest, const int64_t* bounds, int64_t nseg, const char* idx,
                              const char* val, int64_t world, int64_t k, int64_t row_bytes,
                              double div, double mul) {
  static thread_local std::vector<int64_t> cursor, last;
  cursor.assign(world, 0);
  last.assign(world, INT64_MIN);
  const T f = static_cast<T>(mul / div);
  const bool stream = (bounds[nseg] - bounds[0]) * (int64_t)sizeof(T) >= kStreamBytes;
  alignas(64) static thread_local T scratch_chunk[kChunk];
  int64_t bad = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    for (int64_t c0 = bounds[s]; c0 < bounds[s + 1]; c0 += kChunk) {
      const int64_t c1 = std::min(bounds[s + 1], c0 + kChunk);
      T* const to = dest[s] + (c0 - bounds[s]);
      T* const out = stream ? scratch_chunk : to;
      std::memset(out, 0, (c1 - c0) * sizeof(T));
      for (int64_t r = 0; r < world; ++r) {
        const I* ri = (const I*)(idx + r * row_bytes);
        const V* rv = (const V*)(val + r * row_bytes);
        int64_t j = cursor[r], prev = last[r];
        for (; j < k; ++j) {
          const int64_t i = (int64_t)ri[j];
          if (i >= c1) break;
          if (i < c0 || i < prev) { ++bad; continue; }  // negative, or this rank's positions went down
          out[i - c0] = static_cast<T>(out[i - c0] + widen(rv[j]) * f);
          prev = i;
        }
        cursor[r] = j;
        last[r] = prev;
      }
      if (stream) stream_copy(to, out, (c1 - c0) * sizeof(T));
    }
  }
  if (stream) stream_fence();
  for (int64_t r = 0; r < world; ++r) bad += k - cursor[r];  // past the end of the bucket
  return bad;
}

template <typename T, typename V = T>
int64_t scatter_segments_dispatch(T* const* dest, const int64_t* bounds, int64_t nseg, const void* idx,
                                  int index_bytes, const void* val, int64_t world, int64_t k,
                                  int64_t row_bytes, double div, double mul) {
  if (index_bytes == 4)
    return scatter_segments_impl<T, int32_t, V>(dest, bounds, nseg, (const char*)idx, (const char*)val,
                                                world, k, row_bytes, div, mul);
  return scatter_segments_impl<T, int64_t, V>(dest, bounds, nseg, (const char*)idx, (const char*)val,
                                              world, k, row_bytes, div, mul);
}

// x += g over n entries; true when a sum is inf or nan. The test reads the exponent bits (all
// ones: inf/nan), an integer OR that vectorises, so the fold stays one streaming pass.
template <typename T, typename U>
int64_t fold_impl(T* x, const T* g, int64_t n) {
  static_assert(sizeof(T) == sizeof(U), "bit pattern of T");
  const U exponent = std::is_same<T, float>::value ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i] + g[i];
    x[i] = v;
    U bits;
    std::memcpy(&bits, &v, sizeof(T));
    bad |= U((bits & exponent) == exponent);
  }
  return bad != 0;
}

// out[j] = x[idx[j]] for j < k, then x[idx[j]] = 0 where `zero` (error feedback: a rank that
// did not select sends its residual at the leader's positions, and they are then sent). One
// visit per position, prefetched kAhead positions ahead: the positions are spread over a
// buffer far larger than the cache, so each is a miss, and with dozens in flight they overlap
// (160k positions in 64 MB: torch's index_select + index_fill_ 2.2 ms, this 0.7 ms).
// Positions outside [0, n) are skipped (out[j] = 0) and counted: non-zero means the ranks
// disagree on the bucket and the caller must not use the result.
template <typename T, typename I>
int64_t take_impl(T* x, int64_t n, const I* idx, int64_t k, T* out, int zero) {
  int64_t bad = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (j + kAhead < k) {
      const int64_t a = (int64_t)idx[j + kAhead];
      if (a >= 0 && a < n) __builtin_prefetch(x + a, 1);
    }
    const int64_t i = (int64_t)idx[j];
    if (i < 0 || i >= n) { out[j] = T(0); ++bad; continue; }
    out[j] = x[i];
    if (zero) x[i] = T(0);
  }
  return bad;
}

template <typename T>
int64_t take_dispatch(T* x, int64_t n, const void* idx, int index_bytes, int64_t k, T* out, int zero) {
  if (index_bytes == 4) return take_impl(x, n, (const int32_t*)idx, k, out, zero);
  return take_impl(x, n, (const int64_t*)idx, k, out, zero);
}


// ---- Compact pairs (hvd_topk/compact.py): Elias-Fano indices, 8-bit log-scale values ------------
// The layout and the rules are compact.py's (its torch-ops path is the reference for these
// two functions): a segment's band [lo, hi] (float32), level 0 zero, 1..127 log-uniform over
// the band (1 is lo, 127 hi, inf/nan 127), a sign bit on top; the indices' low L bits packed
// LSB first, their high parts as bit (index >> L) + i of a bitmap. With `sign` (compact="sign"):
// one float32 scale a segment (the mean of its non-zero magnitudes), a sign bit a pair (LSB
// first), zeros moved onto the segment's first non-zero index ahead of it, and a slot whose
// index repeats in the next slot read as zero.
constexpr int kCompactLevels = 126;

// The 128 magnitudes a segment's levels stand for, from its band as the receivers read it.
void compact_table(float lo_f, float hi_f, double* table) {
  const double lo = lo_f, hi = hi_f, log_lo = std::log(lo), width = std::log(hi / lo);
  table[0] = 0.0;
  for (int l = 2; l < 127; ++l) table[l] = std::exp(log_lo + (double)(l - 1) / kCompactLevels * width);
  table[1] = lo;
  table[127] = hi;
}

// Elias-Fano: pair i's index x as bit (x >> L) + i of the bitmap and its low L bits at i x L
// (LSB first); into zeroed high and low.
struct IndexWriter {
  uint8_t* high;
  uint8_t* low;
  int low_bits;
  uint64_t mask;
  void operator()(int64_t i, uint64_t x) const {
    const uint64_t pos = (x >> low_bits) + (uint64_t)i;
    high[pos >> 3] |= (uint8_t)(1u << (pos & 7));
    if (low_bits) {
      const uint64_t o = (uint64_t)i * (uint64_t)low_bits;
      const int shift = (int)(o & 7);
      const uint64_t bits = (x & mask) << shift;
      for (int b = 0; b < low_bits + shift; b += 8) low[(o >> 3) + (b >> 3)] |= (uint8_t)(bits >> b);
    }
  }
};

// compact="sign": each segment's scale into band[s], the sign bits into code, and the indices as
// they travel (zeros moved) to write_index; the rounding into residual. Pairs sorted by index.
template <typename I>
void sign_pack_values(const float* val, const I* idx, const int64_t* slots, int64_t nseg, float* band,
                      uint8_t* code, int64_t k, const IndexWriter& write_index, float* residual) {
  std::memset(code, 0, (size_t)((k + 7) / 8));
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t a = slots[s], b = slots[s + 1];
    double total = 0.0;
    int64_t count = 0, first = -1;
    for (int64_t i = a; i < b; ++i) {
      const double m = std::fabs((double)val[i]);
      if (m != 0.0) {  // (nan too: the scale turns non-finite)
        total += m;
        ++count;
        if (first < 0) first = i;
      }
    }
    const double mean = count ? total / (double)count : 0.0;
    band[s] = std::isfinite(mean) ? (float)std::min(mean, (double)FLT_MAX) : (float)mean;
    const double scale = band[s];
    const bool finite = std::isfinite(scale);
    int64_t o = a;
    auto put = [&](int64_t i, I at) {
      write_index(o, (uint64_t)at);
      if (std::signbit(val[i])) code[o >> 3] |= (uint8_t)(1u << (o & 7));
      ++o;
    };
    if (count)  // zeros first, at the first non-zero's index
      for (int64_t i = a; i < b; ++i)
        if (val[i] == 0.0f) put(i, idx[first]);
    for (int64_t i = a; i < b; ++i) {
      if (count && val[i] == 0.0f) continue;
      put(i, idx[i]);
      if (residual && finite && val[i] != 0.0f) {
        if (i + kAhead < b) __builtin_prefetch(residual + idx[i + kAhead], 1);
        const float arrives = (float)(std::signbit(val[i]) ? -scale : scale);
        const float lost = val[i] - arrives;
        if (std::isfinite(lost)) residual[idx[i]] += lost;
      }
    }
  }
}

template <typename I>
int64_t compact_pack_impl(const float* val, const I* idx, int64_t k, const int64_t* slots, int64_t nseg, int low_bits,
                          float* band, uint8_t* high, int64_t high_bytes, int64_t high_bits, uint8_t* low,
                          int64_t low_bytes, uint8_t* code, float* residual, bool sign) {
  for (int64_t i = 1; i < k; ++i)
    if (idx[i] < idx[i - 1]) return -1;  // not sorted: the caller sorts and calls again
  // a bit outside the bitmap (a negative index, or one far beyond the tensor): the caller's torch
  // path refuses it by name, as it does (an index at or past n whose bit still fits is the
  // decode's to refuse, on both paths)
  if (k > 0 && (idx[0] < 0 || ((uint64_t)idx[k - 1] >> low_bits) + (uint64_t)(k - 1) >= (uint64_t)high_bits))
    return -1;
  std::memset(high, 0, (size_t)high_bytes);
  std::memset(low, 0, (size_t)low_bytes);
  const IndexWriter write_index{high, low, low_bits, low_bits ? ((uint64_t)1 << low_bits) - 1 : 0};
  if (sign) {  // (a moved index is one of the sorted ones, so the bound above holds)
    sign_pack_values(val, idx, slots, nseg, band, code, k, write_index, residual);
    return 0;
  }
  double table[128];
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t a = slots[s], b = slots[s + 1];
    double hi = 0.0, lo = INFINITY;
    bool nan = false, inf = false;
    for (int64_t i = a; i < b; ++i) {
      const double m = std::fabs((double)val[i]);
      if (std::isnan(m)) nan = true;
      else if (std::isinf(m)) inf = true;
      else {
        if (m > hi) hi = m;
        if (m > 0.0 && m < lo) lo = m;
      }
    }
    band[2 * s] = (float)std::min(lo, (double)FLT_MAX);  // none finite and non-zero: FLT_MAX, as compact.py
    band[2 * s + 1] = nan ? NAN : (inf ? INFINITY : (float)hi);
    const double lo_d = band[2 * s], log_lo = std::log(lo_d), width = std::log((double)band[2 * s + 1] / lo_d);
    compact_table(band[2 * s], band[2 * s + 1], table);
    const bool finite_band = !nan && !inf;
    for (int64_t i = a; i < b; ++i) {
      const float v = val[i];
      const double m = std::fabs((double)v);
      int level;
      if (!std::isfinite(m)) level = 127;
      else if (m == 0.0) level = 0;
      else if (width == 0.0) level = 1;
      else {
        const double step = std::nearbyint((std::log(m) - log_lo) / width * kCompactLevels);
        level = std::isnan(step) ? 1 : (int)std::min(std::max(step, 0.0), (double)kCompactLevels) + 1;
      }
      const bool negative = std::signbit(v);
      code[i] = (uint8_t)(level | (negative ? 128 : 0));
      if (residual && finite_band) {  // a segment with inf/nan: its residual was wiped, keep it so
        // the positions are far apart in a large residual: fetch ahead, as take_impl does
        if (i + kAhead < b) __builtin_prefetch(residual + idx[i + kAhead], 1);
        const float arrives = (float)(negative ? -table[level] : table[level]);
        const float lost = v - arrives;
        if (std::isfinite(lost)) residual[idx[i]] += lost;
      }
    }
  }
  for (int64_t i = 0; i < k; ++i) write_index(i, (uint64_t)idx[i]);
  return 0;
}

template <typename I>
int64_t compact_unpack_impl(const uint8_t* rows, int64_t world, int64_t row_bytes, int64_t band_at, int64_t high_at,
                            int64_t high_bits, int64_t low_at, int64_t code_at, int64_t k, const int64_t* slots,
                            int64_t nseg, int low_bits, float* val, I* idx, int64_t out_row, bool sign) {
  const uint64_t mask = low_bits ? ((uint64_t)1 << low_bits) - 1 : 0;
  const int64_t high_bytes = (high_bits + 7) / 8;
  double table[128];
  for (int64_t r = 0; r < world; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    const uint8_t *high = row + high_at, *low = row + low_at, *code = row + code_at;
    float* v = (float*)((char*)val + r * out_row);
    I* out = (I*)((char*)idx + r * out_row);
    int64_t i = 0;
    for (int64_t byte = 0; byte < high_bytes; ++byte) {
      unsigned bits = high[byte];
      while (bits) {
        const int64_t pos = byte * 8 + __builtin_ctz(bits);
        bits &= bits - 1;
        if (pos >= high_bits || i >= k) return r + 1;
        out[i] = (I)((uint64_t)(pos - i) << low_bits);
        ++i;
      }
    }
    if (i != k) return r + 1;
    if (low_bits) {
      for (int64_t j = 0; j < k; ++j) {
        const uint64_t o = (uint64_t)j * (uint64_t)low_bits;
        const int shift = (int)(o & 7);
        uint64_t bits = 0;
        for (int b = 0; b < low_bits + shift; b += 8) bits |= (uint64_t)low[(o >> 3) + (b >> 3)] << b;
        out[j] = (I)((uint64_t)out[j] | ((bits >> shift) & mask));
      }
    }
    if (sign) {
      for (int64_t s = 0; s < nseg; ++s) {
        float scale;
        std::memcpy(&scale, row + band_at + 4 * s, 4);
        for (int64_t j = slots[s]; j < slots[s + 1]; ++j) {
          const float m = (j + 1 < k && out[j] == out[j + 1]) ? 0.0f : scale;  // a repeat: zero
          v[j] = ((code[j >> 3] >> (j & 7)) & 1) ? -m : m;
        }
      }
      continue;
    }
    float bands[2];
    for (int64_t s = 0; s < nseg; ++s) {
      std::memcpy(bands, row + band_at + 8 * s, 8);
      compact_table(bands[0], bands[1], table);
      for (int64_t j = slots[s]; j < slots[s + 1]; ++j) {
        const uint8_t c = code[j];
        const double m = table[c & 127];
        v[j] = (float)((c & 128) ? -m : m);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Error feedback's fold for a rank that does not select this step (sparse allreduce): x += g,
// returning 1 when the result holds inf/nan (the caller then flags the exchange and wipes x).
int64_t hvdtk_fold_f32(float* x, const float* g, int64_t n) { return fold_impl<float, uint32_t>(x, g, n); }


// Scatter a bucket's allgathered pairs into its tensors; see scatter_segments_impl.
int64_t hvdtk_scatter_segments_f32(float* const* dest, const int64_t* bounds, int64_t nseg,
                                   const void* idx, int index_bytes, const void* val, int64_t world,
                                   int64_t k, int64_t row_bytes, double div, double mul) {
  return scatter_segments_dispatch(dest, bounds, nseg, idx, index_bytes, val, world, k, row_bytes, div, mul);
}

// The same with IEEE half values (TopK(fp16_values=True)) into fp32 tensors.
int64_t hvdtk_scatter_segments_f16_f32(float* const* dest, const int64_t* bounds, int64_t nseg,
                                       const void* idx, int index_bytes, const void* val, int64_t world,
                                       int64_t k, int64_t row_bytes, double div, double mul) {
  return scatter_segments_dispatch<float, Half>(dest, bounds, nseg, idx, index_bytes, val, world, k, row_bytes,
                                                div, mul);
}

// Gather x at k positions into out, zeroing them in x with `zero`; see take_impl. Returns the
// number of positions outside [0, n).
int64_t hvdtk_take_f32(float* x, int64_t n, const void* idx, int index_bytes, int64_t k, float* out, int zero) {
  return take_dispatch(x, n, idx, index_bytes, k, out, zero);
}


// Compact pairs (hvd_topk/compact.py). Pack one rank's sorted float32 pairs; with residual, add
// what each value's rounding took back into it. Returns -1 (nothing written) when the indices
// are not sorted or one's bit falls outside the high_bits-long bitmap.
int64_t hvdtk_compact_pack_f32(const float* val, const void* idx, int index_bytes, int64_t k, const int64_t* slots,
                               int64_t nseg, int low_bits, float* band, uint8_t* high, int64_t high_bytes,
                               int64_t high_bits, uint8_t* low, int64_t low_bytes, uint8_t* code, float* residual,
                               int sign) {
  if (index_bytes == 4)
    return compact_pack_impl(val, (const int32_t*)idx, k, slots, nseg, low_bits, band, high, high_bytes, high_bits,
                             low, low_bytes, code, residual, sign != 0);
  return compact_pack_impl(val, (const int64_t*)idx, k, slots, nseg, low_bits, band, high, high_bytes, high_bits,
                           low, low_bytes, code, residual, sign != 0);
}

// Unpack `world` compact rows into wide pairs (float32 values, int32/int64 indices; out_row
// bytes between rows). Returns 0, or 1 + the first row whose bitmap does not hold k pairs.
int64_t hvdtk_compact_unpack_f32(const uint8_t* rows, int64_t world, int64_t row_bytes, int64_t band_at,
                                 int64_t high_at, int64_t high_bits, int64_t low_at, int64_t code_at, int64_t k,
                                 const int64_t* slots, int64_t nseg, int low_bits, float* val, void* idx,
                                 int index_bytes, int64_t out_row, int sign) {
  if (index_bytes == 4)
    return compact_unpack_impl(rows, world, row_bytes, band_at, high_at, high_bits, low_at, code_at, k, slots, nseg,
                               low_bits, val, (int32_t*)idx, out_row, sign != 0);
  return compact_unpack_impl(rows, world, row_bytes, band_at, high_at, high_bits, low_at, code_at, k, slots, nseg,
                             low_bits, val, (int64_t*)idx, out_row, sign != 0);
}

int hvdtk_abi_version() { return 12; }

// Segmented selection in one call (a fusion bucket's tensors, k each); see segments_impl.
// Returns the number of pairs written (the sum of min(ks[s], segment size)).
int64_t hvdtk_select_segments_f32(float* x, int64_t nseg, const int64_t* bounds, const int64_t* ks,
                                  void* idx, int index_bytes, float* val, int exact, int zero_sent,
                                  uint64_t seed, int64_t* flags, uint8_t* nonfinite) {
  return segments_dispatch(x, nseg, bounds, ks, idx, index_bytes, val, exact, zero_sent, seed, flags, nonfinite);
}

// Select the k largest |x| of one tensor. With g (may be null), first x += g (error feedback's
// fold), in the same pass over memory that selects. Writes k ascending positions (+ offset,
// int32 or int64 per index_bytes) to idx and their values to val; with zero_sent, x is then
// zeroed at those positions (error feedback: what was sent is gone).
// flags (3 int64): [non-finite seen, passes, entries filled up]. Returns k (clamped to n).
int64_t hvdtk_select_f32(float* x, const float* g, int64_t n, int64_t k, int64_t offset, void* idx,
                         int index_bytes, float* val, int exact, int zero_sent, uint64_t seed,
                         int64_t* flags) {
  return dispatch_index(x, g, n, k, offset, idx, index_bytes, val, exact, zero_sent, seed, flags);
}

}  // extern "C"
