// hvd_topk's CPU selection kernel: top-k by magnitude in about one pass over memory.
//
// 1. Sample: fresh random positions on every call: single entries in tensors that fit in cache,
//    runs of 32 (two cache lines of fp32) in larger ones, so sampling costs a few thousand
//    cache misses, not S.
// 2. Threshold: the sample's r-th largest magnitude, r chosen so that the expected number of
//    entries at or above it is k plus a few standard deviations (so it is rarely too few).
// 3. One pass: collect the positions with |x| >= threshold, in ascending order (read only).
// 4. Keep exactly k: the k-th largest candidate magnitude (a coarse histogram, then
//    nth_element inside one bin),
//    then a scan of the candidates in position order. Output indices are ascending.
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
// (hvdtk_scatter_segments_*).
//
// Plain C ABI (called through ctypes with tensors' data pointers): no torch headers, so the
// build takes a second and the library works with any torch version.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <queue>
#include <utility>
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
inline float key_of(T v) {  // magnitude as the sort key; NaN sorts above everything
  float a = std::fabs(static_cast<float>(v));
  return a == a ? a : INFINITY;
}

template <typename T>
inline bool finite(T v) { return std::isfinite(static_cast<double>(v)); }

struct Positions {  // growable; entries past `size` may be written while collecting
  int64_t* p = nullptr;
  int64_t size = 0, cap = 0;
  void reserve(int64_t need) {
    if (need <= cap) return;
    int64_t c = std::max(need, 2 * cap);
    int64_t* q = new int64_t[c];
    if (size) std::memcpy(q, p, size * sizeof(int64_t));
    delete[] p;
    p = q;
    cap = c;
  }
  ~Positions() { delete[] p; }
};

struct Scratch {  // reused across calls (one per thread): no allocation in steady state
  std::vector<uint32_t> sample, keys;
  Positions cand;
  uint64_t calls = 0;  // varies the sample positions from call to call
};
thread_local Scratch scratch;

template <typename T>
inline uint32_t key_bits(T v) {  // order-preserving integer key of |v|; NaN above inf
  float a = std::fabs(static_cast<float>(v));
  uint32_t b;
  std::memcpy(&b, &a, 4);
  return b;
}

// The k-th largest of keys (k >= 1): a histogram of the top 12 bits of the keys (sign,
// exponent and 3 mantissa bits: bins an eighth of an octave wide, 16 KiB to clear, scanned
// from the largest key's bin down) finds the bin holding it; nth_element on that bin's keys
// finds it exactly. Few keys: nth_element directly. Both stay cheap when called once per
// tensor of a model with hundreds of tensors.
constexpr int kTopBits = 12;
constexpr size_t kHistogramMin = 4096;

inline uint32_t kth_largest(const std::vector<uint32_t>& keys, int64_t k) {
  static thread_local std::vector<uint32_t> part;
  if (keys.size() < kHistogramMin) {
    part.assign(keys.begin(), keys.end());
    std::nth_element(part.begin(), part.begin() + (k - 1), part.end(), std::greater<uint32_t>());
    return part[k - 1];
  }
  static thread_local std::vector<uint32_t> hist;
  constexpr int shift = 32 - kTopBits;
  hist.assign(size_t(1) << kTopBits, 0);
  uint32_t high = 0;
  for (uint32_t b : keys) {
    ++hist[b >> shift];
    high = std::max(high, b);
  }
  int64_t above = 0;
  uint32_t bin = 0;
  for (int64_t h = high >> shift; h >= 0; --h) {
    if (above + hist[h] >= k) { bin = (uint32_t)h; break; }
    above += hist[h];
  }
  part.clear();
  for (uint32_t b : keys)
    if ((b >> shift) == bin) part.push_back(b);
  int64_t need = k - above;  // 1 <= need <= part.size()
  std::nth_element(part.begin(), part.begin() + (need - 1), part.end(), std::greater<uint32_t>());
  return part[need - 1];
}

