"""Kernels per replay of a vocoder, counted on a meta twin (`flashrt.profile.kernels`).

    count = kernels_per_replay(frontend)          # a loaded VocoderFrontend, its largest bucket
    twin = meta_frontend(family, config, dtype)   # a release-size vocoder without weights

The twin has the frontend's config, dtype, buckets and batch, and its module on the meta device (no
weight memory); one replay of a bucket runs the padded graph function (what a captured graph
replays: ``ValidLength`` masking, the copy into ``audio``). The CPU's conv policies (spectral,
phase-split) are not applied: the count is the CUDA path's. For these convolutional decoders it does
not depend on the bucket's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashrt.frontends.vocoders.base import VocoderFamily
from flashrt.frontends.vocoders.frontend import VocoderFrontend
from flashrt.io.loading import meta_twin
from flashrt.profile.kernels import KernelCount, count_kernels

__all__ = ["meta_frontend", "kernels_per_replay"]


def meta_frontend(family: VocoderFamily, config: Any, dtype: torch.dtype = torch.float32,
                  buckets: Sequence[int] | None = None, batch: int = 1) -> VocoderFrontend:
    """A captured (eager, padded-bucket) `VocoderFrontend` on the meta device for ``config``."""
    module = meta_twin(lambda: family.build(config), dtype)
    fe = VocoderFrontend(family, config, module, device="meta", backend="eager", buckets=buckets,
                         batch=batch, dtype=dtype, exact_length=False)
    return fe.capture()


def kernels_per_replay(frontend: VocoderFrontend, bucket: int | None = None) -> KernelCount:
    """The kernels one replay of ``bucket`` (default: the largest) of ``frontend`` launches on a GPU."""
    twin = meta_frontend(frontend.family, frontend.config, frontend.dtype, frontend.buckets, frontend.batch)
    bucket = twin.buckets[-1] if bucket is None else bucket
    return count_kernels(lambda: twin.replay(bucket))
