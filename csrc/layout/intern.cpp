#include "layout/intern.h"

#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "layout/error.h"

namespace hypershard::layout {
namespace {

std::string content_key(const Layout& l) { return l.mesh()->to_string() + "|" + l.to_string(); }

struct PairHash {
  size_t operator()(const std::pair<const Layout*, const Layout*>& p) const {
    return std::hash<const Layout*>()(p.first) * 1000003u ^ std::hash<const Layout*>()(p.second);
  }
};

// Never destroyed: tensors may still refer to layouts during static destruction at exit.
std::shared_mutex g_layouts_mutex;
auto* g_by_content = new std::unordered_map<std::string, LayoutPtr>();
auto* g_by_address = new std::unordered_map<const Layout*, LayoutPtr>();
std::shared_mutex g_plans_mutex;
auto* g_plans = new std::unordered_map<std::pair<const Layout*, const Layout*>, RedistributePlan, PairHash>();

}  // namespace

LayoutPtr intern_layout(const Layout& layout) {
  auto key = content_key(layout);
  {
    std::shared_lock<std::shared_mutex> read(g_layouts_mutex);
    auto it = g_by_content->find(key);
    if (it != g_by_content->end()) return it->second;
  }
  std::unique_lock<std::shared_mutex> write(g_layouts_mutex);
  auto it = g_by_content->find(key);
  if (it != g_by_content->end()) return it->second;
  auto ptr = std::make_shared<const Layout>(layout);
  g_by_content->emplace(std::move(key), ptr);
  g_by_address->emplace(ptr.get(), ptr);
  return ptr;
}

LayoutPtr interned(const Layout* raw) {
  std::shared_lock<std::shared_mutex> read(g_layouts_mutex);
  auto it = g_by_address->find(raw);
  HS_CHECK(it != g_by_address->end(), "layout", "internal error: a layout that was never interned");
  return it->second;
}

size_t interned_count() {
  std::shared_lock<std::shared_mutex> read(g_layouts_mutex);
  return g_by_content->size();
}

const RedistributePlan& cached_plan(const LayoutPtr& src, const LayoutPtr& dst) {
  const auto key = std::make_pair(src.get(), dst.get());
  {
    std::shared_lock<std::shared_mutex> read(g_plans_mutex);
    auto it = g_plans->find(key);
    if (it != g_plans->end()) return it->second;
  }
  auto plan = plan_redistribute(*src, *dst);
  std::unique_lock<std::shared_mutex> write(g_plans_mutex);
  // unordered_map keeps references to its elements valid across rehashing.
  return g_plans->emplace(key, std::move(plan)).first->second;
}

size_t cached_plan_count() {
  std::shared_lock<std::shared_mutex> read(g_plans_mutex);
  return g_plans->size();
}

}  // namespace hypershard::layout