// Threshold such that about `want` of the n entries are expected at or above it.
template <typename T>
float sample_threshold(const T* x, int64_t n, double want, uint64_t seed) {
  std::vector<uint32_t>& s = scratch.sample;
  s.clear();
  s.reserve(kSample);
  Rng rng{seed ^ (uint64_t)n * 0x2545F4914F6CDD1Dull ^ (++scratch.calls * 0xD1B54A32D192ED03ull)};
  // Fresh positions on every call (a fixed set could keep missing a structured gradient's large
  // values, step after step). Tensors up to kSingles entries sit in cache: sample single entries
  // (independent); larger ones in runs of kRun to keep the number of cache misses small.
  int64_t step = n <= kSingles ? 1 : kRun;
  int64_t runs = std::min(n <= kSingles ? kSample / 4 : kSample,
                          std::min(n / 4, std::max(kMinSample, n / kSampleShare))) / step;
  for (int64_t j = 0; j < runs; ++j) {
    int64_t start = (int64_t)(rng.next() % (uint64_t)(n - step + 1));
    for (int64_t i = start; i < start + step; ++i)
      s.push_back(key_bits(x[i]));
  }
  int64_t S = (int64_t)s.size();
  double expect = want * (double)S / (double)n;           // sample entries above the k-th
  double r = expect + 4.0 * std::sqrt(expect) + 8.0;       // margin: rarely too few
  if (r >= (double)S) return -INFINITY;                    // take everything
  uint32_t bits = kth_largest(s, (int64_t)r);
  float t;
  std::memcpy(&t, &bits, 4);
  return t == t ? t : INFINITY;
}

// Appends to c the positions b + j (j < 16) whose bit is set in `bits`, in order.
inline int64_t* emit(int64_t* out, uint32_t bits, int64_t b) {
  while (bits) {
    *out++ = b + __builtin_ctz(bits);
    bits &= bits - 1;
  }
  return out;
}

// Generic block: collect key >= t (> t when strict). False if a value is not finite.
template <typename T>
bool collect_block(const T* x, int64_t b, int64_t e, float t, bool strict, int64_t*& out) {
  bool ok = true;
  for (int64_t i = b; i < e; ++i) {
    T v = x[i];
    ok &= finite(v);
    float a = key_of(v);
    *out = i;
    out += strict ? (a > t) : (a >= t);
  }
  return ok;
}

#if defined(__x86_64__)
// float32, 16 entries at a time. The magnitude's bits (sign cleared) compare as integers in
// the same order as the floats, and inf/nan have the largest bits of all: one integer compare
// per lane collects NaN (which must be sent) along with the large values, and the running
// maximum of the bits tells whether anything was not finite. Only the (rare) 16-entry groups
// holding a candidate are walked.
//   tb: the threshold's bits; an entry is collected when bits > tb - 1 (>=) or bits > tb (>).
__attribute__((target("avx2"))) bool collect_f32_avx2(const float* x, int64_t n, int32_t gt,
                                                      int64_t*& out, int64_t& i) {
  const __m256i mag = _mm256_set1_epi32(0x7fffffff), thr = _mm256_set1_epi32(gt);
  __m256i hi = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {
    __m256i a0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i)), mag);
    __m256i a1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i + 8)), mag);
    hi = _mm256_max_epi32(hi, _mm256_max_epi32(a0, a1));
    uint32_t hit = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a0, thr))) |
                   ((uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a1, thr))) << 8);
    if (hit) out = emit(out, hit, i);
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256((__m256i*)lanes, hi);
  int32_t m = 0;
  for (int l = 0; l < 8; ++l) m = std::max(m, lanes[l]);
  return m < 0x7f800000;
}

// The same with SSE2 (every x86-64 CPU): four lanes, non-finite checked by a compare.
inline bool collect_f32_sse2(const float* x, int64_t n, int32_t gt, int64_t*& out, int64_t& i) {
  const __m128i mag = _mm_set1_epi32(0x7fffffff), thr = _mm_set1_epi32(gt);
  const __m128i big = _mm_set1_epi32(0x7f7fffff);
  uint32_t bad = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t hit = 0;
    for (int q = 0; q < 4; ++q) {
      __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i*)(x + i + 4 * q)), mag);
      hit |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, thr))) << (4 * q);
      bad |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, big)));
    }
    if (hit) out = emit(out, hit, i);
  }
  return bad == 0;
}

