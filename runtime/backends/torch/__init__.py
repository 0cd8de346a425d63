"""The PyTorch backend and every module that needs torch: the canonical decoder, the generic path through a
transformers model's own modules, the int8 twin, CPU linear forms, CUDA graphs and the on-device round. Nothing
outside this package imports torch."""
