# The shardkit-ckpt tool on a real checkpoint (cmake -P). Every step checks the exit status of
# what it runs, then its output.
#
#   -DTOOL=<shardkit-ckpt> -DHELPER=<shardkit_io_helper> -DWORK=<directory> -DMODE=<mode>
#
# MODE setup:   the helper trains io_model.hpp's model on 3 thread ranks at stage 2 and saves
#               it to WORK/ckpt; the hashes of its state go to WORK/ckpt.hashes.
# MODE inspect: names, shapes, step, world size, stage, files.
# MODE verify:  exit 0 when intact; 1, naming the file, for a flipped byte in a rank file's data
#               or footer, a missing rank file, a damaged manifest; 1 for what is no checkpoint.
# MODE export:  fp32 and bf16 files, read back by io::safetensors_file, hold the checkpoint's
#               values; a failed export leaves the file at its path as it was.
# MODE reshard: to other world sizes, stages and shard groups; each result verifies and loads
#               on engines of those sizes (and others) into exactly the saved state.
# MODE args:    bad arguments exit 2 with a message and write nothing; --help exits 0.
cmake_minimum_required(VERSION 3.25)
foreach(v TOOL HELPER WORK MODE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "ckpt_tool_check.cmake: -D${v}=... is required")
  endif()
endforeach()
set(CKPT "${WORK}/ckpt")

# run(<expected exit status> <output variable> <command...>): stdout and stderr together.
function(run expect out)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE o ERROR_VARIABLE o)
  string(REPLACE ";" " " shown "${ARGN}")
  if(NOT "${rc}" STREQUAL "${expect}")
    message(FATAL_ERROR "`${shown}` exited with ${rc}, expected ${expect}; it said:\n${o}")
  endif()
  message(STATUS "ok (exit ${rc}): ${shown}")
  set(${out} "${o}" PARENT_SCOPE)
endfunction()

# expect(<output> <regex> [<what>]): the output must match.
function(expect text regex)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "expected output matching '${regex}' ${ARGV2}; got:\n${text}")
  endif()
endfunction()
function(expect_not text regex)
  if(text MATCHES "${regex}")
    message(FATAL_ERROR "output must not match '${regex}'; got:\n${text}")
  endif()
endfunction()

# The value printed as "<key> <hex>" in text.
function(hash_of text key out)
  if(NOT text MATCHES "${key} ([0-9a-f]+)")
    message(FATAL_ERROR "no '${key} <hash>' in:\n${text}")
  endif()
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

function(saved_hashes)
  if(NOT EXISTS "${CKPT}.hashes")
    message(FATAL_ERROR "${CKPT}.hashes is missing: the setup test did not run")
  endif()
  file(READ "${CKPT}.hashes" h)
  foreach(k state values working)
    hash_of("${h}" ${k} x)
    set(saved_${k} "${x}" PARENT_SCOPE)
  endforeach()
endfunction()

# A fresh copy of the checkpoint, to damage.
function(copy_checkpoint to)
  file(REMOVE_RECURSE "${to}")
  file(COPY "${CKPT}/" DESTINATION "${to}")
endfunction()

# The model io_model.hpp defines: name|shape as `inspect` prints it|group|unit.
set(PARAMS
    "embed.weight|[7, 5]|0|0" "embed.scale|[]|1|0" "block0.weight|[4, 3, 2]|0|1"
    "block0.empty|[3, 0]|1|1" "block0.bias|[13]|1|1" "block1.weight|[16, 4]|0|2"
    "block1.none|[0]|1|2" "head.weight|[1, 9]|0|3")

if(MODE STREQUAL "setup")
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}")
  run(0 out "${HELPER}" train-save "${CKPT}" --ranks 3 --stage 2 --steps 2)
  file(WRITE "${CKPT}.hashes" "${out}")
  # loading it back on the same layout gives the same state (the hashes mean something)
  run(0 again "${HELPER}" load "${CKPT}" --ranks 3 --stage 2)
  hash_of("${out}" state a)
  hash_of("${again}" state b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "the checkpoint does not load into the state it saved (${a} vs ${b})")
  endif()

