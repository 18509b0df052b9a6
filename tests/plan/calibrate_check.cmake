# Runs shardkit-plan --calibrate, takes the flags it prints for shardkit-plan and passes them
# back: the planner must accept them and report the fitted link in its JSON inputs.
#   cmake -DEXE=<shardkit-plan> -DARGS="--calibrate|--ranks|2|--max-bytes|65536"
#         [-DLAUNCH="mpiexec|-np|2"] -P calibrate_check.cmake
string(REPLACE "|" ";" args "${ARGS}")
string(REPLACE "|" ";" launch "${LAUNCH}")
execute_process(COMMAND ${launch} "${EXE}" ${args} OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "shardkit-plan ${ARGS} failed (${rc}):\nstdout: ${out}\nstderr: ${err}")
endif()
message(STATUS "${out}")
foreach(expect "collective +bytes +measured +fitted +error" "all_gather" "reduce_scatter"
               "all_reduce" "fit \\(least squares of relative errors\\): alpha ")
  if(NOT out MATCHES "${expect}")
    message(FATAL_ERROR "the output does not match '${expect}':\n${out}")
  endif()
endforeach()
if(NOT out MATCHES "\n  (--gpus-per-node [0-9]+ --intra-alpha [^ \n]+ --intra-bw [^ \n]+)\n")
  message(FATAL_ERROR "no flags line '--gpus-per-node N --intra-alpha T --intra-bw BW':\n${out}")
endif()
set(flags "${CMAKE_MATCH_1}")
separate_arguments(flags UNIX_COMMAND "${flags}")
list(GET flags 1 gpn)
execute_process(COMMAND "${EXE}" --params 1e6 --ranks ${gpn} --gpu-mem 1GB ${flags} --json
                OUTPUT_VARIABLE plan ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "shardkit-plan refused the flags it printed (${flags}): ${rc}\n${err}")
endif()
string(JSON got_gpn GET "${plan}" inputs gpus_per_node)
string(JSON bw GET "${plan}" inputs intra_node bytes_per_s)
string(JSON alpha GET "${plan}" inputs intra_node latency_s)
if(NOT got_gpn EQUAL gpn)
  message(FATAL_ERROR "gpus_per_node ${got_gpn}, expected ${gpn}")
endif()
if(bw LESS_EQUAL 0 OR alpha LESS 0)
  message(FATAL_ERROR "intra_node link from ${flags}: bandwidth ${bw}, latency ${alpha}")
endif()
message(STATUS "shardkit-plan accepted ${flags}: intra_node ${bw} B/s, ${alpha} s")
