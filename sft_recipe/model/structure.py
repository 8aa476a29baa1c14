"""What a model's modules are, read from what they hold and where they sit (usually on the meta device), never from
class, leaf or config-attribute names: routed experts, their routers, shared experts and dense MLPs, the text decoder
of a multimodal model, and what `--lora_target_modules` means for the model. The ground floor: imports torch,
transformers and peft only.

Rules (every MoE family transformers 5 builds follows them; tests/unit/test_model_structure.py checks them):
- Routed experts: a module holding its own 3-D parameters (experts x out x in), E the largest leading size, E >= 2
  (or E = 1 in two or more of them) --
  transformers 5 fuses Mixtral, Qwen3-MoE, DeepSeek-V3, GraniteMoE, PhiMoE, ... this way -- torch's convolutions
  excepted (a Conv1d weight is 3-D too: Qwen3-Next's linear attention); or, as remote-code models keep them, a
  ModuleList of E >= 2 modules of one class, each an MLP (>= 2 nn.Linear, no ModuleList inside), in a block that
  also holds a 2-D parameter with E rows (the router: one logit per expert; a list of decoder layers has none).
  E, the expert count, is counted from the built model: how a config spells it (num_local_experts, num_experts,
  n_routed_experts, moe_num_experts, ...) does not matter. Top-k is the config's; `TOP_K_NAMES` lists its spellings.
- The MoE block is the module holding the routed experts. Beside them, a part with >= 2 nn.Linear is an MLP every
  token goes through: a shared expert (DeepSeek, Qwen2-MoE, ERNIE-4.5; the attention, where a model puts its experts
  straight into the decoder layer). Any other part holding parameters is gating: the router (whatever its class:
  nn.Linear, DeepseekV3TopkRouter's bare 2-D weight, a module around a linear) and gates such as Qwen2-MoE's
  one-row shared_expert_gate or a bias per expert. all-linear adapts neither experts nor gating.
- Dense MLP layers (DeepSeek's first `first_k_dense_replace` layers) sit outside every MoE block: ordinary linears.

What `all-linear` means (`resolve_lora_targets`): every linear layer (nn.Linear, or GPT-2's Conv1D) of the text
decoder the training forward calls (reach.py), but the output head, the routed experts, the gating and what PEFT
refuses on the model type (Mamba's out_proj). PEFT's own all-linear reaches further on MoE models and breaks the
run: on transformers 5 it adds the fused experts and the router as `target_parameters`, whose ParamWrapper raises on the
guide's lora_dropout 0.1. So for an MoE or multimodal model the rule is handed to PEFT as explicit names, checked
against what PEFT will do with them: PEFT 0.21 rewrites, on every get_peft_model and every later load, target names
it takes for transformers-4 expert projections (`gate_proj`, `up_proj`, `down_proj`, `gate`, `w1`-`w3`) into fused
expert parameters for the model types it converts (DeepSeek-V2/V3, Qwen3-MoE/Next, ERNIE-4.5-MoE, AFMoE, OLMoE,
GLM-4-MoE, ...; huggingface/peft#3711), dotted full names included. Those linears -- DeepSeek-V3's dense first
layers and its shared experts -- are left out, and said (`LoraTargets.left_out`): no spelling of them survives
PEFT 0.21, and an adapter naming them would not load anywhere. A PEFT that keeps dotted names gets them back.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from sft_recipe.model.reach import peft_refused, reached_linears
from sft_recipe.model.shape import is_linear

# Module names of the non-text parts of multimodal models in transformers 5 (vision/audio encoders, projectors).
NON_TEXT_PARTS = ("vision_tower", "vision_model", "visual", "audio_tower", "multi_modal_projector", "vision_embed")

# How configs spell top-k (experts each token is routed to), most common first. Never `top_k`: older configs carry
# it as a sampling setting. DBRX nests it (`ffn_config.moe_top_k`).
TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "num_experts_per_token", "experts_per_token")


@dataclass(frozen=True)
class ExpertBlock:
    name: str                  # the MoE block: model.layers.1.mlp
    experts: str               # its routed experts: model.layers.1.mlp.experts
    num_experts: int
    gating: tuple[str, ...]    # router and gates (modules or, for a bias on the block itself, parameters)
    shared: tuple[str, ...]    # MLPs beside the routed experts that every token goes through


def _peft_base(name: str) -> str:
    """A PEFT wrapper keeps the module it wraps as `base_layer`: the name the model had before PEFT."""
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name.replace(".base_layer.", ".")


def _linears(module) -> int:
    return sum(is_linear(m) for m in module.modules())


def _fused_experts(module) -> int:
    """E when `module` holds fused routed experts (own 3-D parameters, experts first: E >= 2, or two or more of them
    -- a config with one routed expert, as Hunyuan-MoE's default), else 0. E is the largest leading size: LongCat-Flash
    fuses its zero-computation experts into gate_up_proj (768) but not down_proj (512), and routes over all 768."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return 0
    # Matrices per expert (out x in, both >= 2): RWKV's (1, 1, hidden) time-mix vectors are no experts.
    shapes = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3 and min(p.shape[1:]) >= 2]
    if not shapes:
        return 0
    return max(shapes) if max(shapes) >= 2 or len(shapes) >= 2 else 0


