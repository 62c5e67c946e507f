// Compiles the shared precompiled header (see the top-level CMakeLists.txt).
