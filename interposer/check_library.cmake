# SPDX-License-Identifier: Apache-2.0
# cmake -DLIB=libtmsdisk.so -DMAP=libtmsdisk.map -DNM=nm -DREADELF=readelf -P check_library.cmake
# Fails unless the library exports exactly the version script's global names (the script is generated
# from the hook table, so this checks that hooks.cpp defines every hook and nothing else leaks out),
# unversioned, and needs nothing but the C and C++ runtimes: it is injected into arbitrary programs,
# so any other dependency (libcuda, liburing, spdlog, fmt) would be loaded into all of them.

foreach(var LIB MAP NM READELF)
  if(NOT ${var})
    message(FATAL_ERROR "check_library.cmake: -D${var}=... is required")
  endif()
endforeach()

# Names under "global:" in the version script (comments stripped).
file(READ ${MAP} map_text)
string(REGEX REPLACE "/\\*([^*]|\\*+[^*/])*\\*+/" "" map_text "${map_text}")
string(REGEX MATCH "global:([^}]*)local: *\\*;" global_block "${map_text}")
if(NOT global_block)
  message(FATAL_ERROR "${MAP} has no \"global: ... local: *;\" block: everything would be exported")
endif()
set(global_block "${CMAKE_MATCH_1}")
string(REGEX MATCHALL "[A-Za-z_][A-Za-z0-9_]*" expected "${global_block}")
list(SORT expected)

execute_process(COMMAND ${NM} -D --defined-only ${LIB} OUTPUT_VARIABLE nm_out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} failed on ${LIB}")
endif()
string(REPLACE "\n" ";" nm_lines "${nm_out}")
set(exported "")
foreach(line IN LISTS nm_lines)
  if(line MATCHES "^[0-9a-fA-F]* +[A-Za-z] +([^ @]+)(@.*)?$")
    set(name "${CMAKE_MATCH_1}")
    # An export under a version of our own would not bind references such as dlsym@GLIBC_2.34.
    if(CMAKE_MATCH_2)
      message(FATAL_ERROR "${LIB} exports ${name} with a symbol version (${CMAKE_MATCH_2}); the version node must stay anonymous")
    endif()
    list(APPEND exported "${name}")
  endif()
endforeach()
list(REMOVE_DUPLICATES exported)
list(SORT exported)
if(NOT exported STREQUAL expected)
  message(FATAL_ERROR "exports of ${LIB} differ from ${MAP}:\n  exported: ${exported}\n  expected: ${expected}")
endif()

execute_process(COMMAND ${READELF} -d ${LIB} OUTPUT_VARIABLE dyn RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${READELF} failed on ${LIB}")
endif()
# -z nodelete: a dlclose (ctypes) must never unmap code the shim's control thread is running.
if(NOT dyn MATCHES "\\(FLAGS_1\\)[^\n]*NODELETE")
  message(FATAL_ERROR "${LIB} lacks the NODELETE flag (-Wl,-z,nodelete)")
endif()
if(dyn MATCHES "\\(TEXTREL\\)")
  message(FATAL_ERROR "${LIB} has text relocations: some object in it was not built with -fPIC")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[[^]\n]+\\]" needed_lines "${dyn}")
foreach(line IN LISTS needed_lines)
  string(REGEX REPLACE ".*\\[([^]]+)\\]" "\\1" lib "${line}")
  if(NOT lib MATCHES "^(libc|libstdc\\+\\+|libgcc_s|libm|libdl|libpthread|ld-linux[-a-z0-9_.]*)\\.so")
    message(FATAL_ERROR "${LIB} needs ${lib}; only the C and C++ runtimes are allowed")
  endif()
endforeach()

# ldd sees transitive dependencies too.
find_program(LDD ldd)
if(LDD)
  execute_process(COMMAND ${LDD} ${LIB} OUTPUT_VARIABLE ldd_out RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND ldd_out MATCHES "(libcuda|liburing|spdlog|libfmt|not found)")
    message(FATAL_ERROR "ldd ${LIB} shows a forbidden or missing dependency:\n${ldd_out}")
  endif()
endif()
message(STATUS "${LIB}: exports ${exported}; dependencies ok")
