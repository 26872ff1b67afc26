"""`specdec distill` trains on a batch at a time: the EAGLE-3 head's
training forward packs a batch's sequences row after row (one GEMM per
projection for the whole batch, attention per sequence), a draft model runs
them right-padded under an attention mask. Each must compute, for every
sequence, what it computes for that sequence alone, and the head exactly
what the served head computes."""
from __future__ import annotations

import pytest
import torch

SEQ_LENGTHS = (23, 9, 3, 17)  # unequal: padding and packing offsets are exercised; 3: rows run out at step 2


@pytest.fixture(scope="module")
def target(stories_path):
    from specdec.engine.checkpoint import load_hf_model

    return load_hf_model(stories_path)


def _data(target, lengths=SEQ_LENGTHS, top_k: int = 4) -> dict:
    """Training data as teacher_data lays it out, drawn at random: tokens,
    the answer's start (the last prompt position), the teacher's top-K rows
    from there on, and the fused layers' features at every position."""
    from specdec.distill_eagle3 import eagle3_layers

    gen = torch.Generator().manual_seed(0)
    cfg = target.config
    feature_dim = cfg.hidden_size * len(eagle3_layers(target))
    data: dict = {"tokens": [], "start": [], "top_ids": [], "top_logp": [], "features": []}
    for n in lengths:
        start = n // 3
        data["tokens"].append(torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist())
        data["start"].append(start)
        answer = n - 1 - start  # one teacher row per answer token, predicted from the position before it
        data["top_ids"].append(torch.randint(0, cfg.vocab_size, (answer, top_k), generator=gen).int())
        data["top_logp"].append(torch.log_softmax(torch.randn(answer, top_k, generator=gen), -1))
        data["features"].append(torch.randn(n, feature_dim, generator=gen).to(torch.bfloat16))
    return data


def _student(target, data):
    from specdec.distill_eagle3 import Eagle3Student, eagle3_layers, hot_tokens

    student = Eagle3Student(target, eagle3_layers(target), hot_tokens(data, target.config.vocab_size, 200))
    with torch.no_grad():  # away from the target's copy, so that every weight matters
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[student.hot] = torch.arange(len(student.hot))
    return student, t2d_index


