"""The worker side, run by every rank under torchrun: process group, data, train step, loop, checkpoints, metrics."""
