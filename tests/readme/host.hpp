// What the README's host C++ snippets take as given: a user's framework with tensors, a forward
// and a backward per unit, and its own tensor type. tests/readme_check.py compiles every snippet
// of context `host` after this file (declarations only: the snippets are compiled, not run).
#pragma once
#include <shardkit/shardkit.hpp>

#include <cstddef>
#include <vector>

namespace my {
struct Tensor {};
}  // namespace my

inline std::vector<float> w0, b0, w1, b1;  // initial values of the framework's parameters
inline int steps = 0;
// The framework's own code: binding a view of the working values to its tensor i, the forward
// and backward of unit u, and the gradient of parameter i once backward has computed it.
template <class View>
void bind(std::size_t i, View working_values);
void forward_unit(std::size_t u);
void backward_unit(std::size_t u);
const std::vector<float>& grad_of(std::size_t i);
