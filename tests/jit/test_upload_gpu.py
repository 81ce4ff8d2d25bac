"""StagedUpload on the GPU: a dropped upload's pinned buffers go back to torch only once its copies have read
them (attnforge/jit/upload.py, _release and reap_dropped)."""
import gc

import pytest
import torch

from attnforge.jit.upload import StagedUpload


@pytest.mark.gpu
def test_a_dropped_uploads_copy_reads_its_values_not_the_next_pinned_owners():
    """The copies wait behind a sleeping kernel, so they are still queued when the upload is dropped; torch's
    pinned allocator would hand its buffers out again at once (it knows only copies torch made), and the next
    owner's writes would be what the copy reads."""
    device = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 16
    for value in (7, 11, 13):
        up = StagedUpload(n, device)
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the copies
        up.host()[:] = value
        up.upload(n)
        up.host()[:] = value + 1  # the other buffer's copy
        up.upload(n)
        dev = up.dev  # (the device buffer outlives the upload here; the second copy wrote it last)
        del up
        gc.collect()
        grabbed = [torch.full((n,), -1, dtype=torch.int32, pin_memory=True) for _ in range(4)]
        torch.cuda.synchronize()
        assert (dev == value + 1).all(), "a copy read a pinned buffer after it was handed out again"
        del grabbed
