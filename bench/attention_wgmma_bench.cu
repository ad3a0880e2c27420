// The wgmma kernels (attention_wgmma.h: the forward pass in both schedules, the backward pass)
// against the mma.sync kernels (forward_cuda, backward_cuda), side by side in
// one run: causal, bf16, Llama-3-8B's grouped heads (32 query heads, 8 kv heads, head dim 128;
// or 64 / 16 heads of 64), a fixed number of tokens a call split into sequences of 1k to 16k.
// Rounds take the kernels in turn; each figure is the median of the rounds. TFLOP/s count the
// causal products only (forward 4 b t^2 h d / 2, backward 2.5x that, as
// bench/attention_bench.py counts them). Each line also gives the largest difference of the
// wgmma kernel's output (O; dQ, dK, dV) from the mma.sync kernel's, relative to the largest value.
//
// usage: attention_wgmma_bench [--tokens 16384] [--seqs 1024,4096,16384] [--head-dim 128]
//                              [--rounds 7] [--calls 10]
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_wgmma.h"
#include "attention_test_util.h"
#include "pimhbm/adamw_math.h"

namespace {

using pimhbm::attention::Forward;
using pimhbm::attention::Shape;
using pimhbm::attention::WgmmaSchedule;
constexpr auto kSerial = WgmmaSchedule::kSerial, kAhead = WgmmaSchedule::kScoresAhead;

#define BENCH_CHECK(expr)                                                \
  do {                                                                   \
    cudaError_t err_ = (expr);                                           \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

struct Options {
  int64_t tokens = 16384;
  std::vector<int64_t> seqs = {1024, 4096, 16384};
  int64_t head_dim = 128;
  int rounds = 7, calls = 10;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "attention_wgmma_bench: %s\nusage: attention_wgmma_bench [--tokens N] "
               "[--seqs N,N,...] [--head-dim 64|128] [--rounds N] [--calls N]\n",
               why);
  std::exit(2);
}

// A whole decimal number in [1, limit], or the usage and exit 2.
int64_t positive(const std::string& text, int64_t limit, const char* what) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || value < 1 || value > limit) {
    usage((std::string(what) + " must be a whole number from 1 to " + std::to_string(limit) +
           ", not '" + text + "'")
              .c_str());
  }
  return value;
}

Options parse(int argc, char** argv) {
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") usage("the forward and backward passes on wgmma, timed");
    if (i + 1 >= argc) usage((arg + " needs a value").c_str());
    const std::string value = argv[i + 1];
    if (arg == "--tokens") {
      o.tokens = positive(value, kMaxInt, "--tokens");
    } else if (arg == "--head-dim") {
      o.head_dim = positive(value, 128, "--head-dim");
    } else if (arg == "--rounds") {
      o.rounds = static_cast<int>(positive(value, 1000, "--rounds"));
    } else if (arg == "--calls") {
      o.calls = static_cast<int>(positive(value, 1000, "--calls"));
    } else if (arg == "--seqs") {
      o.seqs.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) {
        o.seqs.push_back(positive(item, kMaxInt, "each of --seqs"));
      }
      if (o.seqs.empty()) usage("--seqs needs at least one length");
    } else {
      usage(("unknown option " + arg).c_str());
    }
  }
  if (!pimhbm::attention::wgmma_head_dim(o.head_dim)) usage("--head-dim must be 64 or 128");
  return o;
}

// bf16 values from a fixed LCG, roughly uniform in [-2, 2): the same inputs in every run.
std::vector<uint16_t> inputs(size_t n, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& e : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    e = pimhbm::float_to_bf16(static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) /
                              (1 << 22));
  }
  return out;
}

