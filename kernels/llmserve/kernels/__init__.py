"""The kernels: one home for both paths.

- `llmserve.kernels.triton`: Triton kernels (the GPU path), each with a plain torch
  reference beside it. Importing it imports triton.
- `llmserve.kernels.cpu`: C++ CPU kernels, built on first use by torch's extension
  builder, each with a torch equivalent in the worker's layers.

This package imports neither, so a CPU worker never loads triton.
"""
