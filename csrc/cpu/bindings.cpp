// Registration only: the function lives in tpp_cpu_torch.cpp.
#include "tpp_cpu_torch.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tpp_decode", &tpp_decode_cpu, "Two-phase-partition decode attention over the chunk pool (CPU, OpenMP)");
  m.def("scratch_floats", &tpp_scratch_floats, "Floats of scratch tpp_decode needs");
}
