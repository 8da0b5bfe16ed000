"""A torch.profiler CPU trace whose steps carry vLLM's engine-step annotation names (one prefill
of 17 tokens, then decode steps, one mixed step), for the engine-step figures of the summary.

  python3 bench/gen_engine_trace.py --out /tmp/engine/20261201-100000_stage0_rank0_1764500000

The model is a small transformer on CPU; only the annotation names are vLLM's
(``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``, as its GPU worker writes them).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--decode-steps", type=int, default=8)
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, nhead=4, dim_feedforward=512, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2).eval()
    steps = [("execute_context_1(17)_generation_0(0)", 17)]
    steps += [("execute_context_0(0)_generation_1(1)", 1)] * a.decode_steps
    steps += [("execute_context_1(9)_generation_1(1)", 10)]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for name, tokens in steps:
            with record_function(name):
                model(torch.randn(1, tokens, 128))
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "trace_rank0.json"
    prof.export_chrome_trace(str(path))
    print(path)


if __name__ == "__main__":
    main()
