// Registration only: the functions live in tpp_torch.cpp.
#include "tpp_torch.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tpp_decode", &tpp_decode_cuda, "Two-phase-partition decode attention over the chunk pool (CUDA)");
}
