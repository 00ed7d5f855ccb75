"""The world stage at seconds scale (conf/world/tiny.yaml): real formats, B is A trained further, data_b is B's own
answers, held-out probes, A's draft vocab ordering differs from B's, determinism; and the world where B is a new
model (b_init=fresh) that writes in another style (b_style), with the defaults' world left as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import load_file

from stages import world
from stages.common.contract.artifacts import read_manifest
from stages.common.data.chat import load_tokenizer, read_conversations
from stages.common.contract.stage import CONF_DIR, compose_stage
from stages.common.drafter.vocab import VocabMap, build_vocab_map, compare_vocab_maps
from stages.vocab_map import count_assistant_tokens
from stages.world.corpus import in_style, tokens_reversed, word_cipher, words_reversed, words_substituted
from stages.world.toy import assistant_loss, fresh_decoder, generate_answers

FILES = ["tokenizer", "data_a.jsonl", "target_a", "target_b", "data_b.jsonl", "prompts_b.jsonl", "prompts_b_prose.jsonl",
         "prompts_b_code.jsonl", "manifest.json"]
DRAFT_VOCAB = 128  # the tiny source drafter's (conf/debug/tiny.yaml)
# world=tiny's digest (manifest "digest": its weights and data, stages/world/__init__.py::digest), per CPU vendor:
# the same on every x86 CPU of one vendor (tests/test_determinism.py), but an AMD EPYC builds another world than the
# Intel Xeons before it (seen 2026-12-06, same code, Python, torch and settings in effect; not yet traced to an op).
# It changes with the world's code or config, the corpus (this Python's stdlib docstrings) and the versions of
# torch/MKL, transformers and tokenizers. When it changes on purpose, paste the new one from `python -c "from stages
# import world; from stages.common.contract.stage import compose_stage; print(world.run(compose_stage('world',
# ['out=/tmp/tiny'], option='tiny')).out)"` (then /tmp/tiny/manifest.json), on each vendor's CPU.
TINY_WORLD_DIGESTS = {"GenuineIntel": "b8384172c576d16ccdcd2022fd8d28bd0874450527335e6385ef15193d345554",
                      "AuthenticAMD": "319498cd6ce62cdf8b411f230e45e45f0d3cc14760fa1f5de6ab228e19867d56"}


def cpu_vendor() -> str:
    """This machine's x86 vendor id (GenuineIntel, AuthenticAMD), from /proc/cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tiny_world_digest() -> str:
    vendor = cpu_vendor()
    assert vendor in TINY_WORLD_DIGESTS, f"no world=tiny digest pinned for {vendor} CPUs yet: build it and pin it"
    return TINY_WORLD_DIGESTS[vendor]


def build(out: Path, *extra: str):
    return world.run(compose_stage("world", [f"out={out}", *extra], option="tiny"))


def counted_map(built: Path, data: str) -> VocabMap:
    tokenizer = load_tokenizer(built / "tokenizer")
    tally = count_assistant_tokens(tokenizer, read_conversations(built / data), len(tokenizer), 256)
    return build_vocab_map(tally.counts, DRAFT_VOCAB)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with world.torch_threads(1):  # as the tiny world builds; two threads crawl on a busy 2-core machine
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("world") / "w").out


@pytest.fixture(scope="module")
def cfg(built):
    return read_manifest(built)["config"]


def rows(path: Path) -> list[list[dict]]:
    return list(read_conversations(path))


def test_every_output_exists_in_the_real_formats(built):
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in built.iterdir()) == sorted(FILES)
    for name in ("target_a", "target_b"):
        assert AutoModelForCausalLM.from_pretrained(built / name).config.model_type == "llama"
        assert load_tokenizer(built / name).chat_template
    assert load_tokenizer(built / "tokenizer").chat_template
    for name in ("data_a.jsonl", "data_b.jsonl"):
        assert all([m["role"] for m in chat] == ["user", "assistant"] for chat in rows(built / name))
    manifest = read_manifest(built)
    for key in ("target_a_eval_loss_a", "target_b_eval_loss_b", "target_b_greedy_top1", "seconds_total"):
        assert key in manifest["metrics"], key


def test_a_map_counted_on_data_a_orders_draft_positions_unlike_one_counted_on_data_b(built):
    """The cautionary tale in miniature: most ids are shared, almost no position points at the same token."""
    comparison = compare_vocab_maps(counted_map(built, "data_a.jsonl"), counted_map(built, "data_b.jsonl"))
    assert comparison.shared_ids > DRAFT_VOCAB // 4
    assert comparison.positions_agree < comparison.shared_ids // 4


