# Runs shardkit-plan --calibrate, takes the flags it prints for shardkit-plan and passes them
# back: the planner must accept them and report the fitted links in its JSON inputs, the one
# intra-node link and each collective's own (--intra-<collective>-alpha/-bw, printed for every
# collective whose "<collective> alone:" fit is printed).
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
set(_own " --intra-(all-reduce|reduce-scatter|all-gather)-alpha [^ \n]+ --intra-[a-z-]+-bw [^ \n]+")
if(NOT out MATCHES "\n  (--gpus-per-node [0-9]+ --intra-alpha [^ \n]+ --intra-bw [^ \n]+(${_own})*)\n")
  message(FATAL_ERROR "no flags line '--gpus-per-node N --intra-alpha T --intra-bw BW "
                      "[--intra-<collective>-alpha T --intra-<collective>-bw BW]...':\n${out}")
endif()
set(line "${CMAKE_MATCH_1}")
separate_arguments(flags UNIX_COMMAND "${line}")
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

# Each collective fitted alone is printed as a flag pair, and comes back as its own link.
set(own_links 0)
foreach(op all_reduce reduce_scatter all_gather)
  string(REPLACE "_" "-" dashed "${op}")
  string(JSON type TYPE "${plan}" inputs intra_${op})
  if(out MATCHES "\n  ${op} alone: alpha ")
    if(NOT line MATCHES " --intra-${dashed}-alpha [^ ]+ --intra-${dashed}-bw [^ ]+")
      message(FATAL_ERROR "${op} was fitted alone, but the flags do not carry it: ${line}")
    endif()
    if(NOT type STREQUAL "OBJECT")
      message(FATAL_ERROR "inputs.intra_${op} is ${type} after ${flags}:\n${plan}")
    endif()
    string(JSON own_bw GET "${plan}" inputs intra_${op} bytes_per_s)
    string(JSON own_alpha GET "${plan}" inputs intra_${op} latency_s)
    if(own_bw LESS_EQUAL 0 OR own_alpha LESS 0)
      message(FATAL_ERROR "intra_${op} from ${flags}: bandwidth ${own_bw}, latency ${own_alpha}")
    endif()
    math(EXPR own_links "${own_links} + 1")
    message(STATUS "intra_${op}: ${own_bw} B/s, ${own_alpha} s")
  elseif(NOT type STREQUAL "NULL")
    message(FATAL_ERROR "inputs.intra_${op} is ${type}, but ${op} was not fitted alone")
  endif()
endforeach()
# The fits alone fail together (one error for all) or succeed together.
if(NOT own_links EQUAL 3 AND NOT out MATCHES "\n  per collective: ")
  message(FATAL_ERROR "${own_links} of 3 collectives have their own link, and no reason given")
endif()

# With --save-samples FILE, the samples are written, and the planner's --samples FILE reads
# them: the JSON counts them, and the times (a model small enough that stage 0's all-reduce lies
# among the sampled sizes) are read off them instead of the fitted line.
if(args MATCHES "--save-samples")
  if(NOT out MATCHES "samples written to ([^ \n]+) ")
    message(FATAL_ERROR "--save-samples given, but no 'samples written to FILE':\n${out}")
  endif()
  set(file "${CMAKE_MATCH_1}")
  file(STRINGS "${file}" sample_lines REGEX "^(all_gather|reduce_scatter|all_reduce) ")
  list(LENGTH sample_lines n_lines)
  set(small --params 1e5 --ranks ${gpn} --gpu-mem 1GB ${flags} --json)
  execute_process(COMMAND "${EXE}" ${small} --samples "${file}" OUTPUT_VARIABLE measured
                  ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "shardkit-plan --samples ${file} failed (${rc}): ${err}")
  endif()
  execute_process(COMMAND "${EXE}" ${small} OUTPUT_VARIABLE fitted RESULT_VARIABLE rc)
  string(JSON n GET "${measured}" inputs measured_samples)
  string(JSON none TYPE "${fitted}" inputs measured_samples)
  if(NOT n EQUAL n_lines OR n_lines LESS 6 OR NOT none STREQUAL "NULL")
    message(FATAL_ERROR "measured_samples ${n} (${n_lines} lines in ${file}), without "
                        "--samples: ${none}")
  endif()
  string(JSON t_measured GET "${measured}" stages 0 comm_time_per_step_s ring)
  string(JSON t_fitted GET "${fitted}" stages 0 comm_time_per_step_s ring)
  if(t_measured LESS_EQUAL 0 OR t_measured STREQUAL t_fitted)
    message(FATAL_ERROR "stage 0 with --samples: ${t_measured} s, with the fitted link alone "
                        "${t_fitted} s; expected a positive time read off the samples")
  endif()
  message(STATUS "--samples ${file}: ${n} samples; stage 0 ${t_measured} s (fitted ${t_fitted} s)")
endif()