def _listed_experts(module, parent) -> int:
    """E when `module` is a ModuleList of E >= 2 same-class MLPs and its parent holds a 2-D parameter with E rows
    outside the list (the router), else 0."""
    children = list(module.children()) if isinstance(module, torch.nn.ModuleList) else []
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return 0
    if any(_linears(c) < 2 or any(isinstance(m, torch.nn.ModuleList) for m in c.modules()) for c in children):
        return 0
    inside = {id(p) for p in module.parameters()}
    rows = {p.shape[0] for p in parent.parameters() if p.dim() == 2 and id(p) not in inside}
    return len(children) if len(children) in rows else 0


def expert_blocks(model) -> tuple[ExpertBlock, ...]:
    """Every MoE block of the model, read from its structure (the module docstring's rules)."""
    modules = dict(model.named_modules())
    blocks = []
    for name, module in modules.items():
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        parent = modules.get(parent_name)
        count = _fused_experts(module) or (_listed_experts(module, parent) if parent is not None else 0)
        if not count or parent is None or name.endswith(".base_layer"):
            continue
        block_name = _peft_base(parent_name)
        experts = _peft_base(name)
        if any(b.experts == experts for b in blocks):  # a PEFT-wrapped experts module, seen once
            continue
        block = modules[block_name] if block_name in modules else parent
        gating, shared = [], []
        for child_name, child in block.named_children():
            full = f"{block_name}.{child_name}" if block_name else child_name
            if full == experts or not any(True for _ in child.parameters()):
                continue
            (shared if _linears(child) >= 2 else gating).append(full)
        gating += [f"{block_name}.{p}" for p, _ in block.named_parameters(recurse=False)]
        blocks.append(ExpertBlock(block_name, experts, count, tuple(gating), tuple(shared)))
    return tuple(blocks)


def fused_expert_parameters(model) -> list[str]:
    """Names of fused routed-expert parameters (3-D: experts x out x in), e.g. `...mlp.experts.gate_up_proj`."""
    experts = {b.experts for b in expert_blocks(model)}
    return [name for name, p in model.named_parameters()
            if p.dim() == 3 and _peft_base(name.rsplit(".", 1)[0]) in experts]


def expert_count(model) -> int:
    """Routed experts per MoE layer, counted from the model (0 for a dense model)."""
    return max((b.num_experts for b in expert_blocks(model)), default=0)


