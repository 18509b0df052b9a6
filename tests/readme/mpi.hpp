// What the README's MPI snippet takes as given (context `mpi`): the model_spec of the host
// snippets; tests/readme_check.py compiles it with MPI's flags.
#pragma once
#include <shardkit/comm/mpi.hpp>
#include <shardkit/shardkit.hpp>

inline shardkit::model_spec model;
