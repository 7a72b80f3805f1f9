# pipeline_tests: the concurrent pipeline tests alone, for the ThreadSanitizer tree that
# scripts/sanitize.sh builds (-DCKPTFS_PIPELINE_TESTS_ONLY=ON). Included by the top-level
# CMakeLists.txt after every library and test target exists.
#
# Why a separate target: TSan is only asked of the staging/flush/journal/cache code, and a
# TSan build of every unit test compiles the DCP index, the FUSE server and the admin tool
# for nothing. This tree compiles only the listed test files and the library sources they
# reach: the closure is followed through `#include "..."` lines, taking foo/bar.cc along
# with every foo/bar.h it meets. The libraries keep their own flags and usage requirements;
# only their SOURCES are trimmed to that closure, so in this tree nothing but pipeline_tests
# links (the tree builds only that target).
#
# A new concurrent test file goes into CKPTFS_PIPELINE_TEST_FILES. A library source reached
# without its header being included anywhere on the way would show up as an undefined
# reference when pipeline_tests links; add its header's include or the file here.
set(CKPTFS_PIPELINE_TEST_FILES
    tests/store/flush/flush_pipeline_test.cc
    tests/store/publish/journal_test.cc
    tests/store/cache/block_cache_test.cc
    tests/store/flush/staged_file_test.cc
    tests/gpu/staging_pool_test.cc
    CACHE STRING "Test files (relative to the source root) that pipeline_tests compiles")

# Store sources the peer library needs (ckptfs_fs links it whole, so its objects that the
# linker pulls must find these in the trimmed ckptfs_store).
set(CKPTFS_PIPELINE_EXTRA_SOURCES
    store/publish/journal_halt.cc   # Journal's halts and its stop: no header of their own
    store/publish/journal_stop.cc
    store/cache/retained_tier.cc
    store/cache/retained_tier_report.cc
    store/dcp/checkpoint_source.cc)

set(_queue)
set(_tests)
foreach(f IN LISTS CKPTFS_PIPELINE_EXTRA_SOURCES)
  if(EXISTS ${CMAKE_SOURCE_DIR}/${f})
    list(APPEND _queue ${CMAKE_SOURCE_DIR}/${f})
  endif()
endforeach()
foreach(f IN LISTS CKPTFS_PIPELINE_TEST_FILES)
  if(EXISTS ${CMAKE_SOURCE_DIR}/${f})
    list(APPEND _queue ${CMAKE_SOURCE_DIR}/${f})
    list(APPEND _tests ${CMAKE_SOURCE_DIR}/${f})
  endif()
endforeach()
if(NOT _tests)
  message(FATAL_ERROR "pipeline_tests: none of CKPTFS_PIPELINE_TEST_FILES exists")
endif()

# Breadth-first walk over the project's own headers and sources.
set(_seen)
while(_queue)
  list(POP_FRONT _queue _file)
  if(_file IN_LIST _seen)
    continue()
  endif()
  list(APPEND _seen ${_file})
  file(STRINGS ${_file} _includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"[^\"]+\"")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" _inc "${_line}")
    get_filename_component(_dir ${_file} DIRECTORY)
    foreach(_cand ${CMAKE_SOURCE_DIR}/${_inc} ${_dir}/${_inc})
      if(EXISTS ${_cand} AND NOT IS_DIRECTORY ${_cand})
        get_filename_component(_cand ${_cand} ABSOLUTE)
        list(APPEND _queue ${_cand})
        string(REGEX REPLACE "\\.h$" ".cc" _impl ${_cand})
        if(NOT _impl STREQUAL _cand AND EXISTS ${_impl})
          list(APPEND _queue ${_impl})
        endif()
        break()
      endif()
    endforeach()
  endforeach()
endwhile()
# Re-run the walk whenever one of the files changes (an include may have been added).
set_property(DIRECTORY ${CMAKE_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_seen})

set(_libs)
foreach(lib ckptfs_common ckptfs_gpu ckptfs_store ckptfs_fs)
  if(NOT TARGET ${lib})
    continue()
  endif()
  get_target_property(_srcs ${lib} SOURCES)
  get_target_property(_lib_dir ${lib} SOURCE_DIR)
  set(_keep)
  foreach(s IN LISTS _srcs)
    get_filename_component(_abs ${s} ABSOLUTE BASE_DIR ${_lib_dir})
    if(_abs IN_LIST _seen)
      list(APPEND _keep ${_abs})
    endif()
  endforeach()
  if(_keep)
    set_property(TARGET ${lib} PROPERTY SOURCES ${_keep})
    list(APPEND _libs ${lib})
    string(REPLACE "${CMAKE_SOURCE_DIR}/" "" _short "${_keep}")
    message(STATUS "pipeline_tests: ${lib} trimmed to ${_short}")
  endif()
endforeach()

find_package(GTest REQUIRED)
add_executable(pipeline_tests ${_tests})
target_link_libraries(pipeline_tests PRIVATE ${_libs} GTest::gtest GTest::gmock GTest::gtest_main)
target_compile_definitions(pipeline_tests PRIVATE CKPTFS_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
