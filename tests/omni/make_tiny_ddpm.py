"""Writes a random tiny diffusers DDPM pipeline (a 2-block UNet2DModel at 8x8, DDPMScheduler) into
a folder, with no download. Run with the omni venv's python: ``python make_tiny_ddpm.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel


def main(out: Path) -> None:
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10)).save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
