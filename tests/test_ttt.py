"""Training-time test: the unrolled drafter sees what inference shows it, losses and metrics count what they say."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.common.drafter_config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, drafter_config_for
from stages.common.eagle3 import Eagle3Drafter, KVCache, TTTCache
from stages.common.target import TargetModel
from stages.common.ttt import shift_left, ttt_forward, ttt_metrics
from stages.common.vocab import VocabMap


@pytest.fixture(scope="module")
def target(target_dir) -> TargetModel:
    return TargetModel.load(target_dir, [0, 1, 2], OUTPUT_OF_LAYER)


@pytest.fixture(scope="module")
def drafter(target_dir, vocab_size) -> Eagle3Drafter:
    vocab_map = VocabMap.from_target_ids(torch.arange(0, vocab_size, 2), vocab_size)  # every other id
    torch.manual_seed(0)
    return Eagle3Drafter.initialised(drafter_config_for(target_dir, vocab_map.draft_vocab_size), vocab_map)


def test_hooks_capture_the_aux_layers_in_either_convention(target_dir, target):
    input_ids = torch.randint(0, 200, (2, 9))
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    hidden_states = model(input_ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, ...]
    expected = torch.cat([hidden_states[i + 1] for i in (0, 1, 2)], dim=-1)
    assert torch.allclose(target.features(input_ids).aux_hidden, expected, atol=1e-5)
    same_layers = TargetModel.load(target_dir, [1, 2, 3], INPUT_OF_LAYER)
    assert torch.allclose(same_layers.features(input_ids).aux_hidden, expected, atol=1e-5)


def test_unrolled_steps_equal_incremental_drafting(target, drafter):
    """Step k at position t must be exactly draft k of a chain started at t with a KV cache, as at inference."""
    torch.manual_seed(1)
    input_ids = torch.randint(0, 200, (1, 10))
    features = target.features(input_ids)
    positions = torch.arange(10)[None]
    hidden0 = drafter.project_aux(features.aux_hidden)
    cache, outs, hidden = TTTCache(), [], hidden0
    for k in range(3):
        out = drafter(target.embed(shift_left(input_ids, 1 + k)), hidden, positions + k, cache=cache)
        outs.append(out)
        hidden = out.hidden
    for t in (0, 3, 6):
        kv = KVCache()
        step0 = drafter(target.embed(input_ids[:, 1:t + 2]), hidden0[:, :t + 1], positions[:, :t + 1], cache=kv)
        assert torch.allclose(step0.logits[:, t], outs[0].logits[:, t], atol=1e-5)
        hidden_t = step0.hidden[:, t:t + 1]
        for k in (1, 2):
            draft = drafter(target.embed(input_ids[:, t + 1 + k:t + 2 + k]), hidden_t, torch.tensor([[t + k]]),
                            cache=kv)
            assert torch.allclose(draft.logits[:, 0], outs[k].logits[:, t], atol=1e-5), (t, k)
            hidden_t = draft.hidden


def synthetic_batch(vocab_size: int, T: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (2, T), generator=generator)
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[:, 4:] = True
    return input_ids, loss_mask, torch.randn(2, T, 96, generator=generator), torch.randn(2, T, vocab_size,
                                                                                          generator=generator)


def test_one_step_loss_and_accuracy_by_hand(target, drafter, vocab_size):
    input_ids, loss_mask, aux, logits = synthetic_batch(vocab_size)
    stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, logits, ttt_steps=1)
    draft_ids = torch.arange(0, vocab_size, 2)
    out = drafter(target.embed(shift_left(input_ids, 1)), drafter.project_aux(aux))
    labels = shift_left(logits, 1)
    target_p = torch.softmax(labels[..., draft_ids], -1)
    in_vocab = labels.argmax(-1) % 2 == 0
    assistant = shift_left(loss_mask, 2)
    mask = (assistant & in_vocab).float()
    expected = -(mask * (target_p * torch.log_softmax(out.logits, -1)).sum(-1)).mean()
    assert torch.allclose(stats.loss, expected, atol=1e-6)
    right = (out.logits.argmax(-1) == target_p.argmax(-1)) & assistant & in_vocab
    assert stats.correct.tolist() == [int(right.sum())] and stats.valid.tolist() == [int(assistant.sum())]
    assert 0 < int(mask.sum()) < int(assistant.sum())  # some argmaxes fall outside the draft vocab


def test_out_of_vocab_targets_carry_no_loss(target, drafter, vocab_size):
    input_ids, loss_mask, aux, logits = synthetic_batch(vocab_size)
    logits[..., 1] = 100.0  # every argmax is id 1, which the draft vocab (even ids) lacks
    stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, logits, ttt_steps=3)
    assert float(stats.loss.detach()) == 0.0 and stats.correct.sum() == 0
    assert stats.valid.tolist() == [int(shift_left(loss_mask, 2 + k).sum()) for k in range(3)]


def test_decay_weights_the_steps(target, drafter, vocab_size):
    stats = ttt_forward(drafter, target.embed, *synthetic_batch(vocab_size), ttt_steps=4)
    weights = torch.tensor([0.8 ** k for k in range(4)])
    assert torch.allclose(stats.loss.detach(), (weights * stats.step_losses).sum(), atol=1e-6)
    assert stats.step_losses.shape == (4,) and bool((stats.cond_valid <= stats.valid).all())


def test_metrics_from_counts():
    metrics = ttt_metrics(torch.tensor([2.0, 3.0, 4.0]), correct=torch.tensor([8, 6, 3]),
                          valid=torch.tensor([10, 10, 10]), cond_correct=torch.tensor([8, 4, 2]),
                          cond_valid=torch.tensor([10, 8, 4]))
    assert metrics["full_acc_1"] == pytest.approx(0.6) and metrics["cond_acc_1"] == pytest.approx(0.5)
    assert metrics["sim_accept_len"] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5)
    assert metrics["loss_2"] == 4.0
    assert metrics["loss"] == pytest.approx(2.0 + 0.8 * 3.0 + 0.64 * 4.0)


def test_training_lowers_loss_and_raises_accuracy(target, target_dir, vocab_size):
    """A learnable world: each next token is the current one plus one, and the target is sure of it."""
    torch.manual_seed(0)
    vocab_map = VocabMap.from_target_ids(torch.arange(vocab_size), vocab_size)
    drafter = Eagle3Drafter.initialised(drafter_config_for(target_dir, vocab_size), vocab_map)
    input_ids = (torch.arange(24)[None] + torch.tensor([[0], [40], [80], [120]])) % 200
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    aux = target.features(input_ids).aux_hidden
    sure_logits = 10.0 * torch.nn.functional.one_hot(shift_left(input_ids, 1), vocab_size).float()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    history = []
    for _ in range(50):
        stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, sure_logits, 3)
        optimizer.zero_grad()
        stats.loss.backward()
        optimizer.step()
        history.append(stats.metrics())
    first, last = history[0], history[-1]
    assert last["loss_0"] < 0.5 * first["loss_0"] and last["loss_2"] < 0.5 * first["loss_2"]
    assert first["full_acc_0"] < 0.1 and last["full_acc_0"] > 0.9
    assert last["sim_accept_len"] > 3.0 > 1.5 > first["sim_accept_len"]
