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
  endif()
  if(NOT ARG_NO_INSTALL)
    install(TARGETS ${target} LIBRARY DESTINATION ${EMBER_PLUGIN_INSTALL_DIR})
  endif()
endfunction()
