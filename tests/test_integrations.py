"""fmha as a transformers attention implementation: a small Llama from a config trains like eager."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fmha.integrations.transformers as fmha_hf

transformers = pytest.importorskip("transformers")  # installed by the test extra; optional for users

EXAMPLE_PATH = Path(__file__).resolve().parent.parent / "examples" / "transformers_training.py"
_spec = importlib.util.spec_from_file_location("transformers_training", EXAMPLE_PATH)
EXAMPLE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EXAMPLE)


def test_register_and_train_like_eager(device):
    fmha_hf.register()
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager"))
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="fmha"))
    ours.load_state_dict(eager.state_dict())
    eager, ours = eager.to(device), ours.to(device)
    assert ours.config._attn_implementation == "fmha"
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)]
    for _ in range(3):
        losses = EXAMPLE.paired_step((eager, ours), optimizers, ids, mask, labels)
        assert abs(losses[0] - losses[1]) <= 1e-5


def test_attention_forward_rejects_softcap():
    q = torch.randn(1, 2, 4, 8)  # rejected before any kernel, wherever it lives
    with pytest.raises(ValueError, match=r"^softcap: expected None"):
        fmha_hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


def test_training_example_runs():
    proc = subprocess.run([sys.executable, str(EXAMPLE_PATH), "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest loss difference" in proc.stdout