inline bool collect_f32(const float* x, int64_t n, float t, bool strict, int64_t*& out) {
  // Integer form of "key >= t" (or "> t"); t <= 0 and -inf collect everything (or every non-zero).
  int32_t tb;
  if (!(t > 0.0f)) {
    tb = strict ? 0 : -1;
  } else {
    std::memcpy(&tb, &t, 4);
    if (!strict) tb -= 1;
  }
  static const bool avx2 = __builtin_cpu_supports("avx2");
  int64_t i = 0;
  bool ok = avx2 ? collect_f32_avx2(x, n, tb, out, i) : collect_f32_sse2(x, n, tb, out, i);
  if (i < n) ok &= collect_block(x, i, n, t, strict, out);
  return ok;
}
#endif

// One pass: collect ascending positions with key >= t (or > t when strict). Returns whether every x was finite.
template <typename T>
bool collect(const T* x, int64_t n, float t, bool strict) {
  Positions& c = scratch.cand;
  c.size = 0;
  bool ok = true;
  constexpr int64_t B = 1 << 16;
  for (int64_t b = 0; b < n; b += B) {
    int64_t e = std::min(n, b + B);
    c.reserve(c.size + (e - b));  // room for every entry of the block
    int64_t* out = c.p + c.size;
    int64_t* start = out;
#if defined(__x86_64__)
    if constexpr (std::is_same<T, float>::value) {
      ok &= collect_f32(x + b, e - b, t, strict, out);
      for (int64_t* q = start; q < out; ++q) *q += b;
    } else
#endif
    {
      ok &= collect_block(x, b, e, t, strict, out);
    }
    c.size += out - start;
  }
  return ok;
}

