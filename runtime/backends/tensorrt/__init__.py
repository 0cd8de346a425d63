"""The TensorRT backend (NVIDIA GPUs) and the few CUDA runtime calls it needs (cuda-python; no torch)."""
