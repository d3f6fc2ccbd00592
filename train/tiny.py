"""A tiny Llama checkpoint for CPU runs, tests and the demo (and a tiny MoE with `--moe`).

`python -m train.tiny --out DIR` writes a complete Hugging Face folder (config, safetensors
weights, tokenizer, generation config) that transformers and vLLM on CPU load as they are.
`--moe` writes a Qwen3-MoE model instead (every MLP a sparse block of `--experts` experts, the
router choosing `--top-k` per token) with the same tokenizer, attention shape and width, for the
expert-parallel trainer; `--moe-family mixtral` writes the same shape as Mixtral, whose
checkpoint names its experts differently (train/expert_layout.py). These two families because
transformers keeps their experts as two stacked [experts, ...] tensors per layer, which shard
along the expert dimension as they are. `--router-aux-loss-coef` > 0 turns on the load-balancing
loss the model defines (`output_router_logits`; train/router_loss.py).

Choices and their reasons (measured; docs/design.md §10.3 and §10.4):
- Llama, not Qwen2: with a Qwen2 config AutoTokenizer forces Qwen2Tokenizer, whose byte-level
  pre-tokenizer drops spaces and newlines.
- head_dim 32: vLLM's CPU attention needs head_dim >= 32.
- a character-level WordLevel tokenizer with a Fuse decoder, so decoding adds no spaces.
"""
from __future__ import annotations

import json
from pathlib import Path

import click
from coordination.records import restrict_umask

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# Printable ASCII plus newline: enough for arithmetic, chat role markers and short prose.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer():
    """A PreTrainedTokenizerFast over single characters; prepends <bos> to every encoded text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False)


def build_model_config(tokenizer, *, hidden: int, layers: int, heads: int, kv_heads: int,
                       intermediate: int, max_positions: int, experts: int = 0, top_k: int = 2,
                       family: str = "qwen3_moe", router_aux_loss_coef: float = 0.0):
    """A LlamaConfig, or with `experts` > 0 a Qwen3MoeConfig or MixtralConfig (`family`) whose
    experts are each intermediate / top_k wide, so a token's active MLP width equals the dense model's."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    if hidden % heads:
        raise click.UsageError(f"--hidden ({hidden}) must be divisible by --heads ({heads})")
    if hidden // heads < 32:
        raise click.UsageError(
            f"head_dim = hidden/heads = {hidden // heads} is below 32, which vLLM's CPU backend refuses; "
            f"raise --hidden or lower --heads")
    if heads % kv_heads:
        raise click.UsageError(f"--heads ({heads}) must be divisible by --kv-heads ({kv_heads})")
    if experts:
        if not 1 <= top_k <= experts:
            raise click.UsageError(f"--top-k ({top_k}) must be between 1 and --experts ({experts})")
        if intermediate % top_k:
            raise click.UsageError(f"--intermediate ({intermediate}) must be divisible by --top-k ({top_k}): each "
                                   f"expert is intermediate / top_k wide")
        if router_aux_loss_coef < 0:
            raise click.UsageError(f"--router-aux-loss-coef ({router_aux_loss_coef}) must be 0 (off) or positive")
        common = dict(
            vocab_size=len(tokenizer), hidden_size=hidden, num_experts_per_tok=top_k, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
            max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
            output_router_logits=router_aux_loss_coef > 0, router_aux_loss_coef=router_aux_loss_coef,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        if family == "mixtral":
            return MixtralConfig(intermediate_size=intermediate // top_k, num_local_experts=experts, **common)
        if family != "qwen3_moe":
            raise click.UsageError(f"--moe-family {family!r} is not one of {', '.join(MOE_FAMILIES)}")
        return Qwen3MoeConfig(intermediate_size=intermediate, moe_intermediate_size=intermediate // top_k,
                              num_experts=experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              **common)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def write_tiny_model(out: Path, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 384, max_positions: int = 256, seed: int = 0, experts: int = 0,
                     top_k: int = 2, family: str = "qwen3_moe", router_aux_loss_coef: float = 0.0) -> Path:
    """Write a randomly initialised tiny Llama folder (with `experts` > 0: an MoE of `family`) to
    `out` (created; must be empty or absent)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise click.UsageError(f"--out {out} is not empty; choose a new folder or remove it first")
    tokenizer = build_tokenizer()
    config = build_model_config(tokenizer, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                intermediate=intermediate, max_positions=max_positions, experts=experts,
                                top_k=top_k, family=family, router_aux_loss_coef=router_aux_loss_coef)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, max_new_tokens=16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "baton-tiny.json").write_text(json.dumps({"parameters": n_params, "seed": seed}) + "\n")
    return out


@click.command()
@click.option("--out", type=click.Path(path_type=Path), required=True, help="folder to write (new or empty)")
@click.option("--hidden", default=128, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--intermediate", default=384, show_default=True)
@click.option("--max-positions", default=256, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--moe", is_flag=True, help="write a Qwen3-MoE model (sparse expert MLPs) instead of a dense Llama")
@click.option("--experts", default=4, show_default=True, help="--moe: experts per layer")
@click.option("--top-k", default=2, show_default=True, help="--moe: experts each token is routed to")
@click.option("--moe-family", "family", type=click.Choice(MOE_FAMILIES), default="qwen3_moe", show_default=True,
              help="--moe: the model family (its config and checkpoint layout)")
@click.option("--router-aux-loss-coef", default=0.0, show_default=True,
              help="--moe: weight of the load-balancing loss the trainer adds (0 = off)")
def main(out: Path, moe: bool, experts: int, top_k: int, family: str, router_aux_loss_coef: float, **kw) -> None:
    """Write a tiny character-level Llama (or MoE) checkpoint for CPU runs."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if moe and experts < 1:
        raise click.UsageError(f"--experts ({experts}) must be at least 1 with --moe")
    path = write_tiny_model(out, experts=experts if moe else 0, top_k=top_k, family=family,
                            router_aux_loss_coef=router_aux_loss_coef, **kw)
    n = json.loads((path / "baton-tiny.json").read_text())["parameters"]
    kind = f"{family}, {experts} experts top-{top_k}" if moe else "Llama"
    click.echo(f"wrote tiny {kind} ({n:,} parameters) to {path}")


if __name__ == "__main__":
    main()
