"""The engine's bookkeeping: requests (and their timing on a worker), sampling parameters, the scheduler and the
KV block manager. Torch-free."""
