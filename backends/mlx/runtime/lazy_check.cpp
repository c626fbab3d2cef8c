#include "lazy_check.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

namespace etmlx {

namespace mx = mlx::core;

namespace {

std::atomic<int64_t> g_last_premature{-1};
std::atomic<uint64_t> g_checked_calls{0};

}  // namespace

bool lazy_check_enabled() {
  // Read per call, not once: a test flips it between programs in one process.
  const char* v = std::getenv("ETMLX_CHECK_LAZY");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

void record_premature(const std::vector<mx::array>& outputs, const std::vector<mx::array>& seeded) {
  std::unordered_set<uintptr_t> seeds;
  for (const auto& a : seeded) seeds.insert(a.id());
  int64_t n = 0;
  for (const auto& a : outputs) {
    if (seeds.count(a.id()) == 0 && a.status() != mx::array::Status::unscheduled) ++n;
  }
  g_last_premature.store(n);
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
