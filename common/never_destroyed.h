// A T that is constructed once and never destroyed: process-wide handles (the
// dlopen'ed CUDA driver and NVRTC) must outlive objects released during static
// destruction, which may still call into them.
#pragma once

#include <utility>

namespace kerf::detail {

template <class T>
union NeverDestroyed {
  T value;
  template <class... Args>
  explicit NeverDestroyed(Args&&... args) : value(std::forward<Args>(args)...) {}
  ~NeverDestroyed() {}
};

}  // namespace kerf::detail
