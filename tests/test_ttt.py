"""Training-time test: the unrolled drafter sees what inference shows it, losses and metrics count what they say."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.common.drafter.config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, drafter_config_for
from stages.common.drafter.eagle3 import Eagle3Drafter, KVCache, TTTCache
from stages.common.drafter.target import TargetHead, TargetModel, TargetSignals
from stages.common.drafter.ttt import LossMask, draft_vocab_ids, loss_gates, shift_left, ttt_forward, ttt_metrics
from stages.common.drafter.vocab import VocabMap


@pytest.fixture(scope="module")
def target(target_dir) -> TargetModel:
    return TargetModel.load(target_dir, [0, 1, 2], OUTPUT_OF_LAYER)


@pytest.fixture(scope="module")
def drafter(target_dir, vocab_size) -> Eagle3Drafter:
    vocab_map = VocabMap.from_target_ids(torch.arange(0, vocab_size, 2), vocab_size)  # every other id
    torch.manual_seed(0)
    return Eagle3Drafter.initialised(drafter_config_for(target_dir, vocab_map.draft_vocab_size), vocab_map)


@pytest.fixture(scope="module")
def full_drafter(target_dir, vocab_size) -> Eagle3Drafter:
    """A draft vocab of every target id: every target argmax is in it."""
    vocab_map = VocabMap.from_target_ids(torch.arange(vocab_size), vocab_size)
    return Eagle3Drafter.initialised(drafter_config_for(target_dir, vocab_size), vocab_map, seed=3)


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


def signals(logits: torch.Tensor, drafter: Eagle3Drafter) -> TargetSignals:
    return TargetSignals.from_logits(logits, draft_vocab_ids(drafter))


def test_one_step_loss_and_accuracy_by_hand(target, drafter, vocab_size):
    input_ids, loss_mask, aux, logits = synthetic_batch(vocab_size)
    stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, signals(logits, drafter), ttt_steps=1)
    draft_ids = torch.arange(0, vocab_size, 2)
    out = drafter(target.embed(shift_left(input_ids, 1)), drafter.project_aux(aux))
    labels = shift_left(logits, 1)
    target_p = torch.softmax(labels[..., draft_ids], -1)
    in_vocab = labels.argmax(-1) % 2 == 0
    drafted = shift_left(loss_mask, 1) & shift_left(loss_mask, 2)  # tokens t+1 and t+2 both the assistant's
    mask = (drafted & in_vocab).float()
    expected = -(mask * (target_p * torch.log_softmax(out.logits, -1)).sum(-1)).mean()
    assert torch.allclose(stats.loss, expected, atol=1e-6)
    right = (out.logits.argmax(-1) == target_p.argmax(-1)) & drafted & in_vocab
    assert stats.correct.tolist() == [int(right.sum())] and stats.valid.tolist() == [int(drafted.sum())] == [14]
    assert 0 < int(mask.sum()) < int(drafted.sum())  # some argmaxes fall outside the draft vocab


def test_out_of_vocab_targets_carry_no_loss(target, drafter, vocab_size):
    input_ids, loss_mask, aux, logits = synthetic_batch(vocab_size)
    logits[..., 1] = 100.0  # every argmax is id 1, which the draft vocab (even ids) lacks
    stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, signals(logits, drafter), ttt_steps=3)
    assert float(stats.loss.detach()) == 0.0 and stats.correct.sum() == 0
    assert stats.valid.tolist() == [14, 12, 10]  # per row: t = 3..9-k (tokens 4..11 are the assistant's)


def test_decay_weights_the_steps(target, drafter, vocab_size):
    input_ids, loss_mask, aux, logits = synthetic_batch(vocab_size)
    stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, signals(logits, drafter), ttt_steps=4)
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


# ---------------------------------------------------------------- the loss mask, worked by hand

# Two rows of T = 12. Row 0, a multi-turn chat: user 0-1, assistant 2-4 (4 is its end-of-turn marker), user 5-6,
# assistant 7-9, padding 10-11. Row 1 is cut off inside an answer: user 0-2, assistant 3-11.
HAND_MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
                          [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
# Per rule, per step k, per row: the positions t whose prediction of token p = t+2+k counts (t <= 10-k: the target's
# logits at t+1+k exist; at t = 10-k they predict the token after the row).
HAND_GATES = {
    # m[t+1..p] all set. Row 0 predicts tokens 3, 4, 8, 9 at k=0 (never 2 or 7, the first of a turn: the target
    # emits those) and 4, 9 (the end-of-turn markers) at k=1; at k=2 every chain of 4 tokens crosses a turn.
    # Row 1: the token after the row (p = 12) is outside the mask.
    LossMask.drafted: [[{1, 2, 6, 7}, {1, 6}, set()],
                       [set(range(2, 10)), set(range(2, 9)), set(range(2, 8))]],
    # m[p-2] = m[t+k]: in row 0 the predicted tokens are 4, 5, 6, 9, 10, 11 at every step: the first tokens of the
    # user's turn and the padding after the answer, never the answer's second token.
    LossMask.specforge: [[{2, 3, 4, 7, 8, 9}, {1, 2, 3, 6, 7, 8}, {0, 1, 2, 5, 6, 7}],
                         [set(range(3, 11)), set(range(2, 10)), set(range(1, 9))]],
    # m[p-1] = m[t+1+k]: row 0 predicts tokens 3, 4, 5, 8, 9, 10 (the one after each end-of-turn marker too);
    # at k=2 token p=3 would need t=-1.
    LossMask.speculators: [[{1, 2, 3, 6, 7, 8}, {0, 1, 2, 5, 6, 7}, {0, 1, 4, 5, 6}],
                           [set(range(2, 11)), set(range(1, 10)), set(range(0, 9))]],
}


@pytest.mark.parametrize("rule", list(LossMask))
def test_loss_mask_gates_by_hand(target, full_drafter, rule):
    """Exactly the hand-written (t, k) carry loss and count, under each rule."""
    T, steps = HAND_MASK.shape[1], 3
    gates = loss_gates(HAND_MASK, rule, steps)
    expected = []
    for k in range(steps):
        gate = torch.zeros(2, T - 1 - k, dtype=torch.bool)
        for row in (0, 1):
            gate[row, sorted(HAND_GATES[rule][row][k])] = True
        expected.append(gate)
        assert torch.equal(gates[k], gate), (rule, k)
    # Through ttt_forward: with every target argmax in the draft vocab, `valid` counts the gate and the loss is
    # the soft cross-entropy on exactly those positions.
    generator = torch.Generator().manual_seed(4)
    vocab = full_drafter.config.vocab_size
    input_ids, aux = torch.randint(0, vocab, (2, T), generator=generator), torch.randn(2, T, 96, generator=generator)
    logits = torch.randn(2, T, vocab, generator=generator)
    stats = ttt_forward(full_drafter, target.embed, input_ids, HAND_MASK, aux, signals(logits, full_drafter), steps,
                        rule)
    assert stats.valid.tolist() == [sum(len(HAND_GATES[rule][row][k]) for row in (0, 1)) for k in range(steps)]
    hidden, cache = full_drafter.project_aux(aux), TTTCache()
    for k in range(steps):
        out = full_drafter(target.embed(shift_left(input_ids, 1 + k)), hidden, torch.arange(T)[None] + k, cache=cache)
        hidden, L = out.hidden, T - 1 - k
        plogp = (torch.softmax(logits[:, 1 + k:], -1) * torch.log_softmax(out.logits[:, :L], -1)).sum(-1)
        assert torch.allclose(stats.step_losses[k], -(expected[k] * plogp).sum() / (2 * T), atol=1e-6), (rule, k)


# ---------------------------------------------------------------- the references, restated


def specforge_reference(drafter, embed, input_ids, loss_mask, aux, logits, length):
    """SpecForge 0.2.0's OnlineEagle3Model loop (specforge/core/eagle3.py), restated on regraft's drafter module:
    input ids and target logits padded one left before the loop, the loss mask not; after every step all three
    move one more left (`padding(x, left=False)`: drop the first column, a zero column at the end). The drafter's
    forward (its attention across steps, position ids) is regraft's, checked against incremental drafting above."""
    def padding(x):
        return torch.cat((x[:, 1:], torch.zeros_like(x[:, -1:])), dim=1)

    t2d = drafter.t2d
    target, input_ids, loss_mask = padding(logits), padding(input_ids), loss_mask[..., None].int()
    hidden, cache, positions = drafter.project_aux(aux), TTTCache(), torch.arange(input_ids.shape[1])[None]
    losses, numerators, denominators = [], [], []
    for idx in range(length):
        out = drafter(embed(input_ids), hidden, positions + idx, cache=cache)
        with torch.no_grad():
            target_mask = t2d[target.argmax(-1)][..., None].int()
            position_mask = target_mask * loss_mask
            target_p = torch.softmax(target[..., t2d].float(), dim=2)
        hidden = out.hidden
        draft_logits = out.logits.float()
        loss = -torch.sum(position_mask * (target_p * torch.log_softmax(draft_logits, dim=2)), 2).mean()
        losses.append(loss)
        numerators.append(int(((draft_logits.argmax(-1) == target_p.argmax(-1)) * position_mask.squeeze(-1)).sum()))
        denominators.append(int(loss_mask.sum()))  # acc = numerator / (loss_mask.sum() + 1e-6)
        input_ids, target, loss_mask = padding(input_ids), padding(target), padding(loss_mask)
    return losses, numerators, denominators