// Keep the k largest candidates, in position order, into (idx, val).
template <typename T, typename I>
void keep_k(const T* x, int64_t k, int64_t offset, I* idx, T* val) {
  const int64_t* c = scratch.cand.p;
  int64_t m = scratch.cand.size;
  if (m == k) {
    for (int64_t j = 0; j < k; ++j) { idx[j] = (I)(c[j] + offset); val[j] = x[c[j]]; }
    return;
  }
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(m);
  for (int64_t j = 0; j < m; ++j) keys[j] = key_bits(x[c[j]]);
  uint32_t kth = kth_largest(keys, k);
  int64_t above = 0;
  for (int64_t j = 0; j < m; ++j) above += keys[j] > kth;
  int64_t ties = k - above;  // entries equal to the k-th to keep, first positions first
  int64_t o = 0;
  for (int64_t j = 0; j < m && o < k; ++j) {
    bool take = keys[j] > kth || (keys[j] == kth && ties-- > 0);
    if (take) { idx[o] = (I)(c[j] + offset); val[o] = x[c[j]]; ++o; }
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

template <typename T, typename I>
int64_t select_impl(T* x, int64_t n, int64_t k, int64_t offset, I* idx, T* val,
                    int exact, int zero_sent, uint64_t seed, int64_t* flags) {
  flags[0] = 0;  // non-finite seen
  flags[1] = 0;  // passes over x
  flags[2] = 0;  // entries filled up (SAMPLED shortfall)
  if (k <= 0 || n <= 0) return 0;
  if (k > n) k = n;
  float t = (n <= kSmall) ? -INFINITY : sample_threshold(x, n, (double)k, seed);
  bool strict = false;
  if (t == 0.0f && !exact) strict = true;  // mostly zeros: collect the non-zeros only
  bool ok = collect(x, n, t, strict);
  flags[1] = 1;
  double want = (double)k;
  // Too few collected: EXACT passes again until it has k; SAMPLED only when it has less than
  // 95% of k (then fills up the rest), so its recall is never below 95%.
  int64_t enough = exact ? k : k - k / 20;
  while (scratch.cand.size < enough && !strict) {  // strict: the rest are zeros (ties)
    want *= 4.0;  // too few: lower the threshold and pass again (rare)
    float t2 = want >= (double)n ? -INFINITY : sample_threshold(x, n, want, seed + 1);
    if (!(t2 < t)) t2 = -INFINITY;
    t = t2;
    collect(x, n, t, false);
    flags[1] += 1;
  }
  flags[0] = ok ? 0 : 1;
  if (scratch.cand.size >= k) {
    keep_k(x, k, offset, idx, val);
  } else {
    flags[2] = k - scratch.cand.size;
    fill_up(x, n, k, offset, idx, val);
  }
  if (zero_sent)
    for (int64_t j = 0; j < k; ++j) x[(int64_t)idx[j] - offset] = T(0);
  return k;
}

template <typename T>
int64_t dispatch_index(T* x, int64_t n, int64_t k, int64_t offset, void* idx,
                       int index_bytes, T* val, int exact, int zero_sent, uint64_t seed,
                       int64_t* flags) {
  if (index_bytes == 4)
    return select_impl(x, n, k, offset, (int32_t*)idx, val, exact, zero_sent, seed, flags);
  return select_impl(x, n, k, offset, (int64_t*)idx, val, exact, zero_sent, seed, flags);
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
    select_impl(x + b, n, k, b, idx + out, val + out, exact, zero_sent,
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

// Decode a bucket's allgathered pairs into its tensors' own buffers in one sequential write:
// dest[s] holds positions [bounds[s], bounds[s+1]) of the bucket and is overwritten entirely.
// Every rank's pairs are ascending (as the selection writes them), so a merge over the ranks
// visits positions in order: the gaps are zero-filled, and each touched position gets the sum
// of what the ranks sent, added in rank order (the same bits as adding rank after rank into
// zeros), times mul / div. One pass of writes, no read-for-ownership of random cache lines,
// no separate zeroing. Returns the number of pairs that were out of range or out of order
// (non-zero means the ranks disagree on the message layout); the result is then unusable.
template <typename T>
struct SegmentWriter {
  T* const* dest;
  const int64_t* bounds;
  int64_t nseg, cur = 0, next = 0;  // next: first position not written yet
  T* at(int64_t i) {
    while (i >= bounds[cur + 1]) ++cur;
    return dest[cur] + (i - bounds[cur]);
  }
  void zero_until(int64_t end) {  // zero positions [next, end)
    while (next < end) {
      while (next >= bounds[cur + 1]) ++cur;
      int64_t stop = std::min(end, bounds[cur + 1]);
      std::memset(dest[cur] + (next - bounds[cur]), 0, (stop - next) * sizeof(T));
      next = stop;
    }
  }
};

// The next position of the merge and the ranks' sum there (in rank order), over `world`
// ascending rows; `pos` holds each row's cursor. A linear scan of the cursors for a few ranks,
// a min-heap of (position, rank) beyond: equal positions come out in rank order either way.
template <typename T, typename I>
struct RankMerge {
  const char *idx, *val;
  int64_t world, k, row_bytes;
  std::vector<int64_t> pos;
  using Head = std::pair<int64_t, int64_t>;
  std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heads;
  static constexpr int64_t kLinear = 8;

  RankMerge(const char* i, const char* v, int64_t w, int64_t k_, int64_t rb)
      : idx(i), val(v), world(w), k(k_), row_bytes(rb), pos(w, 0) {
    if (world > kLinear)
      for (int64_t r = 0; r < world && k > 0; ++r) heads.push({index(r), r});
  }
  int64_t index(int64_t r) const { return (int64_t)((const I*)(idx + r * row_bytes))[pos[r]]; }
  T value(int64_t r) const { return ((const T*)(val + r * row_bytes))[pos[r]]; }

  bool next(int64_t& i, T& sum) {  // false when every row is used up
    bool first = true;
    if (world <= kLinear) {
      i = INT64_MAX;
      for (int64_t r = 0; r < world; ++r)
        if (pos[r] < k) i = std::min(i, index(r));
      if (i == INT64_MAX) return false;
      for (int64_t r = 0; r < world; ++r)
        while (pos[r] < k && index(r) == i) {  // equal positions in one row add up too
          sum = first ? value(r) : static_cast<T>(sum + value(r));
          first = false;
          ++pos[r];
        }
      return true;
    }
    if (heads.empty()) return false;
    i = heads.top().first;
    while (!heads.empty() && heads.top().first == i) {
      int64_t r = heads.top().second;
      heads.pop();
      sum = first ? value(r) : static_cast<T>(sum + value(r));
      first = false;
      if (++pos[r] < k) heads.push({index(r), r});
    }
    return true;
  }
};

template <typename T, typename I>
int64_t scatter_segments_impl(T* const* dest, const int64_t* bounds, int64_t nseg, const char* idx,
                              const char* val, int64_t world, int64_t k, int64_t row_bytes,
                              double div, double mul) {
  const int64_t total = bounds[nseg];
  SegmentWriter<T> out{dest, bounds, nseg};
  RankMerge<T, I> merge(idx, val, world, k, row_bytes);
  const T d = (T)div, m = (T)mul;
  int64_t bad = 0, last = -1, i;
  T sum;
  while (merge.next(i, sum)) {
    if (i < 0 || i >= total || i <= last) { ++bad; continue; }  // out of range or out of order
    out.zero_until(i);
    *out.at(i) = div == 1.0 && mul == 1.0 ? sum : mul == 1.0 ? static_cast<T>(sum / d)
                                                            : static_cast<T>(sum / d * m);
    out.next = i + 1;
    last = i;
  }
  out.zero_until(total);
  return bad;
}

template <typename T>
int64_t scatter_segments_dispatch(T* const* dest, const int64_t* bounds, int64_t nseg, const void* idx,
                                  int index_bytes, const void* val, int64_t world, int64_t k,
                                  int64_t row_bytes, double div, double mul) {
  if (index_bytes == 4)
    return scatter_segments_impl<T, int32_t>(dest, bounds, nseg, (const char*)idx, (const char*)val,
                                             world, k, row_bytes, div, mul);
  return scatter_segments_impl<T, int64_t>(dest, bounds, nseg, (const char*)idx, (const char*)val,
                                           world, k, row_bytes, div, mul);
}

}  // namespace

extern "C" {

// Scatter a bucket's allgathered pairs into its tensors; see scatter_segments_impl.
int64_t hvdtk_scatter_segments_f32(float* const* dest, const int64_t* bounds, int64_t nseg,
                                   const void* idx, int index_bytes, const void* val, int64_t world,
                                   int64_t k, int64_t row_bytes, double div, double mul) {
  return scatter_segments_dispatch(dest, bounds, nseg, idx, index_bytes, val, world, k, row_bytes, div, mul);
}

int64_t hvdtk_scatter_segments_f64(double* const* dest, const int64_t* bounds, int64_t nseg,
                                   const void* idx, int index_bytes, const void* val, int64_t world,
                                   int64_t k, int64_t row_bytes, double div, double mul) {
  return scatter_segments_dispatch(dest, bounds, nseg, idx, index_bytes, val, world, k, row_bytes, div, mul);
}

int hvdtk_abi_version() { return 4; }

// Segmented selection in one call (a fusion bucket's tensors, k each); see segments_impl.
// Returns the number of pairs written (the sum of min(ks[s], segment size)).
int64_t hvdtk_select_segments_f32(float* x, int64_t nseg, const int64_t* bounds, const int64_t* ks,
                                  void* idx, int index_bytes, float* val, int exact, int zero_sent,
                                  uint64_t seed, int64_t* flags, uint8_t* nonfinite) {
  return segments_dispatch(x, nseg, bounds, ks, idx, index_bytes, val, exact, zero_sent, seed, flags, nonfinite);
}

int64_t hvdtk_select_segments_f64(double* x, int64_t nseg, const int64_t* bounds, const int64_t* ks,
                                  void* idx, int index_bytes, double* val, int exact, int zero_sent,
                                  uint64_t seed, int64_t* flags, uint8_t* nonfinite) {
  return segments_dispatch(x, nseg, bounds, ks, idx, index_bytes, val, exact, zero_sent, seed, flags, nonfinite);
}

// Select the k largest |x| of one tensor. Writes k ascending
// positions (+ offset, int32 or int64 per index_bytes) to idx and their values to val; with
// zero_sent, x is then zeroed at those positions (error feedback: what was sent is gone).
// flags (3 int64): [non-finite seen, passes, entries filled up]. Returns k (clamped to n).
int64_t hvdtk_select_f32(float* x, int64_t n, int64_t k, int64_t offset, void* idx,
                         int index_bytes, float* val, int exact, int zero_sent, uint64_t seed,
                         int64_t* flags) {
  return dispatch_index(x, n, k, offset, idx, index_bytes, val, exact, zero_sent, seed, flags);
}

int64_t hvdtk_select_f64(double* x, int64_t n, int64_t k, int64_t offset, void* idx,
                         int index_bytes, double* val, int exact, int zero_sent, uint64_t seed,
                         int64_t* flags) {
  return dispatch_index(x, n, k, offset, idx, index_bytes, val, exact, zero_sent, seed, flags);
}

}  // extern "C"
