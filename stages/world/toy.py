"""Small real artifacts for the built-in example and the tests: a byte-level BPE tokenizer with a chat template,
a tiny Llama target saved with `save_pretrained`, and what the world stage trains and queries targets with (packed
chats, a step-counted training loop, held-out loss, batched generation).

Everything is built locally (no downloads) and written in the very formats real models use, so the stages
cannot tell a toy from the real thing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch


SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """A byte-level BPE of `vocab_size` ids (special tokens first), saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>",
                                   additional_special_tokens=SPECIAL_TOKENS[2:])
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def save_random(model_class, config, tokenizer, out_dir: str | Path, seed: int) -> Path:
    """A randomly initialised `model_class(config)`, saved with its tokenizer beside it."""
    torch.manual_seed(seed)
    out = Path(out_dir)
    model_class(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_llama(tokenizer_dir: str | Path, out_dir: str | Path, hidden_size: int = 64, num_layers: int = 4,
               num_heads: int = 4, intermediate_size: int | None = None, tie_word_embeddings: bool = False,
               seed: int = 0) -> Path:
    """A randomly initialised Llama target over the tokenizer's vocab, saved with its tokenizer beside it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=1024,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return save_random(LlamaForCausalLM, config, tokenizer, out_dir, seed)


def tiny_deepseek_v3(tokenizer_dir: str | Path, out_dir: str | Path, hidden_size: int = 64, num_layers: int = 4,
                     num_heads: int = 2, seed: int = 0, vocab_size: int | None = None) -> Path:
    """A randomly initialised DeepSeek-V3 target (MLA attention, one dense layer then MoE layers, as Kimi-K2's) over
    the tokenizer's vocab. The MLA latent and rope widths are DeepSeek's (512 + 64: vLLM's CPU MLA kernel takes head
    size 576 only); `noaux_tc` routing, since vLLM builds the router bias transformers saves only for it.
    `vocab_size` above the tokenizer's leaves rows for special tokens another tokenizer adds (Kimi's media ones)."""
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    head = hidden_size // num_heads
    config = DeepseekV3Config(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
        q_lora_rank=hidden_size, kv_lora_rank=512, qk_nope_head_dim=head, qk_rope_head_dim=64, v_head_dim=head,
        max_position_embeddings=1024, rope_scaling=None, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return save_random(DeepseekV3ForCausalLM, config, tokenizer, out_dir, seed)


def train_causal_lm(model_dir: str | Path, data: str | Path, out_dir: str | Path, steps: int, lr: float = 3e-3,
                    batch_size: int = 16, max_length: int = 128, seed: int = 0) -> Path:
    """Train a (tiny) causal LM on a chat JSONL with plain next-token loss and save it with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.data.chat import tokenized_chats

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    rows = tokenized_chats(tokenizer, Path(data), max_length)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        pick = torch.randint(0, rows["input_ids"].shape[0], (batch_size,), generator=generator)
        input_ids, attention = rows["input_ids"][pick], rows["attention_mask"][pick]
        labels = input_ids.masked_fill(~attention, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = Path(out_dir)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------- trained targets (the world stage)


def pack_chats(tokenizer, conversations: list[list[dict]], seq_len: int) -> dict[str, torch.Tensor]:
    """Whole chats packed into rows of `seq_len` tokens (best fit, longest first; a longer chat is truncated).

    `labels` hold the assistant tokens (the chat template's assistant spans, end-of-turn marker included) and -100
    elsewhere, so the loss is the chat model's: predict the answers, read the questions. A chat sees the ones packed
    before it (no block mask, as in pretraining). Padding sits at the end of a row, where a causal model never
    attends to it from a real token.
    """
    import bisect

    from stages.common.data.chat import batched, encode_chats

    chats = [pair for batch in batched(iter(conversations), 256) for pair in encode_chats(tokenizer, batch, seq_len)]
    order = sorted(range(len(chats)), key=lambda i: (-len(chats[i][0]), i))
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is the first with room >= length
    rows: list[list[int]] = []
    for index in order:
        length = len(chats[index][0])
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if room - length > 0:
            bisect.insort(free, (room - length, row))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.int64)
    for row, members in enumerate(rows):
        ids = torch.from_numpy(np.concatenate([chats[i][0] for i in members]))
        mask = torch.from_numpy(np.concatenate([chats[i][1] for i in members]))
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = ids.masked_fill(~mask, -100)
    return {"input_ids": input_ids, "labels": labels}


def fit_causal_lm(model, rows: dict[str, torch.Tensor], steps: int, lr: float, batch_size: int, seed: int,
                  warmup: float = 0.05, desc: str = "train") -> list[float]:
    """AdamW on random batches of packed rows for exactly `steps` steps (linear warmup, cosine decay to lr/10,
    grad clip 1.0); the loss of every step comes back. Deterministic for a seed."""
    import math

    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, int(warmup * steps))

    def scale(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, mininterval=1.0)
    for _ in bar:
        pick = torch.randint(0, rows["input_ids"].shape[0], (batch_size,), generator=generator)
        loss = assistant_token_loss(model, rows["input_ids"][pick], rows["labels"][pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def assistant_token_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss (mean over labelled tokens), with the lm_head run only where a label is: a third of a
    tiny model's compute is its lm_head, and only about 70% of the packed tokens carry a label."""
    import torch.nn.functional as F

    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(model.get_output_embeddings()(hidden[keep]), targets[keep])


@torch.no_grad()
def assistant_loss(model, tokenizer, conversations: list[list[dict]], max_length: int, batch_size: int = 32) -> float:
    """Mean next-token loss on the assistant tokens of held-out chats, each chat in its own row (right padding,
    which a causal model never attends to from a real token)."""
    import torch.nn.functional as F

    from stages.common.data.chat import batched, encode_chats

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total, count = 0.0, 0
    for batch in batched(iter(conversations), batch_size):
        encoded = encode_chats(tokenizer, batch, max_length)
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(encoded), width), dtype=torch.bool)
        for row, (ids, assistant) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.from_numpy(ids)
            mask[row, : len(ids)] = torch.from_numpy(assistant)
        logits = model(input_ids=input_ids).logits[:, :-1]
        keep = mask[:, 1:]
        total += float(F.cross_entropy(logits[keep], input_ids[:, 1:][keep], reduction="sum"))
        count += int(keep.sum())
    return total / max(count, 1)


