"""The engine's bookkeeping: requests, sampling parameters, the scheduler and the KV block manager. Torch-free."""
