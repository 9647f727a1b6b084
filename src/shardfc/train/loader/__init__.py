"""The training data of a run, from the dataset to batches on the device.

    data.py              the dataset, per-rank resumable batches, the endless micro-batch stream
    identity_sampler.py  P x K identity batches (the re-ID recipe)
    dali_loader.py       --loader dali: NVIDIA DALI decodes the images, in the torch loader's order
    prefetch.py          batches copied to the device ahead of the step that needs them
"""
