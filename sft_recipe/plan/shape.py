"""What the planner reads from the architecture, counted on the meta device: no weight is read or allocated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sft_recipe.errors import ConfigError

# Architectures shipped inside this package (config.json only, no weights), so the guide's recipes plan offline from
# an installed package as from a checkout.
PACKAGE_DIR = Path(__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR / "models"
# Hub ids whose architecture ships in MODELS_DIR.
KNOWN_MODEL_CONFIGS = {"meta-llama/Llama-2-70b-hf": MODELS_DIR / "llama-2-70b",
                       "meta-llama/Llama-2-7b-hf": MODELS_DIR / "llama-2-7b",
                       "01-ai/Yi-34B": MODELS_DIR / "yi-34b"}


@dataclass(frozen=True)
class Linear:
    name: str  # leaf name: q_proj, down_proj, ...
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from the architecture, counted on the meta device."""

    source: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    kv_width: int  # num_key_value_heads x head_dim
    head_dim: int
    vocab_size: int
    total_params: int
    layer_params: int  # one decoder layer (an FSDP unit)
    root_params: int  # everything outside the decoder layers (embeddings, final norm, output head)
    quantizable_params: int  # Q: weights of nn.Linear layers other than the output head
    quantizable_linears: int
    largest_linear_params: int
    layer_linears: tuple[Linear, ...]  # the nn.Linear layers of the largest decoder layer (an MoE one, for DeepSeek)
    root_linears: tuple[Linear, ...]  # nn.Linear outside the layers (the output head, ...)
    output_head: str  # leaf name of the output head
    checkpoint_bytes: int  # size of the weights on disk (safetensors files, else P x config dtype)
    # Every nn.Linear of the model as (full name, Linear), and the full names `all-linear` adapts on it
    # (sft_recipe/model/structure.py: no routed experts, routers or vision tower; dense first layers counted apart).
    linears: tuple[tuple[str, Linear], ...] = ()
    all_linear: frozenset[str] = frozenset()
    largest_layer: str = ""  # module name of the largest decoder layer
    num_heads: int = 0  # attention heads
    attention: str = "sdpa"  # what transformers picks for the class without --use_flash_attn: "sdpa" or "eager"
    # (leaf name, parameters, tensors) of the modules of each leaf name, tied tensors once: what
    # --lora_modules_to_save names ("embed_tokens", "lm_head") trains in full
    leaf_params: tuple[tuple[str, int, int], ...] = ()

    def lora_params(self, r: int, targets: str | list[str], dora: bool = False) -> int:
        """LoRA parameters: sum over adapted linears of r*(in + out) (A is r x in, B is out x r); DoRA adds a magnitude
        vector of `out` per adapted linear. 'all-linear' adapts every linear but the output head (PEFT's rule)."""
        total = 0
        for lin in self.adapted_linears(targets):
            total += r * (lin.in_features + lin.out_features) + (lin.out_features if dora else 0)
        return total

    def adapted_linears(self, targets: str | list[str]) -> list[Linear]:
        """Every linear of the model the targets adapt: `all-linear` as model/structure.py resolves it, a list by
        leaf name (PEFT's suffix match)."""
        return [lin for full, lin in self.linears if self._adapts(full, lin, targets)]

    def adapted_per_layer(self, targets: str | list[str]) -> list[Linear]:
        """The adapted linears of the largest decoder layer (the activations of one layer)."""
        inside = f"{self.largest_layer}."
        return [lin for full, lin in self.linears if full.startswith(inside) and self._adapts(full, lin, targets)]

    def _adapts(self, full: str, lin: Linear, targets: str | list[str]) -> bool:
        return full in self.all_linear if targets == "all-linear" else lin.name in targets


def shipped_name(path: Path) -> str:
    """A folder shipped in this package as the package names it (sft_recipe/plan/models/...), wherever it is
    installed: the plan prints where an architecture came from, and an absolute site-packages path says less."""
    return str(Path(*__package__.split(".")) / path.relative_to(PACKAGE_DIR))


def resolve_model_config_dir(model_name_or_path: str) -> tuple[str, str | None]:
    """Where to read the config: a local folder with config.json as is; a Hub id shipped in KNOWN_MODEL_CONFIGS from
    the shipped copy (offline); any other Hub id through AutoConfig (needs the Hub or its cache). Returns
    (path or id, note)."""
    local = Path(model_name_or_path)
    if (local / "config.json").is_file():
        return str(local), None
    if model_name_or_path in KNOWN_MODEL_CONFIGS:
        shipped = KNOWN_MODEL_CONFIGS[model_name_or_path]
        return str(shipped), f"architecture of {model_name_or_path} from {shipped_name(shipped)} (offline copy)"
    return model_name_or_path, None


