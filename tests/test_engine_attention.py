"""The engine's batch assembly and batched decode attention (tierkv/engine/attention.py)."""

import torch

from tierkv.engine.attention import ForwardBatch, causal_attention, decode_attention


def test_build_moves_every_index_and_keeps_the_per_sequence_meaning():
    seqs = [(torch.tensor([7, 3, 9, 4, 1]), 2), (torch.tensor([5, 6]), 1), (torch.tensor([8, 2, 0]), 3),
            (torch.tensor([11, 12, 13, 14]), 1)]
    batch = ForwardBatch.build([50, 51, 52, 53, 54, 55, 56], seqs, [True, True, False, True], torch.device("cpu"))
    assert batch.input_ids.tolist() == [50, 51, 52, 53, 54, 55, 56]
    assert batch.positions.tolist() == [3, 4, 1, 0, 1, 2, 3]
    assert batch.out_slots.tolist() == [4, 1, 6, 8, 2, 0, 14]
    assert batch.sample_rows.tolist() == [1, 2, 6]  # the last new token of each sampling sequence
    assert [(s.q_start, s.q_end, s.kv_slots.tolist()) for s in batch.seqs] == [(0, 2, [7, 3, 9, 4, 1]),
                                                                              (3, 6, [8, 2, 0])]
    decode = batch.decode
    assert decode.q_rows.tolist() == [2, 6]
    assert decode.slots.tolist() == [[5, 6, 5, 5], [11, 12, 13, 14]]  # padded with the row's first slot
    assert decode.padding.tolist() == [[False, False, True, True], [False] * 4]
    buffer = torch.randn(16, 2, 3)
    assert torch.equal(decode.gather(buffer), buffer[decode.slots])


def test_a_batch_without_decodes_has_no_decode_group():
    batch = ForwardBatch.build([1, 2], [(torch.tensor([3, 4]), 2)], [True], torch.device("cpu"))
    assert batch.decode is None and len(batch.seqs) == 1


def test_batched_decode_equals_each_sequence_alone():
    g = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 1, 9], 4, 2, 8
    width = max(lengths)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    k = torch.randn(len(lengths), width, kv_heads, dim, generator=g)
    v = torch.randn(len(lengths), width, kv_heads, dim, generator=g)
    padding = torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]
    k[padding], v[padding] = 1e30, 1e30  # padded keys must not count, whatever they hold
    got = decode_attention(q, k, v, padding, 0.3)
    for b, n in enumerate(lengths):
        kb = k[b, :n].repeat_interleave(heads // kv_heads, dim=1)
        vb = v[b, :n].repeat_interleave(heads // kv_heads, dim=1)
        want = causal_attention(q[b:b + 1], kb, vb, n - 1, 0.3)
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-6)
