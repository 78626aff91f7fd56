"""Where does SGLang's model part from the golden model? Per layer, prefill and decode.

Loads a checkpoint into an in-process SGLang ModelRunner (no server, no CUDA graphs),
prefills a prompt, then decodes greedily. For the prefill, every mixer and FFN is fed
the input SGLang gave it and compared with the golden op on that same input. For each
decode step, the final logits are compared with the golden model continuing from its
own caches on the same tokens.

    python launch/compare_to_golden.py --preset tiny --prompt-lens 12,40 --dtype bfloat16 --decode-steps 24
    python launch/compare_to_golden.py --checkpoint DIR ...
"""

from __future__ import annotations

import argparse
from array import array

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompt-lens", default="12,40")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--decode-steps", type=int, default=16)
    args = ap.parse_args()

    from sglang_hybrid import cpu_support

    cpu_support.activate()
    from sglang.benchmark.one_batch import decode, extend, load_model
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.plugins import load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs

    from sglang_hybrid.checkpoints.maker import make_checkpoint
    from sglang_hybrid.reference import load

    load_plugins()
    cuda = torch.cuda.is_available()
    ckpt = args.checkpoint or make_checkpoint(args.preset, f"/tmp/compare_{args.preset}")
    sa = ServerArgs(model_path=ckpt, device="cuda" if cuda else "cpu", dtype=args.dtype, disable_cuda_graph=True,
                    mem_fraction_static=0.3 if cuda else 0.05, max_total_tokens=8192, max_mamba_cache_size=16,
                    max_running_requests=4)
    model_runner, _ = load_model(sa, PortArgs.init_new(sa), 0, 0)
    runner = getattr(model_runner, "torch_runner", model_runner)
    model = runner.model

    seen = {}

    def record(name):
        def hook(mod, inputs, output):
            seen[name] = ([t.detach().clone() if torch.is_tensor(t) else t for t in inputs], output.detach().clone())
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(record(f"mix{i}"))
        (layer.block_sparse_moe if layer.is_moe else layer.mlp).register_forward_hook(record(f"ffn{i}"))

    golden = load(ckpt, device="cuda" if cuda else "cpu")
    if args.dtype != "float32":  # the weights the server holds, computed in fp32
        golden = golden.with_weights_rounded_to(getattr(torch, args.dtype))

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    for rid, n in enumerate(int(v) for v in args.prompt_lens.split(",")):
        ids = [100 + (i * 37) % 1500 for i in range(n)]
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=args.decode_steps + 1))
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.set_extend_range(0, n)
        nxt, logits, batch = extend([req], runner)
        cache = golden.new_cache()
        gold = golden.forward(ids, cache)
        print(f"== prompt {n}: prefill, each block on SGLang's input (relative error)")
        for i in range(len(model.model.layers)):
            (x, pos, *_), y = seen[f"mix{i}"]
            (xf, *_), yf = seen[f"ffn{i}"]
            kind = "kda" if golden.config.is_kda_layer(i) else "mla"
            print(f"  layer {i} {kind}: mixer {rel(y, golden._mixer(i, x.float(), pos, golden.new_cache())):.2e}"
                  f"  ffn {rel(yf, golden._ffn(i, xf.float())):.2e}")
        print(f"  logits max |diff| {(logits[0].float() - gold[-1]).abs().max().item():.3e}")
        agree, lp_err = 0, []
        for step in range(args.decode_steps):
            tok = int(nxt[0])
            gold = golden.forward([tok], cache)
            nxt, logits = decode(nxt, batch, runner)
            served, want = int(nxt[0]), int(gold[-1].argmax())
            agree += served == want
            lp = torch.log_softmax(logits[0].float(), -1) - torch.log_softmax(gold[-1].float(), -1)
            lp_err.append(lp[served].abs().item())
            print(f"  decode {step} (position {n + step}): logits max |diff| "
                  f"{(logits[0].float() - gold[-1]).abs().max().item():.3e}  served {served} golden {want}")
        if lp_err:
            print(f"  decode summary: golden argmax agreement {agree}/{args.decode_steps}; served-token logprob "
                  f"|diff| mean {sum(lp_err) / len(lp_err):.3e} max {max(lp_err):.3e}")


if __name__ == "__main__":
    main()
