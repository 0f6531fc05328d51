"""The share of each model's forward GEMM FLOPs that fp8 and the per-layer features reach, as a Markdown table.

Config-built Hugging Face models (GPT-2, BERT, Llama, T5, ViT; small configs, random weights: reach
depends on the architecture, not the weights) and the bench transformer (``nn.TransformerEncoder``),
each measured by ``mixprec.gemm_reach`` on one batch. torchao's ``convert_to_float8_training``
reaches the ``nn.Linear`` modules that run (its column: their share; an ``nn.MultiheadAttention``'s
``out_proj`` it converts but never runs, the packed in-projection and transformers' ``Conv1D`` it
does not convert).

Run: python benchmarks/gemm_reach.py
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.bench.workloads import WORKLOADS


def models() -> dict[str, tuple[nn.Module, Any]]:
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (4, 64))
    small = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512}
    bench = WORKLOADS["transformer"].build("quick", torch.device("cpu"))
    return {
        "GPT-2": (tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=0, eos_token_id=0)), {"input_ids": ids}),
        "BERT": (tf.BertForMaskedLM(tf.BertConfig(vocab_size=512, **small)), {"input_ids": ids}),
        "Llama": (tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=512, num_key_value_heads=2, **small)),
                  {"input_ids": ids}),
        "T5": (tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=512, num_layers=2,
                                                         num_heads=4)), {"input_ids": ids, "decoder_input_ids": ids}),
        "ViT": (tf.ViTForImageClassification(tf.ViTConfig(image_size=64, patch_size=8, num_labels=10, **small)),
                {"pixel_values": torch.randn(4, 3, 64, 64)}),
        "bench transformer": (bench.model, bench.batch(0)[0]),
    }  # fmt: skip


def _linear_share(model: nn.Module, reach: mixprec.GemmReach) -> float:
    """The share of the weight GEMMs' FLOPs in nn.Linear modules that run (what torchao's conversion takes)."""
    attentions = {n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    # an attention's out_proj never runs as a module there
    linears = {n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.rpartition(".")[0] not in attentions}  # fmt: skip
    return sum(r.flops for r in reach.layers if r.name in linears) / reach.weight_flops


def main() -> None:
    rows = ["| model | GEMM layers (kinds) | fp8 | fp8 of the rest | per-layer | nn.Linear only | left out by fp8 |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, (model, batch) in models().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reach = mixprec.gemm_reach(model, batch)
        kinds: dict[str, int] = {}
        for r in reach.layers:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        left = "; ".join(f"{n} ({f / reach.weight_flops:.1%}, {why.split(' (')[0].split(':')[0]})"
                         for n, f, why in reach.left_out("fp8"))  # fmt: skip
        rows.append(f"| {name} | {len(reach.layers)} ({', '.join(f'{n} {k}' for k, n in kinds.items())}) | "
                    f"{reach.share('fp8'):.1%} | {reach.share_of_rest('fp8'):.1%} | {reach.share('per-layer'):.1%} | "
                    f"{_linear_share(model, reach):.1%} | {left} |")  # fmt: skip
    print("\n".join(rows))


if __name__ == "__main__":
    main()
