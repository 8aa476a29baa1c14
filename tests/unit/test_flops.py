"""The throughput arithmetic: FLOPs per token as documented, parameter counts of quantized models, the MFU peak."""

import torch

from sft_recipe.train.flops import FlopsModel, count_params, peak_tflops
from sft_recipe.train.record import plot_losses


def test_flops_per_token_follows_the_stated_formula():
    lora = FlopsModel(total_params=1000, trainable_params=10, num_layers=2, hidden_size=8, seq_len=16,
                      gradient_checkpointing=False)
    assert lora.per_token() == 4 * 1000 + 2 * 10 + 12 * 2 * 8 * 16
    recompute = FlopsModel(1000, 10, 2, 8, 16, gradient_checkpointing=True)
    assert recompute.per_token() == 6 * 1000 + 2 * 10 + 16 * 2 * 8 * 16
    full = FlopsModel(1000, 1000, 2, 8, 16, False)  # full fine-tuning: the textbook 6N (+ attention)
    assert full.per_token() - 12 * 2 * 8 * 16 == 6 * 1000


def test_4bit_weights_count_their_real_size(tiny):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain = AutoModelForCausalLM.from_pretrained(str(tiny.model_dir))
    quantized = AutoModelForCausalLM.from_pretrained(
        str(tiny.model_dir), quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                    bnb_4bit_compute_dtype=torch.float32))
    assert sum(p.numel() for p in quantized.parameters()) < sum(p.numel() for p in plain.parameters())
    assert count_params(quantized)[0] == count_params(plain)[0]


def test_mfu_peak_comes_from_the_flag_then_the_gpu_name_and_is_absent_on_cpu(monkeypatch):
    assert peak_tflops(123.0) == 123.0  # the flag wins over any lookup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_tflops(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, expected in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-40GB", 312.0),
                           ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, _name=name: _name)
        assert peak_tflops(None) == expected, name


def test_loss_curve_is_a_png(tmp_path):
    record = {"training": {"losses": [3.0, 2.0], "loss_steps": [1, 2], "eval_losses": [2.5], "eval_loss_steps": [2],
                           "global_steps": 2},
              "distribution": {"num_processes": 2, "device": "cpu"}, "throughput": {"tokens_per_second": 100.0}}
    plot_losses(record, str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
