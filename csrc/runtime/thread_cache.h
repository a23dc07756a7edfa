// One per-thread, set-associative cache in front of the shared (locked) tables of the per-op path:
// the op-info lookup, the plan cache and the fast path's plans. A hit takes no lock. Entries are
// found by hash, then confirmed by the caller's full comparison (a hash alone is never trusted);
// a full set replaces its entries round-robin, so two keys that map to one set do not evict each
// other on every call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace hypershard::runtime {

template <typename Entry, size_t kSets, size_t kWays>
class ThreadCache {
  static_assert((kSets & (kSets - 1)) == 0, "ThreadCache: the set count must be a power of two");

 public:
  // The entry of this hash that `same` confirms, or null.
  template <typename Same>
  Entry* find(uint64_t hash, Same&& same) {
    Set& set = set_of(hash);
    for (Way& way : set.ways)
      if (way.used && way.hash == hash && same(way.entry)) return &way.entry;
    return nullptr;
  }
  // The entry to fill for this hash (the set's next victim).
  Entry& claim(uint64_t hash) {
    Set& set = set_of(hash);
    Way& way = set.ways[set.next];
    set.next = static_cast<uint8_t>((set.next + 1) % kWays);
    way.used = true;
    way.hash = hash;
    way.entry = Entry();
    return way.entry;
  }

 private:
  struct Way {
    bool used = false;
    uint64_t hash = 0;
    Entry entry;
  };
  struct Set {
    std::array<Way, kWays> ways;
    uint8_t next = 0;
  };
  Set& set_of(uint64_t hash) { return sets_[(hash ^ (hash >> 17)) & (kSets - 1)]; }

  std::vector<Set> sets_ = std::vector<Set>(kSets);  // on the heap: thread stacks stay small
};

}  // namespace hypershard::runtime
