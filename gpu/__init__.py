"""GPU backend: the KV pool as a device tensor, paged and contiguous attention kernels, a real decoder
model, and an executor that runs the simulator's StepPlans for real. Needs the optional ``gpu`` extra
(torch, triton); ``sim/`` never imports it."""
