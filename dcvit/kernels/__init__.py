"""Compiled kernels behind `dcvit.fused` and `dcvit.matrices`: C++ on CPU (sources in
``csrc/``, built and registered as ``dcvit_cpu::*`` operators by `compose_cpu`), Triton on
CUDA (`triton_core`, `triton_attention`). Kernels never import the dispatcher: `dcvit.fused`
plugs each device's kernels into its custom ops (`dcvit.fused.register_core`)."""
