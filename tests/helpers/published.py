"""Heads rewritten into the layouts their authors publish (../shared/ENGINES.md, "Published head layouts"): the
tensor names, dtypes and config keys as published, so `heads/published.py` is tested on what users download."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from headstart.heads.eagle3 import VARIANT_FLAGS

LAYOUTS = ("medusa", "eagle", "eagle3-authors", "eagle3-specforge", "eagle3-speculators")


def _llama(model, **extra) -> dict:
    c = model.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "num_hidden_layers": 1,
        "torch_dtype": "float16",
        **extra,
    }


def _eagle3_name(name: str, first: str) -> str:
    """A headstart EAGLE-3 tensor's published name: the first layer under `first`, further layers `layers.{i}`."""
    if name.startswith("midlayer."):
        return first + name.removeprefix("midlayer.")
    if name.startswith("extra_layers."):
        index, rest = name.removeprefix("extra_layers.").split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    return name


def write_published(
    heads: torch.nn.Module,
    model,
    layout: str,
    out: Path,
    *,
    pickle: bool = False,
    d2t: bool = True,
    aux_ids: list[int] | None = None,
    embed: torch.Tensor | None = None,
) -> Path:
    """`heads` (a headstart head module for `model`) written to `out` in `layout`. `pickle`: a .bin/.pt file
    instead of safetensors; `d2t`: EAGLE-3 draft vocabulary offsets (False: the head must read the whole
    vocabulary); `aux_ids`: EAGLE-3's fused layers (Hugging Face hidden-state indices), written in the
    layout's numbering; `embed`: the stored embedding (default: the target's, in float32 as the authors
    store it)."""
    out.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in heads.state_dict().items()}
    config: dict = {}
    if embed is None:
        embed = model.get_input_embeddings().weight.detach().float().clone()
    if layout == "medusa":
        lm_head = model.get_output_embeddings().weight.detach()
        tensors = {}
        for h in range(heads.num_heads):
            block = heads.blocks[h]
            blocks = list(block) if isinstance(block, torch.nn.Sequential) else [block]
            for b, res in enumerate(blocks):
                tensors[f"{h}.{b}.linear.weight"] = res.linear.weight.detach().clone()
                tensors[f"{h}.{b}.linear.bias"] = res.linear.bias.detach().clone()
            own = heads.lm_heads[h].weight if heads.lm_heads is not None else lm_head
            tensors[f"{h}.{len(blocks)}.weight"] = own.detach().clone()
        config = {
            "medusa_num_heads": 2,
            "medusa_num_layers": len(blocks),  # the authors' wrong head count
            "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
        }
        name = "medusa_lm_head.pt" if pickle else "medusa_lm_head.safetensors"
    elif layout == "eagle":
        state.pop("draft_vocab", None)  # EAGLE-1/2 heads read out through the target's whole lm_head
        tensors = {
            ("layers.0." + k.removeprefix("layer.") if k.startswith("layer.") else k): v for k, v in state.items()
        }
        tensors["embed_tokens.weight"] = embed
        config = _llama(model, bias="fc.bias" in tensors)
        name = "pytorch_model.bin" if pickle else "model.safetensors"
    else:
        prefix = "layers.0." if layout == "eagle3-speculators" else "midlayer."
        ids = state.pop("draft_vocab", None)
        tensors = {_eagle3_name(k, prefix): v for k, v in state.items()}
        if ids is not None and d2t:
            order = torch.argsort(ids)  # published draft vocabularies are ordered by token id
            ids, tensors["lm_head.weight"] = ids[order], tensors["lm_head.weight"][order]
            tensors["d2t"] = ids - torch.arange(len(ids))
            t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d
        elif ids is not None:
            raise ValueError("a head with a reduced draft vocabulary needs d2t")
        variant = heads.variant()
        layer = _llama(
            model, draft_vocab_size=tensors["lm_head.weight"].shape[0], num_hidden_layers=variant["num_layers"]
        )
        flags = {k: variant[k] for k in VARIANT_FLAGS if variant[k]}
        if layout == "eagle3-authors":
            tensors["embed_tokens.weight"] = embed
            config = {**layer, **flags}
            if aux_ids is not None:  # vLLM's numbering: the input of layer k (Hugging Face's hidden state k)
                config["eagle_aux_hidden_state_layer_ids"] = aux_ids
        elif layout == "eagle3-specforge":
            config = {**layer, **flags, "architectures": ["LlamaForCausalLMEagle3"]}
            if aux_ids is not None:  # SGLang's numbering: the output of layer k (Hugging Face's hidden state k + 1)
                config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_ids]}
        else:
            config = {
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-llama"}},
                "transformer_layer_config": layer,
                "draft_vocab_size": layer["draft_vocab_size"],
                "target_hidden_size": model.config.hidden_size,
                "norm_before_residual": heads.midlayer.norm_before_residual,
                "eagle_aux_hidden_state_layer_ids": aux_ids,
                **flags,
            }
        name = "pytorch_model.bin" if pickle else "model.safetensors"
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if pickle:
        torch.save(tensors, out / name)
    else:
        save_file(tensors, str(out / name))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
