# FindNCCL
# --------
# Finds NVIDIA's NCCL (which ships no CMake package).
#
# Looks under, in order: NCCL_ROOT / NCCL_HOME (CMake or environment variables), NCCL_DIR, the
# CUDA toolkit's directories (when CUDAToolkit was found, or CUDAToolkit_ROOT / CUDA_PATH /
# /usr/local/cuda), then the system paths. The version comes from the NCCL_MAJOR/MINOR/PATCH
# macros of nccl.h.
#
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION.
# Imported target: NCCL::NCCL.

set(_nccl_hints)
foreach(_v NCCL_ROOT NCCL_HOME NCCL_DIR)
  if(DEFINED ${_v})
    list(APPEND _nccl_hints "${${_v}}")
  endif()
  if(DEFINED ENV{${_v}})
    list(APPEND _nccl_hints "$ENV{${_v}}")
  endif()
endforeach()
foreach(_d "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}" "${CUDAToolkit_ROOT}"
           "$ENV{CUDAToolkit_ROOT}" "$ENV{CUDA_PATH}" "/usr/local/cuda")
  if(_d)
    list(APPEND _nccl_hints "${_d}")
  endif()
endforeach()
if(CUDAToolkit_INCLUDE_DIRS)
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(CUDAToolkit_LIBRARY_DIR)
  list(APPEND _nccl_library_hints "${CUDAToolkit_LIBRARY_DIR}")
endif()

find_path(NCCL_INCLUDE_DIR NAMES nccl.h
  HINTS ${_nccl_include_hints} ${_nccl_hints}
  PATH_SUFFIXES include)
# libnccl.so, or the versioned name alone (Python wheels ship only libnccl.so.2)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${_nccl_library_hints} ${_nccl_hints}
  PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part}[ \t]+([0-9]+)" _m "${_nccl_version_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
unset(_nccl_include_hints)
unset(_nccl_library_hints)
