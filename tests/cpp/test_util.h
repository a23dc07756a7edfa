#pragma once

#include <gtest/gtest.h>

#include <string>

#include "layout/error.h"

namespace hypershard::testing {

// Runs `fn` and expects a LayoutError in the house format whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const layout::LayoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(needle), std::string::npos) << message;
    EXPECT_EQ(message.rfind("hypershard: ", 0), 0u) << message;
  }
}

}  // namespace hypershard::testing
