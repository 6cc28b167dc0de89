// How kerf reads an on/off environment variable: surrounding blanks dropped, any case;
// 0/off/false/no mean off, 1/on/true/yes mean on.
#pragma once

#include <cctype>
#include <string>

namespace kerf::detail {

inline std::string switch_word(std::string v) {
  const size_t a = v.find_first_not_of(" \t\r\n"), b = v.find_last_not_of(" \t\r\n");
  v = a == std::string::npos ? std::string() : v.substr(a, b - a + 1);
  for (char& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
  return v;
}
inline bool is_off_word(const std::string& w) { return w == "0" || w == "off" || w == "false" || w == "no"; }
inline bool is_on_word(const std::string& w) { return w == "1" || w == "on" || w == "true" || w == "yes"; }

}  // namespace kerf::detail
