"""CPU kernels in C for the engine's torch path (loaded with ctypes; see each module)."""
