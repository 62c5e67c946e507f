# EMBER_SANITIZE: build every Ember target (engine, plugins, tests, the precompiled header) with
# AddressSanitizer + UndefinedBehaviorSanitizer ("address,undefined") or ThreadSanitizer
# ("thread"). LibTorch itself stays uninstrumented; scripts/sanitize.sh runs the suites with the
# runtime options and suppressions in tests/sanitizers/ (docs/build.md says why each is there).
if(EMBER_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "EMBER_FUZZ needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++ (scripts/fuzz.sh does)")
  endif()
  # Coverage feedback for every Ember target; the fuzz executables link libFuzzer's main.
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
if(EMBER_SANITIZE STREQUAL "")
  return()
endif()
if(EMBER_SANITIZE STREQUAL "address,undefined" OR EMBER_SANITIZE STREQUAL "undefined,address")
  # float-cast-overflow is not part of GCC's "undefined" group; a config value cast to an integer
  # is exactly where it would fire. vptr is left out: plugins are built with hidden visibility, so
  # a class's type_info exists once per .so and the dynamic-type check would report every
  # cross-plugin call through an SDK interface.
  set(ember_sanitize_flags -fsanitize=address,undefined,float-cast-overflow -fno-sanitize=vptr
      -fno-sanitize-recover=undefined,float-cast-overflow)
elseif(EMBER_SANITIZE STREQUAL "thread")
  set(ember_sanitize_flags -fsanitize=thread)
else()
  message(FATAL_ERROR "EMBER_SANITIZE=\"${EMBER_SANITIZE}\": use \"address,undefined\" or \"thread\" (or leave it empty)")
endif()
# Frame pointers and line tables: readable reports at little build cost. -O1 (after the build
# type's -O3, so it wins) compiles faster and is what the sanitizers' authors recommend; the time
# of a run goes into LibTorch's kernels, which are not rebuilt.
add_compile_options(${ember_sanitize_flags} -fno-omit-frame-pointer -g1 -O1)
add_link_options(${ember_sanitize_flags})
message(STATUS "Ember: sanitizers ${EMBER_SANITIZE} (run the suites with scripts/sanitize.sh)")
