#include "lazy_check.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include <mlx/ops.h>
#include <mlx/transforms.h>

namespace etmlx {

namespace mx = mlx::core;

namespace {

std::atomic<int64_t> g_last_premature{-1};
std::atomic<uint64_t> g_checked_calls{0};

}  // namespace

static int64_t count_premature(const std::vector<mx::array>& outputs, const std::vector<mx::array>& seeded) {
  std::unordered_set<uintptr_t> seeds;
  for (const auto& a : seeded) seeds.insert(a.id());
  int64_t n = 0;
  for (const auto& a : outputs) {
    if (seeds.count(a.id()) == 0 && a.status() != mx::array::Status::unscheduled) ++n;
  }
  return n;
}

void record_premature(const std::vector<mx::array>& outputs, const std::vector<mx::array>& seeded) {
  g_last_premature.store(count_premature(outputs, seeded));
  g_checked_calls.fetch_add(1);
}

}  // namespace etmlx

// Node outputs already materialised before the last checked call's evaluation (-1: none checked).
extern "C" __attribute__((visibility("default"))) int64_t etmlx_last_call_premature() {
  return etmlx::g_last_premature.load();
}

extern "C" __attribute__((visibility("default"))) uint64_t etmlx_checked_calls() {
  return etmlx::g_checked_calls.load();
}

// The control of the check, for tests: with no kernel evaluating early a count of 0 could also
// mean a check that sees nothing. This builds seed -> a -> b, evaluates a (as a kernel reading
// its operand on the host would) and returns the count over {a, b}: 1 when the check sees.
// It records nothing: the last call's count is left as it was.
extern "C" __attribute__((visibility("default"))) int64_t etmlx_lazy_check_control() {
  namespace mx = mlx::core;
  const mx::array seed = mx::array({1.0f, 2.0f});
  const mx::array a = mx::add(seed, mx::array(1.0f));
  const mx::array b = mx::multiply(a, mx::array(2.0f));
  mx::eval(a);
  return etmlx::count_premature({a, b}, {seed});
}
