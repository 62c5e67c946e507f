# Optional dependencies. Each is AUTO (used when found), ON (required: configuring fails without
# it) or OFF, and what a build without it loses is said once here and again at run time by the
# part that misses it. scripts/build.sh asks for all of them (setup installs them), so CI builds
# and tests every part; a machine without them (e.g. the GPU test machine) still builds the rest.
#   EMBER_MPI       Open MPI (libopenmpi-dev, openmpi-bin): CPU ranks of ddp and sharded.
#                   Without it: NCCL only (CUDA ranks).
#   EMBER_CAIRO     cairo (libcairo2-dev): lr_find.png and `engine plot`.
#                   Without it: lr_find writes only its CSV; `engine plot` says why it cannot.
#   EMBER_PROTOBUF  protobuf (libprotobuf-dev, protobuf-compiler): the tensorboard logger.
#                   Without it: no tensorboard plugin (asking for it says why).
#   EMBER_TCMALLOC  tcmalloc (libtcmalloc-minimal4, gperftools): the `engine` binary's allocator.
#                   Without it: glibc's malloc (slower and more memory on LibTorch's CPU
#                   workloads, docs/build.md). Never with sanitizers, which bring their own.
find_package(PkgConfig QUIET)
set(EMBER_NOT_BUILT "")

function(ember_optional_dependency name found what without)
  set(mode "${EMBER_${name}}")
  string(TOUPPER "${mode}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "EMBER_${name} = '${EMBER_${name}}': expected AUTO, ON or OFF")
  endif()
  if(mode STREQUAL "OFF")
    set(with OFF)
  elseif(found)
    set(with ON)
  elseif(mode STREQUAL "ON")
    message(FATAL_ERROR "EMBER_${name}=ON but ${what} was not found (scripts/setup.sh installs it; or configure with -DEMBER_${name}=AUTO to build without it: ${without})")
  else()
    set(with OFF)
  endif()
  if(with)
    message(STATUS "Ember: with ${what}")
  else()
    message(STATUS "Ember: WITHOUT ${what}: ${without}")
  endif()
  set(EMBER_WITH_${name} ${with} PARENT_SCOPE)
endfunction()

set(EMBER_MPI AUTO CACHE STRING "Open MPI for CPU ranks of ddp/sharded: AUTO, ON or OFF")
set(EMBER_CAIRO AUTO CACHE STRING "cairo for lr_find.png and `engine plot`: AUTO, ON or OFF")
set(EMBER_PROTOBUF AUTO CACHE STRING "protobuf for the tensorboard logger: AUTO, ON or OFF")
set(EMBER_TCMALLOC AUTO CACHE STRING "tcmalloc as the engine binary's allocator: AUTO, ON or OFF")

# Through pkg-config: FindMPI's C component needs the C language, which this project does not enable.
set(ember_found_mpi OFF)
set(ember_found_cairo OFF)
if(PkgConfig_FOUND)
  if(NOT EMBER_MPI STREQUAL "OFF")
    pkg_check_modules(EMBER_OMPI QUIET IMPORTED_TARGET GLOBAL ompi-c)
    set(ember_found_mpi ${EMBER_OMPI_FOUND})
  endif()
  if(NOT EMBER_CAIRO STREQUAL "OFF")
    pkg_check_modules(EMBER_CAIRO_PC QUIET IMPORTED_TARGET GLOBAL cairo)
    set(ember_found_cairo ${EMBER_CAIRO_PC_FOUND})
  endif()
endif()
set(ember_found_protobuf OFF)
if(NOT EMBER_PROTOBUF STREQUAL "OFF")
  find_package(Protobuf QUIET)
  if(Protobuf_FOUND AND TARGET protobuf::protoc AND TARGET protobuf::libprotobuf-lite)
    set(ember_found_protobuf ON)
  endif()
endif()

# The runtime library is enough (no -dev package): linking the executable against it puts its
# malloc ahead of glibc's for the whole process, plugins and LibTorch included.
set(ember_found_tcmalloc OFF)
if(NOT EMBER_TCMALLOC STREQUAL "OFF")
  if(NOT EMBER_SANITIZE STREQUAL "")
    set(EMBER_TCMALLOC OFF)  # sanitizers replace malloc themselves
  else()
    find_library(EMBER_TCMALLOC_LIBRARY NAMES tcmalloc_minimal libtcmalloc_minimal.so.4)
    if(EMBER_TCMALLOC_LIBRARY)
      set(ember_found_tcmalloc ON)
    endif()
  endif()
endif()

ember_optional_dependency(MPI "${ember_found_mpi}" "Open MPI (libopenmpi-dev, openmpi-bin)"
  "ddp and sharded offer NCCL only (CUDA ranks); CPU ranks stop at start-up saying why")
ember_optional_dependency(CAIRO "${ember_found_cairo}" "cairo (libcairo2-dev)"
  "lr_find writes lr_find.csv without the PNG; `engine plot` says it cannot draw")
ember_optional_dependency(PROTOBUF "${ember_found_protobuf}" "protobuf (libprotobuf-dev, protobuf-compiler)"
  "no tensorboard logger plugin")
ember_optional_dependency(TCMALLOC "${ember_found_tcmalloc}" "tcmalloc (libtcmalloc-minimal4)"
  "the engine binary allocates with glibc's malloc (slower, more memory)")

# Plugins left out of this build, with the reason: the engine names them when one is asked for.
if(NOT EMBER_WITH_PROTOBUF)
  list(APPEND EMBER_NOT_BUILT "tensorboard=this build has no protobuf (install libprotobuf-dev and protobuf-compiler, then rebuild)")
endif()