def experts_per_token(config) -> int | None:
    """Top-k from the (text) config, whichever way it is spelled; None where it says none. A per-layer list counts
    its largest (an upper bound for FLOPs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for holder in (text, getattr(text, "ffn_config", None)):
        for key in TOP_K_NAMES:
            value = getattr(holder, key, None) if holder is not None else None
            if isinstance(value, (list, tuple)) and value:
                value = max(value)
            if isinstance(value, int) and value > 0:
                return value
    return None


def active_expert_fraction(model) -> float:
    """Of the routed experts' weights, the fraction each token multiplies: top-k / experts (Mixtral: 2 of 8;
    DeepSeek-V3: 8 of 256); 1 for a dense model or a config that names no top-k (all counted: an upper bound).
    Shared experts, dense layers and routers are outside the routed experts: every token uses them."""
    experts, top_k = expert_count(model), experts_per_token(model.config)
    return min(1.0, top_k / experts) if experts and top_k else 1.0


def routed_expert_parameter_ids(model) -> set[int]:
    """ids of the parameters inside routed experts (fused or listed): those a token uses only top-k/E of."""
    modules = dict(model.named_modules())
    return {id(p) for b in expert_blocks(model) if b.experts in modules for p in modules[b.experts].parameters()}


def text_decoder_prefix(model) -> str:
    """Module-name prefix of a multimodal model's language part ("" for a text-only model): where the text config
    lives (`config.get_text_config()`), found as the module that does not belong to a vision/audio part."""
    if model.config.get_text_config() is model.config:
        return ""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for name, module in model.named_modules():
        if module is decoder:
            return name
    return ""


def in_text_decoder(name: str, prefix: str) -> bool:
    return name.startswith(prefix) and not any(part in name.split(".") for part in NON_TEXT_PARTS)


def all_linear_modules(model) -> set[str]:
    """Full names of the linears `all-linear` adapts (the module docstring): the text decoder's nn.Linear but the
    output head, the routed experts and the gating."""
    head = model.get_output_embeddings()
    prefix = text_decoder_prefix(model)
    blocks = expert_blocks(model)
    skip = tuple(f"{part}." for b in blocks for part in (b.experts, *b.gating))
    gates = {part for b in blocks for part in b.gating}
    return {name for name, m in model.named_modules()
            if is_linear(m) and m is not head and in_text_decoder(name, prefix)
            and name not in gates and not name.startswith(skip)}


def parse_target_modules(value: str) -> str | list[str]:
    """The `--lora_target_modules` flag: "all-linear", or its comma-separated module names."""
    value = value.strip()
    return value if value == "all-linear" else [m.strip() for m in value.split(",") if m.strip()]


def parse_target_parameters(value: str) -> list[str]:
    """The `--lora_target_parameters` flag: fused expert parameter names, comma-separated (none when empty)."""
    return [p.strip() for p in value.split(",") if p.strip()]


@dataclass(frozen=True)
class LoraTargets:
    target_modules: str | list[str]               # what LoraConfig is given
    modules: frozenset[str] = field(default_factory=frozenset)  # the modules PEFT adapts with it
    left_out: tuple[str, ...] = ()                 # linears all-linear means that PEFT cannot adapt here
    rewritten: tuple[str, ...] = ()                # names PEFT turns into fused-expert parameter targets
    unreached: tuple[str, ...] = ()                # linears training never changes (reach.py)
    refused: tuple[str, ...] = ()                  # linears PEFT's compatibility check refuses on this model

    def note(self) -> str | None:
        """What all-linear leaves out here and why (None when it adapts every linear of the decoder)."""
        def leaves(names):
            return ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))

        said = []
        if self.left_out:
            said.append(f"all-linear leaves {len(self.left_out)} linears untrained ({leaves(self.left_out)}: dense "
                        "MLP layers and shared experts): PEFT 0.21 rewrites these names into the fused routed "
                        "experts' parameters for this model type, when training and when the adapter is loaded "
                        "(huggingface/peft#3711), so no adapter naming them loads.")
        if self.unreached:
            said.append(f"all-linear leaves {len(self.unreached)} linears out ({leaves(self.unreached)}): the "
                        "training forward never trains them as plain linears (cross-attention to an encoder this "
                        "causal LM does not have, a weight a kernel reads directly, a selection with no gradient, a "
                        "grouped projection), so LoRA there would stay at zero or not fit.")
        if self.refused:
            said.append(f"all-linear leaves {len(self.refused)} linears out ({leaves(self.refused)}): PEFT refuses "
                        "LoRA on them for this model type (incompatible with Mamba-based models).")
        return " ".join(said + ["The other projections are adapted."]) if said else None


def peft_adapts(target_modules: str | list[str], model) -> tuple[set[str], set[str]]:
    """(the modules PEFT will adapt with these target_modules, the names its transformers-v4 conversion rewrites
    into target_parameters), by running PEFT's own matching and conversion on a copy of the config."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=copy.copy(target_modules))
    try:  # PEFT's v4->v5 MoE conversion (transformers >= 5): applied in every inject_adapter
        from peft.import_utils import is_transformers_ge_v5
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        is_transformers_ge_v5 = False
    if is_transformers_ge_v5:
        convert_peft_config_for_transformers(config, model=model, conversions=None)
    rewritten = set()
    if config.target_parameters:
        given = {target_modules} if isinstance(target_modules, str) else set(target_modules)
        rewritten = given - set(config.target_modules or ()) if not isinstance(target_modules, str) else given
    matched = {name for name, _ in model.named_modules()
               if name and check_target_module_exists(config, name) is True or
               (name and isinstance(check_target_module_exists(config, name), re.Match))}
    return matched, rewritten


