// The native GPU path's own kernel (mx_roi.ext.cuda compiles it with NVRTC beside the ops'
// sources): a float16 backward's float32 accumulator stored into the float16 gradient,
// rounded to nearest even -- what the cuda backend's store does (CuPy's float32 -> float16
// cast, backend._store_grad).  A grid-stride loop over n elements (loader.launch_config's
// grid and block).
#include <cuda_fp16.h>

template <typename T>
__global__ void store_float_as(const float* __restrict__ src, T* __restrict__ dst,
                               long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x)
    dst[i] = __float2half_rn(src[i]);
}
