# Helpers shared by the in-tree build and out-of-tree plugins (installed with the SDK).

# EMBER_CUDA_VERSION: CUDA_VERSION-style number (13000 = 13.0) of the LibTorch in use, 0 for a
# CPU-only LibTorch. Part of every plugin's build fingerprint.
function(ember_cuda_version out)
  set(v 0)
  if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
    set(ver "${CUDAToolkit_VERSION}")
    if(NOT ver)
      set(ver "${CUDA_VERSION}")
    endif()
    if(ver MATCHES "^([0-9]+)\\.([0-9]+)")
      math(EXPR v "${CMAKE_MATCH_1} * 1000 + ${CMAKE_MATCH_2} * 10")
    endif()
  endif()
  set(${out} ${v} PARENT_SCOPE)
endfunction()

function(ember_sdk_set_build_defines target)
  ember_cuda_version(cuda)
  set_property(TARGET ${target} APPEND PROPERTY INTERFACE_COMPILE_DEFINITIONS EMBER_CUDA_VERSION=${cuda})
endfunction()

# Out of tree, a project that builds several plugins can parse LibTorch's headers once for all of
# them: with EMBER_PLUGIN_PCH=ON, the first ember_add_plugin precompiles <torch/torch.h> in a
# target of its own (ember_plugin_pch) and every plugin of the project reuses it. Off by default:
# for one plugin of one source file, precompiling costs more than it saves. In tree, the engine's
# own precompiled header (ember_use_pch) serves every plugin instead.
option(EMBER_PLUGIN_PCH "Share one precompiled LibTorch header among this project's plugins" OFF)
function(_ember_plugin_pch target)
  if(NOT TARGET ember_plugin_pch)
    set(src "${CMAKE_BINARY_DIR}/ember_plugin_pch.cpp")
    if(NOT EXISTS "${src}")
      file(WRITE "${src}" "// The object that carries the shared precompiled LibTorch header (EMBER_PLUGIN_PCH).\n")
    endif()
    add_library(ember_plugin_pch STATIC "${src}")
    target_link_libraries(ember_plugin_pch PRIVATE Ember::sdk)
    # The flags the plugins compile with (GCC refuses a precompiled header built with others).
    set_target_properties(ember_plugin_pch PROPERTIES POSITION_INDEPENDENT_CODE ON
      CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
    target_precompile_headers(ember_plugin_pch PRIVATE <torch/torch.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM ember_plugin_pch)
  # Say so when the compiler ignores the header (different flags), rather than go slow silently.
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Winvalid-pch>)
endfunction()

# ember_add_plugin(<name> SOURCES <files...> [LIBRARIES <libs...>] [OUTPUT_DIRECTORY <dir>]
#                  [DEFINITIONS <defs...>] [NO_INSTALL])
# Builds lib<name>.so with hidden visibility; only the descriptor symbol is exported.
function(ember_add_plugin name)
  cmake_parse_arguments(ARG "NO_INSTALL" "OUTPUT_DIRECTORY;TARGET" "SOURCES;LIBRARIES;DEFINITIONS" ${ARGN})
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "ember_add_plugin(${name}): SOURCES is required")
  endif()
  set(target ${ARG_TARGET})
  if(NOT target)
    set(target ember_plugin_${name})
  endif()
  add_library(${target} MODULE ${ARG_SOURCES})
  # The contract (<ember/...>) and the header-only helpers (<ember/support/...>).
  if(TARGET Ember::sdk)
    target_link_libraries(${target} PRIVATE Ember::sdk Ember::support ${ARG_LIBRARIES})
  else()
    target_link_libraries(${target} PRIVATE ember_sdk ember_sdk_support ${ARG_LIBRARIES})
  endif()
  target_compile_definitions(${target} PRIVATE ${ARG_DEFINITIONS})
  set_target_properties(${target} PROPERTIES
    PREFIX "lib" OUTPUT_NAME ${name}
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    POSITION_INDEPENDENT_CODE ON)
  # Fail at link time, not at load time, on a missing symbol.
  target_link_options(${target} PRIVATE -Wl,--no-undefined)
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIRECTORY})
  elseif(DEFINED EMBER_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${EMBER_PLUGIN_OUTPUT_DIR})
  endif()
  if(COMMAND ember_use_pch)
    ember_use_pch(${target})
  elseif(EMBER_PLUGIN_PCH)
    _ember_plugin_pch(${target})
  endif()
  if(NOT ARG_NO_INSTALL)
    install(TARGETS ${target} LIBRARY DESTINATION ${EMBER_PLUGIN_INSTALL_DIR})
  endif()
endfunction()
