"""The decode step's Triton kernels (CUDA): decode attention, pointwise ops and the sampler."""
