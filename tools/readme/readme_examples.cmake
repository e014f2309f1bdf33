# README.md's C examples, compiled (and linked) in CI: include() this file from a CMake file that
# registers tests, e.g. ctests/CMakeLists.txt:
#
#   include("${PROJECT_SOURCE_DIR}/tools/readme/readme_examples.cmake")
#
# It adds
#   - a custom command that runs tools/readme/extract.py on README.md into
#     <current binary dir>/readme_examples/, one readme_example_NN.c per ```c block marked
#     `<!-- compile: main -->` or `<!-- compile: body(...) -->` (see extract.py);
#   - one executable per example, `kvstage_readme_example_NN`, compiled as C11 without extensions
#     (-std=c11) with -Wall -Wextra -Werror against include/kvstage.h, and linked with the shared
#     library (nothing runs them: linking proves that every kvstage function they call is
#     exported); without a library to link, one object library `kvstage_readme_objects` (compile
#     only). None of them is built by `all`;
#   - the target `kvstage_readme_examples`, which builds them all, and the test `readme_examples`
#     (label api) that builds that target: `ctest -L api` fails when a README example stops
#     compiling or linking, with the compiler's message pointing at README.md's line.
#
# Settings (set before include(); all optional):
#   KVSTAGE_README_FILE         the README (default: ${PROJECT_SOURCE_DIR}/README.md)
#   KVSTAGE_README_INCLUDE_DIR  the directory of kvstage.h (default: ${PROJECT_SOURCE_DIR}/include)
#   KVSTAGE_README_LIBRARY      the shared library file to link (default: the one the kvstage build
#                               produces, ${KVSTAGE_BUILD_LIBDIR}/${KVSTAGE_SHARED_REAL}, when those
#                               are set; empty: compile only). A path, not a target, so that the
#                               test does not run cargo: it checks the README against the library
#                               already built.
# Not registered in the memory-checking builds (KVSTAGE_SANITIZE, KVSTAGE_VALGRIND), which run the
# executable tests only: the examples are built, never run.

if(NOT (KVSTAGE_SANITIZE OR KVSTAGE_VALGRIND))
  if(NOT DEFINED KVSTAGE_README_FILE)
    set(KVSTAGE_README_FILE "${PROJECT_SOURCE_DIR}/README.md")
  endif()
  if(NOT DEFINED KVSTAGE_README_INCLUDE_DIR)
    set(KVSTAGE_README_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/include")
  endif()
  if(NOT DEFINED KVSTAGE_README_LIBRARY AND KVSTAGE_BUILD_LIBDIR AND KVSTAGE_SHARED_REAL)
    set(KVSTAGE_README_LIBRARY "${KVSTAGE_BUILD_LIBDIR}/${KVSTAGE_SHARED_REAL}")
  endif()

  set(_kvstage_readme_extract "${CMAKE_CURRENT_LIST_DIR}/extract.py")
  set(_kvstage_readme_dir "${CMAKE_CURRENT_BINARY_DIR}/readme_examples")
  if(NOT Python3_Interpreter_FOUND)
    set(Python3_FIND_UNVERSIONED_NAMES FIRST)
    find_package(Python3 COMPONENTS Interpreter)
  endif()

  if(NOT Python3_Interpreter_FOUND)
    message(STATUS "kvstage: no Python 3 interpreter; test readme_examples not added")
  else()
    # Which examples there are is known when configuring: a README edit configures again (it may
    # add, remove or re-mark a block), then the custom command writes the files.
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
      "${KVSTAGE_README_FILE}" "${_kvstage_readme_extract}")
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" "${_kvstage_readme_extract}" --list "${KVSTAGE_README_FILE}"
      OUTPUT_VARIABLE _kvstage_readme_list
      ERROR_VARIABLE _kvstage_readme_error
      RESULT_VARIABLE _kvstage_readme_rc)

    if(NOT _kvstage_readme_rc EQUAL 0)
      # A malformed README fails the test, not the configure: building the target prints
      # extract.py's message and fails (and, once the README is fixed, configures again first).
      message(WARNING "kvstage: README.md's C examples cannot be extracted: ${_kvstage_readme_error}")
      add_custom_target(kvstage_readme_examples
        COMMAND "${Python3_EXECUTABLE}" "${_kvstage_readme_extract}" --list "${KVSTAGE_README_FILE}"
        VERBATIM)
    else()
      string(REPLACE "\n" ";" _kvstage_readme_list "${_kvstage_readme_list}")
      set(_kvstage_readme_sources)
      set(_kvstage_readme_names)
      foreach(_line IN LISTS _kvstage_readme_list)
        if(_line MATCHES "^(readme_example_[0-9]+) (main|body)$")
          list(APPEND _kvstage_readme_names "${CMAKE_MATCH_1}")
          list(APPEND _kvstage_readme_sources "${_kvstage_readme_dir}/${CMAKE_MATCH_1}.c")
        endif()
      endforeach()

      add_custom_command(
        OUTPUT ${_kvstage_readme_sources}
        COMMAND "${Python3_EXECUTABLE}" "${_kvstage_readme_extract}"
                "${KVSTAGE_README_FILE}" "${_kvstage_readme_dir}"
        DEPENDS "${KVSTAGE_README_FILE}" "${_kvstage_readme_extract}"
        COMMENT "Extracting README.md's C examples"
        VERBATIM)

      set(_kvstage_readme_targets)
      if(KVSTAGE_README_LIBRARY)
        foreach(_name IN LISTS _kvstage_readme_names)
          add_executable(kvstage_${_name} EXCLUDE_FROM_ALL "${_kvstage_readme_dir}/${_name}.c")
          target_link_libraries(kvstage_${_name} PRIVATE "${KVSTAGE_README_LIBRARY}")
          list(APPEND _kvstage_readme_targets kvstage_${_name})
        endforeach()
      else()
        add_library(kvstage_readme_objects OBJECT EXCLUDE_FROM_ALL ${_kvstage_readme_sources})
        list(APPEND _kvstage_readme_targets kvstage_readme_objects)
      endif()
      foreach(_target IN LISTS _kvstage_readme_targets)
        set_target_properties(${_target} PROPERTIES
          C_STANDARD 11 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
        target_compile_options(${_target} PRIVATE -Wall -Wextra -Werror)
        target_include_directories(${_target} PRIVATE "${KVSTAGE_README_INCLUDE_DIR}")
      endforeach()

      add_custom_target(kvstage_readme_examples)
      add_dependencies(kvstage_readme_examples ${_kvstage_readme_targets})
    endif()
    add_test(NAME readme_examples
      COMMAND "${CMAKE_COMMAND}" --build "${CMAKE_BINARY_DIR}"
              --target kvstage_readme_examples --config "$<CONFIG>")
    set_tests_properties(readme_examples PROPERTIES LABELS api TIMEOUT 300)
  endif()
endif()
