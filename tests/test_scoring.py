import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.modeling.scoring import late_interaction, late_interaction_matrix, maxsim_matrix


def late_interaction_loop(q, d, q_mask, d_mask):
    """Eq. 1 written the obvious way."""
    total = 0.0
    for i in range(q.shape[0]):
        if not q_mask[i]:
            continue
        best = None
        for j in range(d.shape[0]):
            if d_mask[j]:
                value = float(q[i] @ d[j])
                best = value if best is None else max(best, value)
        total += best if best is not None else 0.0
    return total


def random_masks(generator, batch, length):
    mask = torch.rand(batch, length, generator=generator) > 0.3
    mask[:, 0] = True
    return mask


@settings(max_examples=40, deadline=None)
@given(bq=st.integers(1, 4), bd=st.integers(1, 4), lq=st.integers(1, 6), ld=st.integers(1, 7),
       dim=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_late_interaction_matrix_equals_loop(bq, bd, lq, ld, dim, seed):
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(bq, lq, dim, generator=g), torch.randn(bd, ld, dim, generator=g)
    q_mask, d_mask = random_masks(g, bq, lq), random_masks(g, bd, ld)
    scores = late_interaction_matrix(q, d, q_mask, d_mask)
    for a in range(bq):
        for b in range(bd):
            assert scores[a, b].item() == pytest.approx(late_interaction_loop(q[a], d[b], q_mask[a], d_mask[b]),
                                                        abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(bd=st.integers(1, 5), lq=st.integers(1, 6), ld=st.integers(1, 7), masked=st.booleans(),
       seed=st.integers(0, 10_000))
def test_one_query_against_many_documents_equals_loop(bd, lq, ld, masked, seed):
    """Full ranking scores one query at a time, through its own product (maxsim_matrix's Bq == 1 path)."""
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(1, lq, 4, generator=g), torch.randn(bd, ld, 4, generator=g)
    q_mask = random_masks(g, 1, lq)
    d_mask = random_masks(g, bd, ld) if masked else torch.ones(bd, ld, dtype=torch.bool)
    if masked:
        d_mask[-1] = False  # a document with no token left scores 0
    scores = late_interaction_matrix(q, d, q_mask, d_mask if masked else None)
    assert scores.shape == (1, bd)
    for b in range(bd):
        assert scores[0, b].item() == pytest.approx(late_interaction_loop(q[0], d[b], q_mask[0], d_mask[b]), abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), lq=st.integers(1, 6), ld=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_paired_late_interaction_is_diagonal_of_matrix(b, lq, ld, seed):
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(b, lq, 5, generator=g), torch.randn(b, ld, 5, generator=g)
    q_mask, d_mask = random_masks(g, b, lq), random_masks(g, b, ld)
    torch.testing.assert_close(late_interaction(q, d, q_mask, d_mask),
                               late_interaction_matrix(q, d, q_mask, d_mask).diagonal())


def test_masked_document_tokens_never_win():
    q = torch.tensor([[[1.0, 0.0]]])
    d = torch.tensor([[[1.0, 0.0], [0.5, 0.0]]])  # the best token is masked out
    assert late_interaction(q, d, None, torch.tensor([[False, True]])).item() == pytest.approx(0.5)
    # a query token that is masked contributes nothing; a document with no token left scores 0
    q2 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    assert late_interaction(q2, d, torch.tensor([[False, True]]), None).item() == pytest.approx(0.0)
    assert maxsim_matrix(q, d, torch.tensor([[False, False]])).item() == 0.0


def test_gradients_flow_to_both_sides():
    q = torch.randn(2, 3, 4, requires_grad=True)
    d = torch.randn(2, 5, 4, requires_grad=True)
    late_interaction(q, d).sum().backward()
    assert q.grad.abs().sum() > 0 and d.grad.abs().sum() > 0
