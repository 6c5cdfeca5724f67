// What every kernel variant's translation unit includes before its target pragma:
// system headers, the parameters and the scalar helpers, all compiled as baseline
// code (see params.h on why nothing with external linkage may follow the pragma
// outside the variant's namespace).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "linear_params.h"
#include "params.h"
#include "prefill_params.h"
#include "quant_params.h"
#include "quant_act_params.h"
#include "scalar.h"
