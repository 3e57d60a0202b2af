"""Train a small Llama built from a config (no downloaded weights) with fmha attention, beside the
same model with transformers' eager attention, and compare their losses step by step.

    python examples/transformers_training.py --steps 20            # GPU if present, else CPU

Needs ``pip install -e ".[hf]"``. Right padding with ``-100`` labels on the padding, as in training.
"""

from __future__ import annotations

import argparse

import torch

import fmha.integrations.transformers as fmha_hf  # before transformers, which imports triton

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  isort: skip


def paired_step(models, optimizers, ids, mask, labels) -> list[float]:
    """One training step of each model on the same batch; their losses."""
    losses = []
    for model, optimizer in zip(models, optimizers):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest allowed loss difference (default: 1e-4 fp32, 2e-2 bf16)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tolerance = args.tolerance if args.tolerance is not None else (1e-4 if args.dtype == "fp32" else 2e-2)
    small = not torch.cuda.is_available()
    config = dict(vocab_size=512, hidden_size=64 if small else 512, intermediate_size=128 if small else 1536,
                  num_hidden_layers=2 if small else 4, num_attention_heads=4 if small else 8,
                  num_key_value_heads=2, max_position_embeddings=max(args.seqlen, 64))
    seqlen = min(args.seqlen, 32) if small else args.seqlen

    fmha_hf.register()
    torch.manual_seed(0)
    eager = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager")).to(device, dtype)
    ours = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="fmha")).to(device, dtype)
    ours.load_state_dict(eager.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, ours)]
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        ids = torch.randint(0, config["vocab_size"], (args.batch, seqlen), generator=generator).to(device)
        mask = torch.ones_like(ids)
        mask[1:, seqlen - seqlen // 4:] = 0  # right padding on all but the first sequence
        labels = ids.masked_fill(mask == 0, -100)
        losses = paired_step((eager, ours), optimizers, ids, mask, labels)
        worst = max(worst, abs(losses[0] - losses[1]))
        print(f"step {step:3d}  eager {losses[0]:.6f}  fmha {losses[1]:.6f}  diff {losses[1] - losses[0]:+.2e}")
    print(f"largest loss difference {worst:.2e} (tolerance {tolerance:g}) on {device}, {args.dtype}")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
