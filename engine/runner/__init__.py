"""Running one scheduled step on the device: inputs, KV cache tensor, CUDA graphs, step extras."""