def _candidates(chosen: set[str], all_names: list[str], prefix: str) -> list[str | list[str]]:
    """Spellings of `chosen` for target_modules, shortest first: leaf names; leaf names with full names where a
    leaf also names a module not chosen; a full-match pattern (layer numbers as \\d+); every name spelled out."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    out: list[str | list[str]] = [leaves]
    unchosen = {n.rsplit(".", 1)[-1] for n in all_names if n not in chosen}
    clean = [leaf for leaf in leaves if leaf not in unchosen]
    mixed = sorted(clean + [n for n in chosen if n.rsplit(".", 1)[-1] not in clean])
    if mixed != leaves:
        out.append(mixed)
    if prefix:  # the language model's linears only (PEFT full-matches a string)
        out.append(rf"{re.escape(prefix)}\..*\.({'|'.join(leaves)})")
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(n)) for n in chosen})  # escape() did the dots
    out.append("|".join(shapes))
    out.append("|".join(sorted(re.escape(n) for n in chosen)))
    return out


def resolve_lora_targets(value: str, model) -> LoraTargets:
    """What `--lora_target_modules value` means for this model (the module docstring). A list is the user's, given
    as is (its rewritten names are reported, for validation). "all-linear" stays PEFT's own where PEFT's rule is
    right (no routed experts, no non-text part); otherwise the first spelling with which PEFT adapts exactly the
    linears chosen, leaving out those PEFT would rewrite into fused-expert parameters."""
    parsed = parse_target_modules(value)
    if parsed != "all-linear":
        matched, rewritten = peft_adapts(parsed, model) if parsed else (set(), set())
        return LoraTargets(parsed, frozenset(matched), rewritten=tuple(sorted(rewritten)))
    chosen = all_linear_modules(model)
    reached = reached_linears(model)
    unreached = tuple(sorted(chosen - reached)) if reached is not None else ()
    refused = tuple(sorted(peft_refused(model, sorted(chosen - set(unreached)))))
    chosen -= {*unreached, *refused}
    said = {"unreached": unreached, "refused": refused}
    prefix = text_decoder_prefix(model)
    if not prefix and not expert_blocks(model) and not unreached and not refused:
        return LoraTargets("all-linear", frozenset(chosen))
    all_names = [name for name, _ in model.named_modules() if name]
    left_out: set[str] = set()
    for _ in range(2):  # the second pass without the linears PEFT rewrites
        stolen: set[str] = set()
        for candidate in _candidates(chosen - left_out, all_names, prefix):
            matched, rewritten = peft_adapts(candidate, model)
            if matched == chosen - left_out and not rewritten:
                return LoraTargets(candidate, frozenset(matched), tuple(sorted(left_out)), **said)
            stolen |= {r.rsplit(".", 1)[-1] for r in rewritten if not isinstance(candidate, str)}
        left_out |= {n for n in chosen if n.rsplit(".", 1)[-1] in stolen}
        if not stolen:
            break
    # Nothing reproduces the choice exactly (PEFT flattens a pattern to leaf names for the types it converts):
    # the spelled-out names, which adapt no module outside the choice.
    kept = chosen - left_out
    fallback = "|".join(sorted(re.escape(n) for n in kept))
    return LoraTargets(fallback, frozenset(peft_adapts(fallback, model)[0]), tuple(sorted(left_out)), **said)


@lru_cache(maxsize=16)
def lora_targets_of(value: str, model_name_or_path: str, trust_remote_code: bool = False) -> LoraTargets:
    """`resolve_lora_targets` for a model on disk, built on the meta device once per (flag, model) in a run: the
    load, the validation, the resume check and the plan all ask, and must get the same answer."""
    from sft_recipe.model.shape import meta_model

    if not model_name_or_path:  # nothing to resolve against: the flag as given
        return LoraTargets(parse_target_modules(value))
    return resolve_lora_targets(value, meta_model(model_name_or_path, trust_remote_code))
