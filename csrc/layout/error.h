// hypershard::layout errors: one exception type for the layout and op layers.
//
// Messages follow the house format "hypershard: <context>: <problem>; allowed: <set>" so
// that every rank that hits the same invalid input prints the same line. The runtime converts
// LayoutError into c10::Error at the dispatcher boundary.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace hypershard::layout {

class LayoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& out, const T& first, const Rest&... rest) {
  out << first;
  append(out, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<< into one message.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  detail::append(out, args...);
  return out.str();
}

[[noreturn]] inline void fail(const std::string& context, const std::string& problem) {
  throw LayoutError("hypershard: " + context + ": " + problem);
}

}  // namespace hypershard::layout

// Checked in release builds too: a violated check is a user error or a broken invariant,
// and either must surface as a clear message, never as undefined behaviour.
#define HS_CHECK(cond, context, ...)                                                     \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      ::hypershard::layout::fail((context), ::hypershard::layout::str_cat(__VA_ARGS__)); \
    }                                                                                    \
  } while (false)
