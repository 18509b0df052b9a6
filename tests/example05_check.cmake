# Runs example 05 (ZeRO assembled from the components, without the engine) and checks what it
# promises, failing on its exit status as well as on its JSON:
#   cmake -DEXE=<example> -DPART=a|b|c|all -DRANKS=N [-DMPIEXEC=... -DNUMPROC_FLAG=...] -P ...
#     exit status 0, one JSON object with "comm" thread (mpi under MPIEXEC), the selected parts,
#     each bit-identical to the engine at its stage (max_abs_diff_vs_engine exactly 0, no bits
#     differing), within its stated bound of the unsharded reference, and "ok": true.
#   cmake -DEXE=<example> -DMODE=help -P ...       --help: exit status 0 and the usage text
#   cmake -DEXE=<example> -DMODE=fail "-DARGS=a|b" -DEXPECT=<regex> -P ...
#     bad arguments: exit status 2 and EXPECT in the error message
# The example's output is echoed, so a "FAIL:" line it prints reaches ctest's
# FAIL_REGULAR_EXPRESSION too.
if(MODE STREQUAL "help")
  execute_process(COMMAND "${EXE}" --help OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "--help exited with ${rc}, expected 0:\n${out}${err}")
  endif()
  if(NOT out MATCHES "usage: shardkit_example_05_assemble")
    message(FATAL_ERROR "--help printed no usage on stdout:\n${out}")
  endif()
  return()
endif()
if(MODE STREQUAL "fail")
  string(REPLACE "|" ";" args "${ARGS}")
  execute_process(COMMAND "${EXE}" ${args} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "expected exit status 2 for bad arguments, got ${rc}:\n${out}${err}")
  endif()
  if(NOT err MATCHES "${EXPECT}")
    message(FATAL_ERROR "the error message does not match '${EXPECT}':\n${err}")
  endif()
  return()
endif()

set(args --part ${PART} --json)
if(MPIEXEC)
  execute_process(COMMAND "${MPIEXEC}" ${NUMPROC_FLAG} ${RANKS} "${EXE}" ${args}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 100)
  set(want_comm mpi)
else()
  execute_process(COMMAND "${EXE}" ${args} --ranks ${RANKS}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  set(want_comm thread)
endif()
message(STATUS "example 05 output:\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "example 05 exited with ${rc}")
endif()
string(REGEX MATCHALL "\"example\":" objects "${out}")
list(LENGTH objects n_objects)
if(NOT n_objects EQUAL 1)
  message(FATAL_ERROR "expected one JSON object, got ${n_objects}")
endif()
string(JSON comm GET "${out}" comm)
string(JSON ranks GET "${out}" ranks)
if(NOT comm STREQUAL want_comm OR NOT ranks EQUAL RANKS)
  message(FATAL_ERROR "\"comm\" ${comm} on ${ranks} ranks, expected ${want_comm} on ${RANKS}")
endif()
if(PART STREQUAL "all")
  set(want_parts a b c)
else()
  set(want_parts ${PART})
endif()
string(JSON n LENGTH "${out}" parts)
list(LENGTH want_parts n_want)
if(NOT n EQUAL n_want)
  message(FATAL_ERROR "expected ${n_want} part(s), got ${n}")
endif()
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  list(GET want_parts ${i} want_part)
  foreach(key part stage what max_abs_diff_vs_engine engine_bit_mismatches
              max_abs_diff_vs_reference reference_bound)
    string(JSON v ERROR_VARIABLE e GET "${out}" parts ${i} ${key})
    if(e)
      message(FATAL_ERROR "parts[${i}] has no '${key}'")
    endif()
    set(${key} "${v}")
  endforeach()
  if(NOT part STREQUAL want_part)
    message(FATAL_ERROR "parts[${i}] is part ${part}, expected ${want_part}")
  endif()
  if(NOT max_abs_diff_vs_engine STREQUAL "0" OR NOT engine_bit_mismatches STREQUAL "0")
    message(FATAL_ERROR "part ${part} is not bit-identical to the engine at stage ${stage}: "
                        "max |diff| ${max_abs_diff_vs_engine}, ${engine_bit_mismatches} "
                        "element(s) differ")
  endif()
  if(NOT max_abs_diff_vs_reference LESS_EQUAL reference_bound OR reference_bound GREATER 1e-4)
    message(FATAL_ERROR "part ${part}: ${max_abs_diff_vs_reference} from the unsharded "
                        "reference, bound ${reference_bound}")
  endif()
endforeach()
string(JSON ok GET "${out}" ok)
if(NOT ok STREQUAL "ON")
  message(FATAL_ERROR "\"ok\" is ${ok}")
endif()
message(STATUS "example 05 part ${PART} on ${RANKS} ${comm} ranks: bit-identical to the engine, "
               "within the bound of the unsharded reference")
