"""Compiled kernels behind `dcvit.fused`: C++/OpenMP on CPU, Triton on CUDA."""
