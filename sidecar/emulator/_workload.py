"""The small real torch work a stage worker does per engine step, on CPU: a decode step of a
tiny transformer (LLM stages) or a denoise step of a tiny conv net (diffusion stages).
Imported only inside worker processes.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
CONTEXT = 16


class TinyDecoder(nn.Module):
    """Two transformer layers over a sliding 16-token context: one forward = one decode step."""

    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=128, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)
        self.tokens = torch.zeros(1, CONTEXT, dtype=torch.long)

    @torch.inference_mode()
    def step(self) -> int:
        logits = self.head(self.layers(self.embed(self.tokens))[:, -1])
        token = int(torch.argmax(logits, dim=-1))
        self.tokens = torch.cat([self.tokens[:, 1:], torch.tensor([[token]])], dim=1)
        return token


class TinyDenoiser(nn.Module):
    """A conv net predicting noise on a 4x16x16 latent: one forward = one denoise step."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, channels, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(channels, 4, 3, padding=1),
        )
        self.latent = torch.randn(1, 4, 16, 16)

    @torch.inference_mode()
    def step(self) -> int:
        self.latent = self.latent - 0.1 * self.net(self.latent)
        return int(self.latent.abs().argmax())


def build_workload(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyDenoiser() if kind == "diffusion" else TinyDecoder()
    return model.eval()
