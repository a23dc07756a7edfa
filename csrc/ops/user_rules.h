// User rules (user_rules.cpp): an op described from Python (hypershard.register_rule) as dimension
// factors, and the late registration it needs. Its own header, so that adding it recompiles only
// the files that use it.
#pragma once

#include <string>
#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops {

struct UserRule {
  std::string text;                  // "mk,kn->mn", for messages
  std::vector<std::string> inputs;   // labels per tensor argument, in the call's order ('.': never sharded)
  std::vector<std::string> outputs;  // labels per returned tensor
  std::string whole;                 // labels never sharded
  std::vector<bool> linear;          // per input: may carry its Partial(sum) into the results
};

// Checks `rule` and (re)places it as `op_name`'s rule, family "user"; refuses an op with a native
// rule. runtime::register_user_rule (dispatch.cpp) also refreshes an op already called.
void register_user_rule(const std::string& op_name, UserRule rule);

// The ops with a user rule, "mylib::op" style.
std::vector<std::string> user_rule_names();

// A rule added after start-up (registry.cpp), under `family`. Not thread-safe against calls of
// that op: register before it runs.
void add_late_rule(const char* family, const std::string& op_name, Rule rule);

}  // namespace hypershard::ops

namespace hypershard::runtime {

// hypershard.register_rule: `rule` becomes op's rule ("mylib::op" or "aten::x.overload"), also for
// an op called before (its cached plans dropped). Defined in dispatch.cpp.
void register_user_rule(const std::string& op, ops::UserRule rule);

}  // namespace hypershard::runtime
