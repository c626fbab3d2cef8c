# Run by the macOS cross build only (arm64-zig-toolchain.cmake names it CMAKE_PROJECT_INCLUDE): changes a
# build on a Mac does not need, kept out of CMakeLists.txt.

# A MODULE library (the tokenizer plugin) is linked as a dylib (MH_DYLIB), not a bundle (-bundle): Zig 0.17's
# linker crashes linking a bundle with -undefined dynamic_lookup. Both are loaded by dlopen; symbols resolve
# the same way.
set(CMAKE_SHARED_MODULE_CREATE_CXX_FLAGS "-shared -Wl,-headerpad_max_install_names")

# Two changes to the finished configuration:
function(_etmlx_macos_cross_fixups)
  # No SDK, so no frameworks: MLX's exported target names the frameworks libmlx.dylib links (Metal,
  # Foundation, QuartzCore, Accelerate) by their paths on the machine that built the wheel. libmlx.dylib loads
  # them itself and etmlx calls none of them directly, so its binaries link without them (the check in
  # tests/macos/ verifies that they do not load them).
  if(TARGET mlx)
    get_target_property(_libs mlx INTERFACE_LINK_LIBRARIES)
    if(_libs)
      list(FILTER _libs EXCLUDE REGEX "\\.framework$")
      set_target_properties(mlx PROPERTIES INTERFACE_LINK_LIBRARIES "${_libs}")
    endif()
  endif()
  # Outputs the build puts into the source tree (the backend library into runtime/_lib, for Python to load)
  # stay in the build folder: a macOS binary there would be taken for this machine's.
  get_property(_targets DIRECTORY "${CMAKE_SOURCE_DIR}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(_target IN LISTS _targets)
    foreach(_property LIBRARY_OUTPUT_DIRECTORY RUNTIME_OUTPUT_DIRECTORY ARCHIVE_OUTPUT_DIRECTORY)
      get_target_property(_dir ${_target} ${_property})
      if(_dir AND _dir MATCHES "^${CMAKE_SOURCE_DIR}/")
        set_target_properties(${_target} PROPERTIES ${_property} "${CMAKE_BINARY_DIR}")
      endif()
    endforeach()
  endforeach()
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _etmlx_macos_cross_fixups)
