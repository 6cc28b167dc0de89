// The message of an exception a test expects, for CHECK_THAT(..., Catch::Contains(...)),
// and CHECK_INVALID for the common case of kerf::InvalidArgument.
#pragma once

#include <exception>
#include <string>

namespace kerf::test {

// The message of the exception of type Ex that f throws ("<no error>" or "<other: ...>" otherwise).
template <class Ex, class F>
std::string thrown(F f) {
  try {
    f();
  } catch (const Ex& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<other: ") + e.what() + ">";
  }
  return "<no error>";
}

}  // namespace kerf::test

// Checks that `call` throws kerf::InvalidArgument with a message containing `text`
// (for Catch test cases; `call` is a statement, run inside a lambda capturing by reference).
#define CHECK_INVALID(call, text) \
  CHECK_THAT(kerf::test::thrown<kerf::InvalidArgument>([&] { call; }), Catch::Contains(text))
