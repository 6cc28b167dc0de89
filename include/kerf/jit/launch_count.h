// How many kernel launches the calling thread has queued (GPU) or run (CPU) since it
// started: a caller whose op failed compares the count before and after it to tell
// whether the op may have written its outputs (nothing is written but by a launch).
#pragma once

#include <cstdint>

namespace kerf {

uint64_t launches_on_this_thread();

}  // namespace kerf
