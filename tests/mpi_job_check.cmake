# Runs an MPI job and checks how it ended: exit status (0 or non-zero), a regular expression
# on its output, and how long it took (a failing rank must end the job promptly, not hang).
# Usage: cmake -DMPIEXEC=mpiexec -DNUMPROC_FLAG=-n -DNP=4 -DEXE=... -DMODE=...
#              -DEXPECT_RC=0|nonzero -DEXPECT_REGEX=... -DMAX_SECONDS=... -P mpi_job_check.cmake
string(TIMESTAMP t0 "%s")
execute_process(COMMAND "${MPIEXEC}" ${NUMPROC_FLAG} ${NP} "${EXE}" ${MODE}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 120)
string(TIMESTAMP t1 "%s")
math(EXPR seconds "${t1} - ${t0}")
set(all "${out}\n${err}")
message(STATUS "exit status ${rc} after ${seconds} s; output:\n${all}")
if(EXPECT_RC STREQUAL "0")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "expected exit status 0, got '${rc}'")
  endif()
elseif(rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "expected a non-zero exit status, got '${rc}'")
endif()
if(NOT all MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "output does not match '${EXPECT_REGEX}'")
endif()
if(seconds GREATER MAX_SECONDS)
  message(FATAL_ERROR "the job took ${seconds} s, more than ${MAX_SECONDS} s")
endif()