def speculators_reference(drafter, embed, input_ids, loss_mask, aux, logits, ttt_steps):
    """speculators' alignment, restated: `shift_batch` (models/eagle3/data.py) drops the first token, the last aux
    state, the first target state and the first mask bit (aligning x1, g0, y1, l1); step k's inputs are the true
    tokens k further on (use_off_policy_tokens); `align_for_step` (metrics.py) pairs logits[:, :-k] with
    targets[:, k:] and loss_mask[:, k:]. The loss is regraft's soft cross-entropy over B*T (speculators takes a KL
    divergence, which differs by the target's entropy), the accuracy the plain masked one; every target argmax is
    in the draft vocab here (speculators has no such check)."""
    B, T = input_ids.shape
    input_ids, aux, verifier, loss_mask = input_ids[:, 1:], aux[:, :-1], logits[:, 1:], loss_mask[:, 1:].bool()
    n = T - 1
    targets = torch.softmax(verifier[..., drafter.t2d].float(), dim=-1)
    hidden, cache, positions = drafter.project_aux(aux), TTTCache(), torch.arange(n)[None]
    losses, correct, total = [], [], []
    for k in range(ttt_steps):
        step_ids = torch.cat((input_ids[:, k:], input_ids.new_zeros(B, k)), dim=1)
        out = drafter(embed(step_ids), hidden, positions + k, cache=cache)
        hidden = out.hidden
        s_logits = out.logits[:, :-k] if k > 0 else out.logits
        s_targets, s_mask = targets[:, k:], loss_mask[:, k:]
        plogp = (s_targets * torch.log_softmax(s_logits.float(), dim=-1)).sum(-1)
        losses.append(-(s_mask * plogp).sum() / (B * T))
        correct.append(int(((s_logits.argmax(-1) == s_targets.argmax(-1)) & s_mask).sum()))
        total.append(int(s_mask.sum()))
    return losses, correct, total


