// pytorch_tokenizers' headers include <nlohmann/json.hpp> and <re2/re2.h>,
// which its wheel does not ship: the compiled library carries both inside.
// The headers use them only in declarations of private members and of
// classes etmlx_decode never touches, so an incomplete type is all they need.
// Not a JSON library: nothing here parses anything.
#pragma once

namespace nlohmann {
class json;
}  // namespace nlohmann
