"""checks.output_buffers: allocation when absent, refusal of a wrong buffer before any launch (host only)."""
import pytest
import torch

from attnforge import checks


def test_allocates_out_and_lse_only_when_asked():
    out, lse = checks.output_buffers(None, None, False, (3, 4, 8), torch.float16, torch.device("cpu"), "o", "l")
    assert out.shape == (3, 4, 8) and out.dtype == torch.float16 and lse is None
    out, lse = checks.output_buffers(None, None, True, (3, 4, 8), torch.float16, torch.device("cpu"), "o", "l")
    assert lse.shape == (3, 4) and lse.dtype == torch.float32


def test_given_buffers_are_checked():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="out: expected a CUDA tensor"):
        checks.output_buffers(torch.empty(3, 4, 8), None, False, (3, 4, 8), torch.float32, cpu, "o", "l")
    with pytest.raises(ValueError, match="lse: expected a CUDA tensor"):
        checks.output_buffers(None, torch.empty(3, 4), True, (3, 4, 8), torch.float32, cpu, "o", "l")