def test_target_b_is_target_a_trained_further(built):
    config_a, config_b = (json.loads((built / name / "config.json").read_text()) for name in ("target_a", "target_b"))
    assert config_a == config_b
    weights_a, weights_b = (load_file(built / name / "model.safetensors") for name in ("target_a", "target_b"))
    assert weights_a.keys() == weights_b.keys()
    assert all(not torch.equal(weights_a[k], weights_b[k]) for k in weights_a if k.endswith("proj.weight"))


def test_data_b_holds_target_bs_own_answers(built, cfg):
    """Batch i of the regeneration is sampled with seed + i: re-running the last batch alone reproduces it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built / "target_b").eval()
    tokenizer = load_tokenizer(built / "target_b")
    chats = rows(built / "data_b.jsonl")
    assert len(chats) == cfg["regen_prompts"]
    last = (len(chats) - 1) // cfg["gen_batch_size"]
    batch = chats[last * cfg["gen_batch_size"]:]
    again = generate_answers(model, tokenizer, [chat[:1] for chat in batch], cfg["max_new_tokens"],
                             cfg["gen_batch_size"], cfg["regen_temperature"], seed=cfg["seed"] + last)
    assert again.texts == [chat[1]["content"] for chat in batch]


def test_greedy_answers_do_not_depend_on_the_batch(built, cfg):
    """Left padding changes nothing: each prompt alone gets the answer it got among the others."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built / "target_b").eval()
    tokenizer = load_tokenizer(built / "target_b")
    prompts = [chat[:1] for chat in rows(built / "prompts_b.jsonl")][:4]
    together = generate_answers(model, tokenizer, prompts, cfg["max_new_tokens"], batch_size=4)
    alone = [generate_answers(model, tokenizer, [p], cfg["max_new_tokens"], batch_size=1).texts[0] for p in prompts]
    assert together.texts == alone and len(set(map(len, prompts))) == 1


def test_probe_prompts_are_held_out_user_turns(built, cfg):
    probes = rows(built / "prompts_b.jsonl")
    assert len(probes) == cfg["probe_prompts"]
    assert all(m["role"] == "user" for chat in probes for m in chat)
    assert sum(len(chat) == 2 for chat in probes) == cfg["probe_multi_turn"]
    assert all(len(chat) in (1, 2) for chat in probes)
    trained_prompts = {chat[0]["content"] for chat in rows(built / "data_b.jsonl")}
    trained_prompts |= {chat[0]["content"] for chat in rows(built / "data_a.jsonl")}
    assert not trained_prompts & {m["content"] for chat in probes for m in chat}


def test_the_two_eval_sets_are_held_out_and_differ_in_kind(built, cfg):
    from stages.world.corpus import CODE_MARKS

    held_out = {m["content"] for path in ("data_a.jsonl", "data_b.jsonl") for chat in rows(built / path) for m in chat}
    sets = {name: rows(built / f"prompts_b_{name}.jsonl") for name in ("prose", "code")}
    assert len(sets["prose"]) == cfg["probe_prompts"] and 1 <= len(sets["code"]) <= cfg["probe_prompts"]
    questions = {name: {m["content"] for chat in chats for m in chat} for name, chats in sets.items()}
    assert not questions["prose"] & questions["code"] and not (questions["prose"] | questions["code"]) & held_out
    manifest = read_manifest(built)["metrics"]
    assert (manifest["eval_set_prose"], manifest["eval_set_code"]) == (len(sets["prose"]), len(sets["code"]))
    assert CODE_MARKS and all(chat[0]["role"] == "user" for chats in sets.values() for chat in chats)


def test_world_tiny_has_the_pinned_digest(built):
    manifest = read_manifest(built)
    assert manifest["cpu"]["in_effect"], manifest["cpu"]
    assert manifest["digest"] == world.digest(built) == tiny_world_digest()


def test_the_same_seed_builds_the_same_world(built, tmp_path):
    again = build(tmp_path / "again").out
    assert (again / "data_b.jsonl").read_bytes() == (built / "data_b.jsonl").read_bytes()
    assert (again / "prompts_b.jsonl").read_bytes() == (built / "prompts_b.jsonl").read_bytes()
    for name in ("target_a/model.safetensors", "target_b/model.safetensors"):
        first, second = load_file(built / name), load_file(again / name)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), name


# --- target B as a new model writing in another style (world.b_init=fresh, world.b_style) ----------------------------

def test_the_new_options_at_their_defaults_build_the_pinned_world(tmp_path):
    """Spelled out at their defaults, b_init and b_style consume no random number and change no computation."""
    assert read_manifest(build(tmp_path / "w", "b_init=a", "b_style=same").out)["digest"] == tiny_world_digest()


