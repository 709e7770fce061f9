"""How far a result is from its reference: one definition for every launcher's correctness check."""

import torch

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||, in fp64 (0 for an exact zero reference match)."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
