"""Host -> device index copies (sgl_kvxfer/utils/host_copy.py)."""
import time

import pytest
import torch

from sgl_kvxfer.utils.host_copy import int64_to_device, to_device


def test_int64_to_device_concatenates_and_owns_its_memory():
    out = int64_to_device(([3, -1], [], [2**40]), "cpu")
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 2**40]
    out.add_(1)  # writable, not a view of a freed array buffer
    assert int64_to_device((), "cpu").numel() == 0
    src = torch.arange(4)
    copy = to_device(src, "cpu")
    copy.zero_()
    assert src.tolist() == [0, 1, 2, 3]


@pytest.mark.gpu
def test_large_copy_does_not_wait_for_queued_gpu_work():
    """A prefill's index lists (~MBs) must reach the GPU without the host waiting for the step
    already queued on the stream; a pageable copy of this size waits for it."""
    n = 2_000_000  # 16 MB, far past the driver's pageable staging buffer
    values = list(range(n))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of "step in flight"
    t = time.perf_counter()
    out = int64_to_device((values,), "cuda")
    waited = time.perf_counter() - t
    torch.cuda.synchronize()
    assert waited < 0.3, f"the copy waited {waited:.3f} s for queued GPU work"
    assert torch.equal(out.cpu(), torch.arange(n))
    # later copies reuse pinned blocks only after their DMA ran: none corrupts an earlier one
    outs = [int64_to_device(([i] * 1000,), "cuda") for i in range(50)]
    assert all(bool((o == i).all()) for i, o in enumerate(outs))
