// Typed PrivateUse2 kernels for every ruled op of a signature the fast path reads (fast_path.cpp): the operator flow
// without boxing, for calls that need no redistribution; everything else goes to the boxed fallback.
#pragma once

#include <string>
#include <vector>

namespace hypershard::runtime {

// Registers the typed kernels (install_dispatch calls it once, before the fallback takes the
// remaining composite-explicit ops).
void register_fast_paths();
// The ops with a typed kernel on this torch (ops with a rule and one of the signatures), "aten::add.Tensor" style.
std::vector<std::string> fast_path_ops();
// On by default; off, every call takes the boxed fallback (tests compare the two paths, the
// benchmark measures what the fast path saves).
void set_fast_path(bool on);
bool fast_path_enabled();
// Tests: every fast-path call also boxes its arguments and checks that the boxed flow's plan key
// (plan_key.h) is the fast path's, word for word (an internal error otherwise).
void set_key_check(bool on);

}  // namespace hypershard::runtime