@dataclass
class Answers:
    texts: list[str]  # each answer decoded, end-of-turn marker dropped
    finished: list[bool]  # False where max_new_tokens cut the answer before the end-of-turn marker
    top1_sum: float  # sum over generated tokens (end marker included) of the most likely token's probability
    tokens: int
    distinct_ids: int  # distinct token ids among the answers

    @property
    def mean_top1(self) -> float:
        """On a greedy path: the mean probability of each chosen token."""
        return self.top1_sum / max(self.tokens, 1)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 64,
                     temperature: float = 0.0, seed: int = 0, desc: str = "generate") -> Answers:
    """The model's own answers to chat prompts, as EAGLE-3 data is regenerated: batched with left padding, stopped
    at `<|end|>`; greedy at temperature 0, else sampled from softmax(logits / temperature). Deterministic: fixed
    batches in the given order, batch i sampled from a generator seeded with seed + i (the global RNG is left as
    it was), so re-running one batch reproduces its answers."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    from stages.common.data.chat import batched

    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    config = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, eos_token_id=end_id, pad_token_id=pad_id,
                              bos_token_id=None, output_logits=True, return_dict_in_generate=True)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out, seen = Answers([], [], 0.0, 0, 0), set()
    try:
        batches = list(batched(iter(prompts), batch_size))
        for index, batch in enumerate(tqdm(batches, desc=desc, unit="batch", mininterval=1.0)):
            texts = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                     for messages in batch]
            encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + index)
                result = model.generate(**encoded, generation_config=config)
            new = result.sequences[:, encoded["input_ids"].shape[1]:]
            top1 = torch.stack(result.logits, dim=1).float().softmax(-1).amax(-1)  # [B, T_new]
            for row in range(new.shape[0]):
                ends = torch.nonzero(new[row] == end_id).flatten()
                length = int(ends[0]) + 1 if ends.numel() else new.shape[1]
                out.texts.append(tokenizer.decode(new[row, :length], skip_special_tokens=True))
                out.finished.append(bool(ends.numel()))
                out.top1_sum += float(top1[row, :length].sum())
                out.tokens += length
                seen.update(new[row, :length].tolist())
    finally:
        tokenizer.padding_side = side
    out.distinct_ids = len(seen)
    return out


def fresh_decoder(model, seed: int, keep_tokens: bool = True):
    """A model of `model`'s config and class with its token embeddings and lm_head (copied; with `keep_tokens`)
    and every other weight (decoder layers, final norm) from a random init seeded by `seed`; the global RNG is
    left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(model)(model.config)
    if not keep_tokens:
        return fresh.eval()
    with torch.no_grad():
        fresh.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight)
        fresh.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight)
    return fresh.eval()


def rotate_residual_stream(model, dose: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Rotate a Llama's residual stream by an orthogonal Q without changing its function (SliceGPT, QuaRot): each
    RMSNorm's weight is folded into the linear layers that read it (a unit-weight RMSNorm commutes with rotations),
    then readers take W Q and writers Q^T W. Every hidden state becomes h Q, the logits stay the same (to rounding).
    `dose` in [0, 1] scales the rotation's angles (Q = exp(dose x S) for a random skew-symmetric S): a drift knob
    for a drafter trained on the unrotated states. Returns Q."""
    if model.config.tie_word_embeddings:
        raise ValueError("a tied lm_head would rotate twice; untie it first")
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    skew = torch.randn(hidden, hidden, generator=generator, dtype=torch.float64)
    q = torch.linalg.matrix_exp(dose * torch.pi * (skew - skew.T) / (2 * hidden ** 0.5))
    q, _ = torch.linalg.qr(q)  # orthogonal to float64 rounding
    base = model.model

    def fold(norm, readers) -> None:
        for linear in readers:
            linear.weight.mul_(norm.weight.to(linear.weight.dtype)[None, :])
        norm.weight.fill_(1.0)

    def read(linear) -> None:  # y = x W^T; x -> x Q
        linear.weight.copy_((linear.weight.double() @ q).to(linear.weight.dtype))

    def write(linear) -> None:  # adds y to the stream; y -> y Q
        linear.weight.copy_((q.T @ linear.weight.double()).to(linear.weight.dtype))

    with torch.no_grad():
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fold(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj))
            fold(layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                read(linear)
            write(attn.o_proj)
            write(mlp.down_proj)
        fold(base.norm, (model.lm_head,))
        read(model.lm_head)
        embed = base.embed_tokens.weight
        embed.copy_((embed.double() @ q).to(embed.dtype))
    return q
