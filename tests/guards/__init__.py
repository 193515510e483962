"""Guards over every op and kernel: the ABI, the import graph, every op registered, sampled and accepted alike on CPU and CUDA."""