elseif(MODE STREQUAL "inspect")
  run(0 out "${TOOL}" inspect "${CKPT}")
  expect("${out}" "checkpoint ${CKPT} \\(format version 1\\)")
  expect("${out}" "saved by 3 ranks at stage 2, shard group 3, alignment 1")
  expect("${out}" "step 2; optimizer adamw; working bf16, gradients bf16; loss scaling off")
  expect("${out}" "model: 8 parameters, 146 elements, 4 units, fingerprint [0-9a-f]+")
  expect("${out}" "group 0: [^\n]*lr=0.01")
  expect("${out}" "group 1: [^\n]*lr=0.02")
  foreach(p IN LISTS PARAMS)
    string(REPLACE "|" ";" f "${p}")
    list(GET f 0 name)
    list(GET f 1 shape)
    list(GET f 2 group)
    list(GET f 3 unit)
    string(REPLACE "[" "\\[" shape_re "${shape}")
    string(REPLACE "]" "\\]" shape_re "${shape_re}")
    string(REPLACE "." "\\." name_re "${name}")
    expect("${out}" "\n  ${name_re} +${shape_re} +${group} +${unit}\n" "(parameter ${name})")
  endforeach()
  expect("${out}" "kinds: values exp_avg exp_avg_sq")
  expect("${out}" "3 files, [0-9]+ bytes:")
  foreach(r 0 1 2)
    file(SIZE "${CKPT}/rank-0000${r}.bin" size)
    expect("${out}" "rank-0000${r}.bin  rank ${r}  ${size} bytes  xxh64 [0-9a-f]+")
  endforeach()
  # a directory that is not a checkpoint
  file(MAKE_DIRECTORY "${WORK}/not-a-checkpoint")
  run(1 out "${TOOL}" inspect "${WORK}/not-a-checkpoint")
  expect("${out}" "is not a shardkit checkpoint: it has no manifest.json")

elseif(MODE STREQUAL "verify")
  run(0 out "${TOOL}" verify "${CKPT}")
  expect("${out}" "ok       rank-00000.bin\nok       rank-00001.bin\nok       rank-00002.bin\n")
  expect("${out}" "checkpoint ${CKPT} is intact")
  # a flipped byte in a rank file's data
  set(d "${WORK}/verify-flipped")
  copy_checkpoint("${d}")
  run(0 _ "${HELPER}" flip "${d}/rank-00001.bin" 10)
  run(1 out "${TOOL}" verify "${d}")
  expect("${out}" "DAMAGED  rank-00001.bin: '${d}/rank-00001.bin' is corrupt: block 0")
  expect("${out}" "ok       rank-00000.bin")
  expect("${out}" "ok       rank-00002.bin")
  expect("${out}" "checkpoint ${d} is damaged")
  # ... in its footer
  copy_checkpoint("${d}")
  run(0 _ "${HELPER}" flip "${d}/rank-00002.bin" -3)
  run(1 out "${TOOL}" verify "${d}")
  expect("${out}" "DAMAGED  rank-00002.bin: [^\n]*rank-00002.bin' has a corrupt footer")
  # a missing rank file
  copy_checkpoint("${d}")
  file(REMOVE "${d}/rank-00000.bin")
  run(1 out "${TOOL}" verify "${d}")
  expect("${out}" "DAMAGED  rank-00000.bin: '${d}/rank-00000.bin' is missing")
  expect("${out}" "is damaged")
  # a damaged manifest
  copy_checkpoint("${d}")
  file(READ "${d}/manifest.json" text)
  string(REPLACE "\"step\": 2" "\"step\": 3" text "${text}")
  file(WRITE "${d}/manifest.json" "${text}")
  run(1 out "${TOOL}" verify "${d}")
  expect("${out}" "manifest.json': +does not match its checksum")
  # not a checkpoint at all
  run(1 out "${TOOL}" verify "${WORK}/no-such-directory")
  expect("${out}" "checkpoint '${WORK}/no-such-directory' does not exist")