@pytest.mark.parametrize("steps", [3, 5])
def test_a_packed_batch_gives_each_sequence_its_loss_and_gradient_alone(target, steps):
    """The loss of sequences packed together is the position-weighted mean
    of their losses alone, and so is its gradient: no row reads another
    sequence's rows or the padding (also where a short sequence's rows run
    out before the last chained step)."""
    from specdec.distill_eagle3 import eagle3_loss

    data = _data(target)
    student, t2d_index = _student(target, data)

    def loss_and_grad(rows):
        student.zero_grad()
        loss, count = eagle3_loss(student, data, rows, t2d_index, steps)
        loss.backward()
        return loss.detach(), count, torch.cat([p.grad.flatten() for p in student.parameters()])

    rows = list(range(len(SEQ_LENGTHS)))
    together, count, grad = loss_and_grad(rows)
    alone = [loss_and_grad([r]) for r in rows]
    assert count == sum(c for _, c, _ in alone) > 0
    torch.testing.assert_close(together, sum(loss * c for loss, c, _ in alone) / count, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, sum(g * c for _, c, g in alone) / count, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_chained_steps_skip_the_rows_no_loss_reads_and_give_the_same_loss_and_gradient(target, steps):
    """Chained steps compute only rows whose output a loss reads (at that
    step or through their own chain later): not the prompt's rows before
    start - steps, nor rows past the answer. Loss and gradient are those of
    computing every row."""
    from specdec.distill_eagle3 import Pack, eagle3_loss

    data = _data(target, lengths=(23, 9, 30))
    student, t2d_index = _student(target, data)
    rows = [0, 1, 2]

    def loss_and_grad(every_row):
        student.zero_grad()
        loss, count = eagle3_loss(student, data, rows, t2d_index, steps, every_row)
        loss.backward()
        return loss.detach(), count, torch.cat([p.grad.flatten() for p in student.parameters()])

    pack = Pack(data, rows, steps)
    n = len(pack.local)
    assert pack.keep[0] is None and all(len(pack.keep[s]) < n for s in range(1, steps))
    assert all(set(pack.loss_rows[s].tolist()) <= set(pack.keep[s].tolist()) for s in range(1, steps))
    assert 0 not in pack.keep[1].tolist()  # a prompt row: its sequence (23 tokens) starts its answer at 7
    every, count, grad = loss_and_grad(True)
    skipping, count2, grad2 = loss_and_grad(False)
    assert count == count2 > 0
    torch.testing.assert_close(skipping, every, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad2, grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("row", [0, 5, 15])
def test_the_training_forward_is_what_the_served_head_computes(target, stories_path, tmp_path, row):
    """Step 0 of the training forward is the served head over the real rows;
    chained step s at row i is the served head's chain step after rows
    0..i, fed its own output: the head that serving loads, from what
    training saved, gives the same final-normed rows."""
    from specdec.distill_eagle3 import TTT_STEPS, Pack
    from specdec.engine.llama import rms_norm
    from specdec.proposer_svc.eagle3 import HeadCache, HeadItem, load_eagle3

    data = _data(target, lengths=(11, SEQ_LENGTHS[0]))  # the row's sequence second: packed after another
    student, _ = _student(target, data)
    student.save(tmp_path)
    head = load_eagle3(str(tmp_path), stories_path)
    eps = head.spec.rms_norm_eps
    with torch.no_grad():
        trained = student(Pack(data, [0, 1], TTT_STEPS, every_row=True), TTT_STEPS)  # per step: [N, hidden]
    offset = len(data["tokens"][0]) - 1  # packed rows of the first sequence
    tokens = torch.tensor(data["tokens"][1])
    feats = head.fuse(data["features"][1][:len(tokens) - 1].float())
    cache = HeadCache(head.spec.num_kv_heads, head.spec.head_dim)
    out, _ = head.forward([HeadItem(cache, tokens[1:row + 2], feats[:row + 1])])  # real rows 0..row
    served = [rms_norm(out, head.w["final_norm"], eps)]
    for s in range(1, TTT_STEPS):
        out, _ = head.forward([HeadItem(cache, tokens[row + 1 + s:row + 2 + s], out[-1:])])
        served.append(rms_norm(out, head.w["final_norm"], eps))
    torch.testing.assert_close(trained[0][offset:offset + row + 1], served[0], rtol=1e-4, atol=1e-4)
    for s in range(1, TTT_STEPS):
        torch.testing.assert_close(trained[s][offset + row], served[s][-1], rtol=1e-4, atol=1e-4)


def test_a_draft_trains_on_a_padded_batch_as_on_each_sequence_alone(target):
    """The draft's loss over a right-padded batch is the position-weighted
    mean of its losses alone, and so is its gradient: the mask keeps each
    row to its own sequence, the padding out of the loss."""
    from specdec.distill import distill_loss, student_from_target

    data = _data(target)
    student = student_from_target(target, 2)
    rows = list(range(len(SEQ_LENGTHS)))

    def loss_and_grad(batch):
        student.zero_grad()
        loss, count = distill_loss(student, data, batch)
        loss.backward()
        return loss.detach(), count, torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])

    together, count, grad = loss_and_grad(rows)
    alone = [loss_and_grad([r]) for r in rows]
    assert count == sum(c for _, c, _ in alone) == sum(n - 1 - n // 3 for n in SEQ_LENGTHS)
    torch.testing.assert_close(together, sum(loss * c for loss, c, _ in alone) / count, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, sum(g * c for _, c, g in alone) / count, rtol=1e-4, atol=1e-6)