def model_shape(model_name_or_path: str, trust_remote_code: bool = False, extra_vocab: int = 0) -> ModelShape:
    """Count the architecture on the meta device: no weight is read or allocated.

    extra_vocab: rows the run adds to the embeddings (chat-template tokens), counted in embeddings and output head.
    """

    from sft_recipe.model.shape import config_dtype, meta_model

    where, note = resolve_model_config_dir(model_name_or_path)
    try:
        model = meta_model(where, trust_remote_code)
    except Exception as e:  # offline Hub id, missing folder, custom code not trusted
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError([
            f"--model_name_or_path {model_name_or_path}: its config could not be read ({first}). Fix: pass a local "
            "folder holding config.json (the planner never needs weights), e.g. sft_recipe/plan/models/llama-2-70b "
            "for Llama-2-70B, or log in / go online for a Hub id."]) from None
    if extra_vocab:
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + extra_vocab, mean_resizing=False)
    from sft_recipe.model.shape import features, is_linear
    from sft_recipe.model.structure import in_text_decoder, resolve_lora_targets, text_decoder_prefix

    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    # The decoder's layers: a multimodal checkpoint's vision/audio encoder layers count with the rest (root).
    prefix = text_decoder_prefix(model)
    named_layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ in layer_classes
                    and in_text_decoder(name, prefix)]
    layers = [m for _, m in named_layers]
    if not layers:
        raise ConfigError([f"--model_name_or_path {model_name_or_path}: no decoder layer class found "
                           f"(_no_split_modules={sorted(layer_classes)}); the planner needs a transformer with "
                           "repeated decoder layers, as FSDP's TRANSFORMER_BASED_WRAP does."])
    output = model.get_output_embeddings()
    output_head = next(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is output)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    total = sum(p.numel() for p in model.parameters())
    # The largest layer is the FSDP unit gathered whole: DeepSeek's first layers are dense, the rest hold the experts.
    largest_name, largest = max(named_layers, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    layer_params = sum(p.numel() for p in largest.parameters())
    root_params = total - sum(p.numel() for layer in layers for p in layer.parameters())
    linears = [(n, m) for n, m in model.named_modules() if is_linear(m)]
    layer_linears = tuple(Linear(n.rsplit(".", 1)[-1], *features(m))
                          for n, m in largest.named_modules() if is_linear(m))
    root_linears = tuple(Linear(n.rsplit(".", 1)[-1], *features(m))
                         for n, m in linears if id(m.weight) not in in_layers)
    quantizable = [m for _, m in linears if m is not output]
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    dtype = config_dtype(config)
    files = list(Path(where).glob("*.safetensors")) if Path(where).is_dir() else []
    checkpoint_bytes = sum(f.stat().st_size for f in files) or total * dtype.itemsize
    return ModelShape(
        source=note or where,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_layers=len(layers),
        kv_width=kv_heads * head_dim,
        head_dim=head_dim,
        vocab_size=output.weight.shape[0],
        total_params=total,
        layer_params=layer_params,
        root_params=root_params,
        quantizable_params=sum(m.weight.numel() for m in quantizable),
        quantizable_linears=len(quantizable),
        largest_linear_params=max(m.weight.numel() for _, m in linears),
        layer_linears=layer_linears,
        root_linears=root_linears,
        output_head=output_head,
        checkpoint_bytes=checkpoint_bytes,
        linears=tuple((n, Linear(n.rsplit(".", 1)[-1], *features(m))) for n, m in linears),
        all_linear=resolve_lora_targets("all-linear", model).modules,
        largest_layer=largest_name,
        num_heads=getattr(text, "num_attention_heads", 0) or 0,
        attention=str(getattr(config, "_attn_implementation", None) or "sdpa"),
        leaf_params=_params_by_leaf_name(model),
    )


def _params_by_leaf_name(model) -> tuple[tuple[str, int, int], ...]:
    seen: dict[str, dict[int, int]] = {}
    for name, module in model.named_modules():
        for param in module.parameters():
            seen.setdefault(name.rsplit(".", 1)[-1], {})[id(param)] = param.numel()
    return tuple(sorted((leaf, sum(counts.values()), len(counts)) for leaf, counts in seen.items() if leaf))



def config_vocab_size(model_name_or_path: str, trust_remote_code: bool = False) -> int:
    """V as the model's config declares it: the checkpoint's own vocabulary, before a chat template adds rows."""
    from sft_recipe.model.shape import read_config

    where, _ = resolve_model_config_dir(model_name_or_path)
    return read_config(where, trust_remote_code).get_text_config().vocab_size
