#include "mask_file.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>

namespace etmlx {

bool read_mask_file(const std::string& path, int64_t words, std::vector<std::vector<int32_t>>* rows,
                    std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "--mask-file: cannot read " + path;
    return false;
  }
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    const std::string where = "--mask-file " + path + " line " + std::to_string(number);
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    std::vector<int32_t> row;
    const char* p = line.c_str();
    while (true) {
      while (*p == ' ' || *p == '\t' || *p == ',' || *p == '\r') ++p;
      if (*p == '\0') break;
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(p, &end, 0);
      if (end == p || errno != 0 || v < -2147483648LL || v > 4294967295LL ||
          (*end != '\0' && *end != ' ' && *end != '\t' && *end != ',' && *end != '\r')) {
        *error = where + ": '" + std::string(p, end > p ? end : p + 1) +
                 "...' is not a 32-bit word (decimal or 0x hex)";
        return false;
      }
      row.push_back(static_cast<int32_t>(static_cast<uint32_t>(v)));
      p = end;
    }
    if (static_cast<int64_t>(row.size()) != words) {
      *error = where + " has " + std::to_string(row.size()) + " words; the program's mask takes " +
               std::to_string(words) + " (ceil(V/32))";
      return false;
    }
    rows->push_back(std::move(row));
  }
  return true;
}

}  // namespace etmlx
