// Expecting errors: the message of the kestrel::Error a call must throw (anything else, or nothing,
// fails the test), and a check that a message names every given piece.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <initializer_list>
#include <string>

#include "kestrel/runtime/error.h"

namespace kestrel::testing {

// Runs fn, which must throw kestrel::Error; returns its message (empty after a test failure).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected kestrel::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected kestrel::Error, nothing was thrown";
  return "";
}

inline void expect_has(const std::string& msg, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
}

}  // namespace kestrel::testing
