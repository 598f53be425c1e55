"""The worker side, run by every rank under torchrun: process group, data, train step, loop, checkpoints, metrics."""
import os

# A TORCHINDUCTOR_CACHE_DIR of the user's own, read before anything imports torch._dynamo, whose import sets the
# variable to inductor's default (launcher/train/compile_cache.py keeps the run's compiles apart from it)
USER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