def test_a_fresh_decoder_keeps_only_the_token_embeddings_and_lm_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    rng = torch.get_rng_state()
    fresh, again = fresh_decoder(model, seed=3), fresh_decoder(model, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left as it was
    old, new, same = model.state_dict(), fresh.state_dict(), again.state_dict()
    kept = {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(old[name], new[name]) for name in kept)
    assert all(not torch.equal(old[name], new[name]) for name in old if name.endswith("proj.weight"))
    assert all(torch.equal(new[name], same[name]) for name in new)  # seeded
    unrelated = fresh_decoder(model, seed=3, keep_tokens=False).state_dict()  # b_init=new: nothing of A's kept
    assert all(not torch.equal(old[name], unrelated[name]) for name in old if name.endswith("weight") and
               "norm" not in name)
    assert all(torch.equal(new[name], unrelated[name]) for name in new if name not in kept)  # the same draw


def test_reversed_answers_keep_their_words_or_tokens_and_the_questions(built):
    text = "Return the sum.\n  >>> add(1, 2)\n  3 "
    assert words_reversed(text) == " 3\n  2) add(1, >>>\n  sum. the Return"
    assert words_reversed(words_reversed(text)) == text and sorted(words_reversed(text)) == sorted(text)
    tokenizer = load_tokenizer(built / "tokenizer")
    backwards, ids = tokens_reversed(text, tokenizer), tokenizer.encode(text, add_special_tokens=False)
    assert sorted(backwards) == sorted(text) and backwards.startswith(tokenizer.decode(ids[-1:]))
    chat = [{"role": "user", "content": "What does `x` do?"}, {"role": "assistant", "content": "It adds one."}]
    assert in_style(chat, "same") is chat
    assert in_style(chat, "words_reversed") == [chat[0], {"role": "assistant", "content": "one. adds It"}]
    assert in_style(chat, "tokens_reversed", tokenizer)[0] == chat[0]


def test_substituted_answers_swap_whole_words_one_for_one(built):
    tokenizer = load_tokenizer(built / "tokenizer")
    cipher = word_cipher(tokenizer)
    assert len(cipher) > 100 and sorted(cipher) == sorted(cipher.values())  # a permutation of the whole words
    assert sum(word != swapped for word, swapped in cipher.items()) > 0.9 * len(cipher)
    assert all(tokenizer.decode([word]).startswith(" ") for word in cipher)
    text = "Return the sum of the values."
    ids = tokenizer.encode(text, add_special_tokens=False)
    written = tokenizer.encode(words_substituted(text, tokenizer), add_special_tokens=False)
    assert written == [cipher.get(token, token) for token in ids] and written != ids  # re-encodes to the swap
    assert word_cipher(load_tokenizer(built / "tokenizer")) == cipher  # fixed: the same tokenizer, the same cipher


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("fresh") / "w", "b_init=fresh", "b_style=words_reversed", "steps_b=60").out


def decoder_cosines(root: Path) -> list[float]:
    """Per decoder projection, the cosine of target A's and target B's weights."""
    a, b = (load_file(root / name / "model.safetensors") for name in ("target_a", "target_b"))
    return [float(torch.nn.functional.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0))
            for k in a if k.endswith("proj.weight")]


def test_a_fresh_b_shares_no_decoder_weights_with_a(built, fresh):
    """b_init=a: B's decoder is A's moved a little; b_init=fresh: one of its own, unrelated to A's."""
    assert min(decoder_cosines(built)) > 0.8
    assert max(map(abs, decoder_cosines(fresh))) < 0.3
    assert "target_b_train_loss_a" in read_manifest(fresh)["metrics"]  # it learned domain A from its own init


def test_a_b_in_the_reversed_style_writes_domain_b_backwards(fresh):
    """Target B predicts domain B's answers better with their words reversed than as written; target A, trained on
    the docstrings as written, the other way round."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    cfg = OmegaConf.create(read_manifest(fresh)["config"])
    docs, tokenizer = world.split_docs(cfg).eval_b, load_tokenizer(fresh / "tokenizer")
    for name, better in (("target_b", "words_reversed"), ("target_a", "same")):
        model = AutoModelForCausalLM.from_pretrained(fresh / name).eval()
        loss = {style: assistant_loss(model, tokenizer, world.chats(docs, style), cfg.seq_len)
                for style in ("same", "words_reversed")}
        assert loss[better] == min(loss.values()) and loss["same"] != loss["words_reversed"], (name, loss)


def test_finetune_config_composes_inside_a_running_hydra_app():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        assert compose_stage("finetune", ["init=scratch"]).init.value == "scratch"
        assert GlobalHydra.instance().is_initialized()  # the running app's Hydra is back
