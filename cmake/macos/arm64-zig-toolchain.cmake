# Cross-compiles etmlx for macOS arm64 on Linux with Zig (`make check-macos`; cmake/macos/README.md).
#
#   cmake -S . -B build-macos/cmake --toolchain cmake/macos/arm64-zig-toolchain.cmake \
#         -DETMLX_ZIG=/path/to/zig -DETMLX_MACOS_STUBS=/path/to/stubs -DETMLX_SITE_PACKAGES=/path/to/macos/site-packages
#
# Zig brings clang, a Mach-O linker and macOS's libc headers (no SDK: no frameworks). Its libc++ headers compile
# the C++; the link takes libc++ from ETMLX_MACOS_STUBS/libc++.tbd (stubs.py), a stub of the system
# /usr/lib/libc++.1.dylib, instead of Zig's own static libc++: libmlx and libexecutorch use the system one, and
# two copies of libc++abi in one process break exceptions thrown across them.
set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
# The wheels' minimum (their LC_BUILD_VERSION minos).
set(CMAKE_OSX_DEPLOYMENT_TARGET 14.0 CACHE STRING "")
set(ETMLX_MACOS_TARGET aarch64-macos.14.0)

# try_compile projects read this file again: hand them the same settings.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES ETMLX_ZIG ETMLX_MACOS_STUBS ETMLX_SITE_PACKAGES)
foreach(_etmlx_var ETMLX_ZIG ETMLX_MACOS_STUBS ETMLX_SITE_PACKAGES)
  if(NOT ${_etmlx_var})
    message(FATAL_ERROR "etmlx: the macOS toolchain needs -D${_etmlx_var}=... (make check-macos passes it)")
  endif()
endforeach()

# One wrapper per tool: CMake wants one program for the archiver, and the zig cache stays beside the build.
set(_etmlx_wrappers "${CMAKE_BINARY_DIR}/zig-wrappers")
get_filename_component(_etmlx_zig_cache "${ETMLX_MACOS_STUBS}/../zig-cache" ABSOLUTE)
function(_etmlx_zig_wrapper name)
  file(WRITE "${_etmlx_wrappers}/zig-${name}"
       "#!/bin/sh\nexport ZIG_GLOBAL_CACHE_DIR='${_etmlx_zig_cache}' ZIG_LOCAL_CACHE_DIR='${_etmlx_zig_cache}'\n"
       "exec '${ETMLX_ZIG}' ${ARGN} \"$@\"\n")
  file(CHMOD "${_etmlx_wrappers}/zig-${name}"
       PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endfunction()
_etmlx_zig_wrapper(cc "cc -target ${ETMLX_MACOS_TARGET}")
_etmlx_zig_wrapper(c++ "c++ -target ${ETMLX_MACOS_TARGET}")
_etmlx_zig_wrapper(ar ar)
_etmlx_zig_wrapper(ranlib ranlib)
set(CMAKE_C_COMPILER "${_etmlx_wrappers}/zig-cc")
set(CMAKE_CXX_COMPILER "${_etmlx_wrappers}/zig-c++")
set(CMAKE_AR "${_etmlx_wrappers}/zig-ar" CACHE FILEPATH "")
set(CMAKE_RANLIB "${_etmlx_wrappers}/zig-ranlib" CACHE FILEPATH "")
# No SDK: nothing for CMake's Darwin module to pass as -isysroot or to ask xcrun about.
set(CMAKE_OSX_SYSROOT "" CACHE PATH "")
# install_name_tool does not exist here: every binary is linked with its install rpath (@loader_path...) as
# built, which is what the check inspects.
set(CMAKE_BUILD_WITH_INSTALL_RPATH ON)

# libc++'s availability markup, as Apple's SDK turns it on: for this deployment target the headers keep inline
# what the system libc++ of macOS 14 does not export (std::__hash_memory, ...) instead of calling the dylib.
set(CMAKE_CXX_FLAGS_INIT
    "-U_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS -D_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS=1")
set(_etmlx_link "-nostdlib++ ${ETMLX_MACOS_STUBS}/usr/lib/libc++.tbd")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${_etmlx_link}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "${_etmlx_link}")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "${_etmlx_link}")

# Look for libraries and packages only in the macOS wheels (ETMLX_SITE_PACKAGES) and the stubs, never in this
# machine's /usr; programs (none are run) may come from the host.
set(CMAKE_FIND_ROOT_PATH "${ETMLX_SITE_PACKAGES};${ETMLX_MACOS_STUBS}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# Adjustments to the configured project that only this cross build needs (read after project()).
set(CMAKE_PROJECT_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/cross-fixups.cmake")
