"""Query features for a query-conditioned topology policy (inputs of a learned head, not routing rules)."""

from __future__ import annotations

import zlib

import torch

HASHED_DIM = 256


def hashed_features(query: str, dim: int = HASHED_DIM, device: torch.device | str = "cpu") -> torch.Tensor:
    """Character 3-gram counts of the lower-cased query hashed (crc32) into `dim` buckets, L2-normalised: cheap,
    deterministic across processes, and enough for a linear head to tell query types apart."""
    text = f"  {query.lower()}  "
    counts = [0.0] * dim
    for i in range(len(text) - 2):
        counts[zlib.crc32(text[i:i + 3].encode("utf-8", "surrogatepass")) % dim] += 1.0
    out = torch.tensor(counts, device=device)  # one copy to the device, not one per 3-gram
    norm = out.norm()
    return out / norm if norm > 0 else out
