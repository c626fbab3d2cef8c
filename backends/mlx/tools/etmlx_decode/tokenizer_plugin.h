// The one entry point of libetmlx_text_tokenizer (hf_tokenizer_plugin.cpp),
// which etmlx_decode loads with dlopen when a program carries a tokenizer.
//
// Why a plugin: pytorch_tokenizers ships its C++ library only as a Python
// extension module, which needs libpython, and whose static initializers
// print log lines to stderr when it is loaded. Loaded on demand with stderr
// muted, a run that prints nothing else prints nothing, a run without text
// never loads it, and etmlx_decode itself links neither library.
//
// Plugin and program are built together by this project's CMake, with the
// same compiler and standard library, so the entry point passes C++ types.
#pragma once

#include <map>
#include <string>

#include "text_tokenizer.h"

// Builds the tokenizer from its files (name -> bytes); nullptr + `error` on failure.
using EtmlxTextTokenizerLoad = etmlx::TextTokenizer* (*)(const std::map<std::string, std::string>& files,
                                                        std::string* error);
#define ETMLX_TEXT_TOKENIZER_LOAD_SYMBOL "etmlx_text_tokenizer_load"