elseif(MODE STREQUAL "export")
  saved_hashes()
  set(f "${WORK}/export.safetensors")
  file(REMOVE "${f}")
  run(0 out "${TOOL}" export "${CKPT}" "${f}")
  expect("${out}" "wrote ${f}: 8 tensors, 584 bytes of fp32")
  run(0 out "${HELPER}" st-hash "${f}")
  hash_of("${out}" F32 h)
  if(NOT h STREQUAL saved_values)
    message(FATAL_ERROR "the fp32 export holds other values than the checkpoint (${h} vs "
                        "${saved_values})")
  endif()
  set(b "${WORK}/export-bf16.safetensors")
  run(0 out "${TOOL}" export "${CKPT}" "${b}" --dtype bf16)
  expect("${out}" "wrote ${b}: 8 tensors, 292 bytes of bf16")
  run(0 out "${HELPER}" st-hash "${b}")
  hash_of("${out}" BF16 h)
  if(NOT h STREQUAL saved_working)
    message(FATAL_ERROR "the bf16 export holds other values than the engine's bf16 parameters "
                        "(${h} vs ${saved_working})")
  endif()
  # a damaged checkpoint: exit 1, and the file at the path is left as it was
  set(d "${WORK}/export-damaged")
  copy_checkpoint("${d}")
  run(0 _ "${HELPER}" flip "${d}/rank-00001.bin" 5)
  file(WRITE "${f}" "previous contents")
  run(1 out "${TOOL}" export "${d}" "${f}")
  expect("${out}" "rank-00001.bin' is corrupt")
  file(READ "${f}" now)
  if(NOT now STREQUAL "previous contents")
    message(FATAL_ERROR "a failed export changed ${f}")
  endif()
  if(EXISTS "${f}.partial")
    message(FATAL_ERROR "a failed export left ${f}.partial behind")
  endif()

elseif(MODE STREQUAL "reshard")
  saved_hashes()
  # world size|stage|shard group (0: all) of the reshard|the engines that load it, as
  # ranks:stage:shard group
  foreach(c "4|3|0|4:3:0,3:1:0" "2|0|0|2:0:0,1:3:0" "5|2|0|5:2:0" "4|1|2|4:1:2,4:3:2,2:2:0"
            "1|3|0|1:3:0,4:2:0")
    string(REPLACE "|" ";" f "${c}")
    list(GET f 0 world)
    list(GET f 1 stage)
    list(GET f 2 group)
    list(GET f 3 loads)
    string(REPLACE "," ";" loads "${loads}")
    set(out_dir "${WORK}/reshard-${world}-${stage}-${group}")
    file(REMOVE_RECURSE "${out_dir}")
    set(extra "")
    if(NOT group STREQUAL "0")
      set(extra --shard-group ${group})
    endif()
    run(0 out "${TOOL}" reshard "${CKPT}" "${out_dir}" --world-size ${world} --stage ${stage}
        ${extra})
    expect("${out}" "wrote ${out_dir}: [0-9]+ files for ${world} ranks at stage ${stage}")
    run(0 _ "${TOOL}" verify "${out_dir}")
    run(0 out "${TOOL}" inspect "${out_dir}")
    if(stage STREQUAL "0")
      set(g 1)
    elseif(group STREQUAL "0")
      set(g ${world})
    else()
      set(g ${group})
    endif()
    expect("${out}" "saved by ${world} ranks at stage ${stage}, shard group ${g}")
    expect("${out}" "step 2;")
    foreach(l IN LISTS loads)
      string(REPLACE ":" ";" l "${l}")
      list(GET l 0 m)
      list(GET l 1 t)
      list(GET l 2 lg)
      run(0 out "${HELPER}" load "${out_dir}" --ranks ${m} --stage ${t} --shard-group ${lg})
      hash_of("${out}" state h)
      if(NOT h STREQUAL saved_state)
        message(FATAL_ERROR "${out_dir} loaded on ${m} ranks at stage ${t} (shard group ${lg}) "
                            "holds another state than the checkpoint (${h} vs ${saved_state})")
      endif()
    endforeach()
  endforeach()

  # a damaged checkpoint: exit 1; a checkpoint already at the output path is left as it was,
  # and no partial output remains
  set(d "${WORK}/reshard-damaged")
  copy_checkpoint("${d}")
  run(0 _ "${HELPER}" flip "${d}/rank-00002.bin" 7)
  set(out_dir "${WORK}/reshard-4-3-0")  # resharded above
  file(READ "${out_dir}/manifest.json" before)
  run(1 out "${TOOL}" reshard "${d}" "${out_dir}" --world-size 2 --stage 1)
  expect("${out}" "rank-00002.bin' is corrupt")
  file(READ "${out_dir}/manifest.json" after)
  if(NOT before STREQUAL after)
    message(FATAL_ERROR "a failed reshard changed ${out_dir}")
  endif()
  run(0 _ "${TOOL}" verify "${out_dir}")
  if(EXISTS "${out_dir}.partial")
    message(FATAL_ERROR "a failed reshard left ${out_dir}.partial behind")
  endif()

