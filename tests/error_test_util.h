// The message of an exception a test expects, for CHECK_THAT(..., Catch::Contains(...)).
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
