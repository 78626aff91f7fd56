"""Serve prompts through sglang.Engine with chosen server arguments and report, per
prompt, how far each served greedy token trails the golden model's argmax (teacher-
forced on the served tokens; 0 means it is the argmax).

    python launch/engine_vs_golden.py --preset tiny --prompt-lens 1,9,40,300 \
        --arg dtype=float32 --arg chunked_prefill_size=128 --arg disable_cuda_graph=true

Prompts go in one batched call, as the server tests send them.
"""

from __future__ import annotations

import argparse
import random

import torch


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompt-lens", default="1,9,40,300")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--arg", action="append", default=[], help="KEY=VALUE for sglang.Engine (ServerArgs field)")
    args = ap.parse_args()

    from sglang_hybrid import cpu_support

    cpu_support.activate()
    import sglang

    from sglang_hybrid.checkpoints.maker import make_checkpoint
    from sglang_hybrid.reference import load

    ckpt = args.checkpoint or make_checkpoint(args.preset, f"/tmp/engine_vs_golden_{args.preset}")
    kwargs = dict(kv.split("=", 1) for kv in args.arg)
    kwargs = {k: _value(v) for k, v in kwargs.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(int(n))] for n in args.prompt_lens.split(",")]

    engine = sglang.Engine(model_path=ckpt, **kwargs)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": args.max_new, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()

    golden = load(ckpt, device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"engine args {kwargs}")
    for ids, out in zip(prompts, outs):
        served = out["output_ids"]
        logits = golden.logits(ids + served[:-1])[len(ids) - 1:].float()
        lead = logits.max(-1).values - logits[torch.arange(len(served), device=logits.device),
                                              torch.tensor(served, device=logits.device)]
        over = (lead > 1e-3).nonzero().flatten().tolist()
        print(f"  prompt {len(ids):4d}: max lead {lead.max().item():.3e} at step {int(lead.argmax())}; "
              f"steps with lead > 1e-3: {over[:12]}")


if __name__ == "__main__":
    main()