def agreeing(drafter, embed, input_ids, aux, logits, steps):
    """The logits with the target's argmax at position j moved onto the drafter's own step-k prediction for it
    (k = j mod steps), so every step has right predictions to count (and chains right at every step)."""
    T = input_ids.shape[1]
    hidden, cache, predictions = drafter.project_aux(aux), TTTCache(), []
    with torch.no_grad():
        for k in range(steps):
            out = drafter(embed(shift_left(input_ids, 1 + k)), hidden, torch.arange(T)[None] + k, cache=cache)
            predictions.append(drafter.draft_to_target(out.logits.argmax(-1)))
            hidden = out.hidden
    logits = logits.clone()
    for j in range(1, T):
        k = j % steps
        if j - 1 - k >= 0:
            for row in range(input_ids.shape[0]):
                logits[row, j, predictions[k][row, j - 1 - k]] += 10.0
    return logits


# Multi-turn rows of T = 16 (the last column outside the mask: see test_specforge_rule_equals_specforge_loop).
REFERENCE_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0],
                               [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)


def test_specforge_rule_equals_specforge_loop(target, drafter, vocab_size):
    """loss_mask=specforge reproduces SpecForge's per-step losses, accuracy counts and gradients. (Where the last
    column of the mask is set, SpecForge also trains position T-1-k on its zero padding, a uniform target; regraft
    does not, so this batch leaves that column out.)"""
    input_ids, _, aux, logits = synthetic_batch(vocab_size, T=16, seed=5)
    steps = 4
    logits = agreeing(drafter, target.embed, input_ids, aux, logits, steps)
    stats = ttt_forward(drafter, target.embed, input_ids, REFERENCE_MASK, aux, signals(logits, drafter), steps,
                        LossMask.specforge)
    losses, numerators, denominators = specforge_reference(drafter, target.embed, input_ids, REFERENCE_MASK, aux,
                                                           logits, steps)
    assert torch.allclose(stats.step_losses, torch.stack(losses).detach(), atol=1e-6)
    assert stats.correct.tolist() == numerators and stats.valid.tolist() == denominators
    assert min(numerators) > 0 and min(denominators) > 0 and stats.cond_correct[-1] > 0
    reference_total = sum(0.8 ** k * loss for k, loss in enumerate(losses))
    params = list(drafter.parameters())
    ours, theirs = torch.autograd.grad(stats.loss, params), torch.autograd.grad(reference_total, params)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    drafted = ttt_forward(drafter, target.embed, input_ids, REFERENCE_MASK, aux, signals(logits, drafter), steps)
    assert not torch.allclose(drafted.step_losses, stats.step_losses)  # the default is another rule


