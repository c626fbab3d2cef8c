// See ../nlohmann/json.hpp: pytorch_tokenizers' headers include this but
// declare nothing that needs RE2 itself.
#pragma once