elseif(MODE STREQUAL "args")
  set(o "${WORK}/args-out")
  file(REMOVE_RECURSE "${o}")
  run(0 out "${TOOL}" --help)
  expect("${out}" "inspect")
  expect("${out}" "verify")
  expect("${out}" "export")
  expect("${out}" "reshard")
  run(0 out "${TOOL}" reshard --help)
  expect("${out}" "--world-size")
  expect("${out}" "--shard-group")
  run(0 out "${TOOL}" export --help)
  expect("${out}" "--dtype")
  foreach(c
      "no subcommand||A subcommand is required"
      "unknown subcommand|frobnicate|A subcommand is required"
      "inspect without a directory|inspect|dir is required"
      "inspect with two directories|inspect,${CKPT},${CKPT}|not expected"
      "an unknown option|verify,${CKPT},--frob|--frob"
      "reshard without --world-size|reshard,${CKPT},${o}|--world-size is required"
      "a world size that is not a number|reshard,${CKPT},${o},--world-size,abc|abc"
      "world size 0|reshard,${CKPT},${o},--world-size,0|--world-size must be at least 1"
      "stage 4|reshard,${CKPT},${o},--world-size,2,--stage,4|--stage must be 0, 1, 2 or 3"
      "a shard group that does not divide|reshard,${CKPT},${o},--world-size,4,--shard-group,3|--shard-group 3 does not divide --world-size 4"
      "alignment 0|reshard,${CKPT},${o},--world-size,2,--alignment,0|alignment must be at least 1"
      "an unknown dtype|export,${CKPT},${o},--dtype,fp64|fp64"
      "export without an output|export,${CKPT}|out is required")
    string(REPLACE "|" ";" f "${c}")
    list(GET f 0 what)
    list(GET f 1 argv)
    list(GET f 2 msg)
    string(REPLACE "," ";" argv "${argv}")
    message(STATUS "bad arguments: ${what}")
    run(2 out "${TOOL}" ${argv})
    expect("${out}" "${msg}" "(${what})")
    if(EXISTS "${o}" OR EXISTS "${o}.partial")
      message(FATAL_ERROR "bad arguments (${what}) wrote ${o}")
    endif()
  endforeach()
else()
  message(FATAL_ERROR "ckpt_tool_check.cmake: unknown MODE '${MODE}'")
endif()
