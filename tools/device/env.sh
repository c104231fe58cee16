#!/usr/bin/env bash
# Sourced by the device scripts: where the H200 machine keeps CUDA 13 (override with CUDA_HOME or the
# RECALL_* variables) and the kernel cache every run shares.
cuda=${CUDA_HOME:-/usr/local/cuda-13.0}/targets/x86_64-linux
export RECALL_CUDA_LIB_DIR=${RECALL_CUDA_LIB_DIR:-$cuda/lib}
export RECALL_CUDA_INCLUDE=${RECALL_CUDA_INCLUDE:-$cuda/include}
export RECALL_NVRTC_LIB=${RECALL_NVRTC_LIB:-$RECALL_CUDA_LIB_DIR}
export RECALL_KERNEL_CACHE=${RECALL_KERNEL_CACHE:-/tmp/recall-kernels}
export LD_LIBRARY_PATH=$RECALL_CUDA_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