struct Device {
  uint16_t* ptr = nullptr;
  explicit Device(const std::vector<uint16_t>& host) {
    BENCH_CHECK(cudaMalloc(&ptr, host.size() * 2));
    BENCH_CHECK(cudaMemcpy(ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  }
  explicit Device(size_t bytes) { BENCH_CHECK(cudaMalloc(&ptr, bytes)); }
  ~Device() { cudaFree(ptr); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};

// A kernel call on fixed buffers.
struct Variant {
  const char* name;
  std::function<cudaError_t()> call;
};

// Milliseconds a call, `calls` calls back to back.
float time_calls(const Variant& v, int calls) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  BENCH_CHECK(cudaEventRecord(start));
  for (int i = 0; i < calls; ++i) BENCH_CHECK(v.call());
  BENCH_CHECK(cudaEventRecord(stop));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  return ms / calls;
}

// A bf16 output of a call: where it lies and how many elements it has.
struct Output {
  uint16_t* ptr;
  size_t n;
};

// The values of `outs` after one call, every one of them poisoned first (a value the call does
// not write compares as a difference).
std::vector<std::vector<uint16_t>> outputs_of(const Variant& v, const std::vector<Output>& outs) {
  for (const auto& out : outs) BENCH_CHECK(cudaMemset(out.ptr, 0xFF, out.n * 2));
  BENCH_CHECK(v.call());
  std::vector<std::vector<uint16_t>> host;
  for (const auto& out : outs) {
    host.emplace_back(out.n);
    BENCH_CHECK(cudaMemcpy(host.back().data(), out.ptr, out.n * 2, cudaMemcpyDeviceToHost));
  }
  return host;
}

// One line: the variants' median times (the first is the baseline of the ratios) and each
// later one's largest difference from the first's values of `outs`, named by `names`.
void line(const char* pass, const std::vector<Variant>& variants, const Options& opt, double flops,
          const std::vector<Output>& outs, const std::vector<const char*>& names) {
  std::vector<std::vector<float>> ms(variants.size());
  for (const auto& variant : variants) time_calls(variant, 2);  // warm-up
  for (int round = 0; round < opt.rounds; ++round) {
    for (size_t i = 0; i < variants.size(); ++i) {
      ms[i].push_back(time_calls(variants[i], opt.calls));
    }
  }
  const auto reference = outputs_of(variants[0], outs);
  double base = 0;
  for (size_t i = 0; i < variants.size(); ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    const double median = ms[i][ms[i].size() / 2];
    if (i == 0) base = median;
    std::printf("  %-8s %-12s %7.3f ms %6.1f TFLOP/s %5.2fx", pass, variants[i].name, median,
                flops / (median * 1e-3) / 1e12, median / base);
    if (i > 0) {
      const auto got = outputs_of(variants[i], outs);
      for (size_t k = 0; k < outs.size(); ++k) {
        std::printf(" %s diff %.1e", names[k],
                    pimhbm::testing::relative_error(got[k], reference[k]));
      }
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

void row(const Options& opt, int64_t seq) {
  using pimhbm::attention::Backward;
  using pimhbm::attention::backward_cuda;
  using pimhbm::attention::backward_wgmma;
  using pimhbm::attention::forward_cuda;
  using pimhbm::attention::forward_wgmma;
  const int64_t heads = opt.head_dim == 128 ? 32 : 64, kv_heads = heads / 4;
  const Shape s{std::max<int64_t>(1, opt.tokens / seq), seq, heads, kv_heads, opt.head_dim, true};
  Device q(inputs(s.q_elems(), 1)), k(inputs(s.kv_elems(), 2)), v(inputs(s.kv_elems(), 3));
  Device d_o(inputs(s.q_elems(), 4)), o(s.q_elems() * 2), lse(s.rows() * 4), delta(s.rows() * 4);
  Device dq(s.q_elems() * 2), dk(s.kv_elems() * 2), dv(s.kv_elems() * 2);
  auto* lse_f = reinterpret_cast<float*>(lse.ptr);
  const Forward f{s, q.ptr, k.ptr, v.ptr, o.ptr, lse_f};
  const Backward g{s,      q.ptr,   k.ptr, v.ptr,
                   o.ptr,  d_o.ptr, lse_f, reinterpret_cast<float*>(delta.ptr),
                   dq.ptr, dk.ptr,  dv.ptr};
  const size_t q_elems = s.q_elems(), kv_elems = s.kv_elems();
  const double flops = 4.0 * s.batch * seq * seq * heads * opt.head_dim / 2;
  std::printf("seq %lld, batch %lld\n", static_cast<long long>(seq),
              static_cast<long long>(s.batch));
  line("forward",
       {{"mma.sync", [&] { return forward_cuda(f, 0); }},
        {"wgmma serial", [&] { return forward_wgmma(f, kSerial, 0); }},
        {"wgmma ahead", [&] { return forward_wgmma(f, kAhead, 0); }}},
       opt, flops, {{o.ptr, q_elems}}, {"O"});
  BENCH_CHECK(forward_cuda(f, 0));  // the backward passes start from the mma.sync kernel's o, lse
  line("backward",
       {{"mma.sync", [&] { return backward_cuda(g, 0); }},
        {"wgmma", [&] { return backward_wgmma(g, 0); }}},
       opt, 2.5 * flops, {{dq.ptr, q_elems}, {dk.ptr, kv_elems}, {dv.ptr, kv_elems}},
       {"dQ", "dK", "dV"});
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  bool takes = false;
  const cudaError_t err = pimhbm::attention::wgmma_takes(opt.head_dim, &takes);
  if (err != cudaSuccess || !takes) {
    if (err != cudaSuccess) {
      std::printf("attention_wgmma_bench: no device: %s\n", cudaGetErrorString(err));
    } else {
      std::printf("attention_wgmma_bench: needs an sm_90 GPU\n");
    }
    return 1;
  }
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s; head dim %lld, causal, %lld tokens a call, medians of %d rounds of %d calls\n",
              prop.name, static_cast<long long>(opt.head_dim), static_cast<long long>(opt.tokens),
              opt.rounds, opt.calls);
  for (int64_t seq : opt.seqs) row(opt, seq);
  return 0;
}