def test_speculators_rule_equals_speculators_alignment(target, full_drafter):
    vocab = full_drafter.config.vocab_size
    input_ids, _, aux, logits = synthetic_batch(vocab, T=16, seed=6)
    steps = 4
    logits = agreeing(full_drafter, target.embed, input_ids, aux, logits, steps)
    stats = ttt_forward(full_drafter, target.embed, input_ids, REFERENCE_MASK, aux, signals(logits, full_drafter),
                        steps, LossMask.speculators)
    losses, correct, total = speculators_reference(full_drafter, target.embed, input_ids, REFERENCE_MASK, aux,
                                                   logits, steps)
    assert torch.allclose(stats.step_losses, torch.stack(losses).detach(), atol=1e-6)
    assert stats.correct.tolist() == correct and stats.valid.tolist() == total
    assert min(correct) > 0 and stats.cond_correct[-1] > 0
    reference_total = sum(0.8 ** k * loss for k, loss in enumerate(losses))
    params = list(full_drafter.parameters())
    ours, theirs = torch.autograd.grad(stats.loss, params), torch.autograd.grad(reference_total, params)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- the target's signals


def test_target_signals_from_hidden_equal_the_full_logits(target, target_dir, drafter):
    """The chunked lm_head (running argmax, draft columns copied out) gives the full logits' numbers, offline and
    online, and never returns full logits from batch_features."""
    generator = torch.Generator().manual_seed(2)
    hidden, weight, bias = (torch.randn(2, 37, 32, generator=generator), torch.randn(1000, 32, generator=generator),
                            torch.randn(1000, generator=generator))
    ids = torch.randperm(1000, generator=generator)[:300]  # any order
    for b in (None, bias):
        full = torch.nn.functional.linear(hidden, weight, b)
        chunked = TargetSignals.from_hidden(hidden, weight, ids, b, chunk_elements=1)  # 256 ids a chunk: 4 chunks
        assert torch.equal(chunked.argmax, full.argmax(-1))
        assert torch.allclose(chunked.draft_logits, full[..., ids], atol=1e-5)
    input_ids = torch.randint(0, 200, (2, 9), generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    draft_ids = draft_vocab_ids(drafter)
    reference = target.features(input_ids, batch["attention_mask"])
    online = target.batch_features(batch, draft_ids=draft_ids)  # the decoder body, then the lm_head in chunks
    assert online.logits is None and torch.equal(online.signals.argmax, reference.logits.argmax(-1))
    assert torch.allclose(online.signals.draft_logits, reference.logits[..., draft_ids], atol=1e-5)
    assert torch.allclose(online.aux_hidden, reference.aux_hidden) and torch.allclose(online.last_hidden,
                                                                                      reference.last_hidden)
    cached = {"aux_hidden": online.aux_hidden, "last_hidden": online.last_hidden}
    offline = TargetHead(target_dir).batch_features(cached, draft_ids=draft_ids)
    assert offline.logits is None and torch.equal(offline.signals.argmax, reference.logits.argmax(-1))
    assert torch.allclose(offline.signals.draft_logits, reference.logits[..., draft_ids], atol=1e-5)


def test_training_lowers_loss_and_raises_accuracy(target, target_dir, vocab_size):
    """A learnable world: each next token is the current one plus one, and the target is sure of it."""
    torch.manual_seed(0)
    vocab_map = VocabMap.from_target_ids(torch.arange(vocab_size), vocab_size)
    drafter = Eagle3Drafter.initialised(drafter_config_for(target_dir, vocab_size), vocab_map)
    input_ids = (torch.arange(24)[None] + torch.tensor([[0], [40], [80], [120]])) % 200
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    aux = target.features(input_ids).aux_hidden
    sure = signals(10.0 * torch.nn.functional.one_hot(shift_left(input_ids, 1), vocab_size).float(), drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    history = []
    for _ in range(50):
        stats = ttt_forward(drafter, target.embed, input_ids, loss_mask, aux, sure, 3)
        optimizer.zero_grad()
        stats.loss.backward()
        optimizer.step()
        history.append(stats.metrics())
    first, last = history[0], history[-1]
    assert last["loss_0"] < 0.5 * first["loss_0"] and last["loss_2"] < 0.5 * first["loss_2"]
    assert first["full_acc_0"] < 0.1 and last["full_acc_0"] > 0.9
    assert last["sim_accept_len"] > 3.0 > 1.5 > first["sim_accept_len"]


@pytest.mark.parametrize("heads, kv_heads, dim, value_dim", [(4, 4, 16, 16), (4, 2, 16, 16), (4, 4, 24, 16)])
def test_fused_ttt_attention_equals_the_explicit_one(heads, kv_heads, dim, value_dim):
    """The form a GPU runs (one SDPA call under `ttt_mask`) against the one the CPU runs (scores built out), values
    and gradients over 4 unrolled steps: plain heads, grouped-query heads, and MLA's shape (values narrower)."""
    from stages.common.drafter.eagle3 import explicit_ttt_attention, fused_ttt_attention

    generator = torch.Generator().manual_seed(0)

    def tensors(count_heads: int, width: int) -> list[torch.Tensor]:
        return [torch.randn(2, count_heads, 10, width, generator=generator, requires_grad=True) for _ in range(4)]

    queries, keys, values = tensors(heads, dim), tensors(kv_heads, dim), tensors(kv_heads, value_dim)
    results = {}
    for name, attention in (("explicit", explicit_ttt_attention), ("fused", fused_ttt_attention)):
        outs = [attention(queries[k], keys[:k + 1], values[:k + 1]) for k in range(1, 4)]
        grads = torch.autograd.grad(sum((out ** 2).sum() for out in outs), queries[1:] + keys + values)
        results[name] = (outs, grads)
    for ours, theirs in zip(results["fused"][0] + list(results["fused"][1]),
                            results["explicit"][0] + list(results["explicit"][1])):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)
