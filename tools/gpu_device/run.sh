#!/bin/bash
# The GPU checks of a machine with CuPy and a GPU but no MXNet (how the H200 runs of the
# README's "GPU runs" were made): installs the MXNet 1.9.1 CPU wheel found in .devrun/
# (pip download --no-deps mxnet==1.9.1 -d .devrun) into /tmp/site, makes it importable under
# NumPy 2 / Python 3.12 with tools/gpu_device/sitecustomize.py, then runs the selftest with
# the GPU checklist (its native-gpu row launches through the native GPU launcher), the
# CuPy-array GPU tests, the native GPU launcher's test
# (tests/test_ext_cuda_gpu.py) and the GPU bench.  Logs go to $OUT (or /tmp).
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"  # compute-sanitizer (not on PATH there)
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
step env
nvidia-smi -L; python3 -V; which g++ nvcc compute-sanitizer
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
step install mxnet
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .devrun/mxnet-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/tools/gpu_device:$PWD
export MX_ROI_CACHE=${MX_ROI_CACHE:-/tmp/mx_roi_cache}
# the NVRTC the native GPU launcher builds its PTX with (the selftest's native-gpu row and
# tests/test_ext_cuda_gpu.py): the one on the loader path, else a wheel's
NVRTC_LIB=${MX_ROI_NVRTC:-$(python3 -c "from mx_roi.cuda import nvrtc as n; print(n.find_library() \
    or n.wheel_library('libnvrtc.so.13') or n.wheel_library('libnvrtc.so.12') or '')")}
step selftest
MX_ROI_NVRTC=$NVRTC_LIB timeout ${T_SELF:-300} python3 -m mx_roi.selftest --gpu 2>&1 \
    | tee $OUT/selftest.txt | tail -40
step pytest
timeout ${T_PYTEST:-200} python3 -m pytest -m gpu tests/test_gpu_cupy.py -q -p no:cacheprovider \
    -rf 2>&1 | tee $OUT/pytest.txt | tail -20
step "native GPU launcher (mx_roi.ext.cuda through ctypes on CuPy memory and a CuPy stream)"
MX_ROI_NVRTC=$NVRTC_LIB timeout ${T_EXTCUDA:-200} python3 -m pytest -m gpu \
    tests/test_ext_cuda_gpu.py -q -p no:cacheprovider -rf 2>&1 | tee $OUT/ext_cuda.txt | tail -20
step "memcheck (all but the 2^31 test)"
timeout ${T_MEMCHECK:-200} compute-sanitizer --tool memcheck --error-exitcode 97 python3 -m pytest \
    -m "gpu and not slow" tests/test_gpu_cupy.py -q -p no:cacheprovider -x 2>&1 | tail -5
step bench
timeout ${T_BENCH:-150} python3 -m mx_roi.bench --ctx gpu --json $OUT/bench.json 2>&1 \
    | tee $OUT/bench.txt | tail -45
step done
